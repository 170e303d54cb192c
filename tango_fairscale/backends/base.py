"""
The interface every sharding backend implements, and what the engine hands it.

The engine (:class:`~tango_fairscale.FairScaleTrainingEngine`) is Tango's adapter: it turns
Tango's calls (build the model, backward, clip, save, load, write ``weights.pt``) into calls of
one :class:`Backend`, chosen by name (:func:`tango_fairscale.backends.backend_class`), and holds no
branch on which one. What both backends share is written once, outside them: the commit of a
checkpoint (:mod:`tango_fairscale.checkpointing.commit`), the resume point
(:mod:`tango_fairscale.checkpointing.resume`), the streaming of ``weights.pt``
(:mod:`tango_fairscale.checkpointing.streaming`).
"""

import dataclasses
from abc import ABC, abstractmethod
from pathlib import Path
from typing import (
    Any,
    Callable,
    ClassVar,
    ContextManager,
    Dict,
    List,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    Union,
)

import torch
import torch.nn as nn
from tango.common import Lazy
from tango.integrations.torch import Model, TrainConfig

from .. import checkpointing
from ..checkpointing import model_records, pretrained_base
from ..checkpointing.streaming import TensorEntry
from ..config import FSDPConfig
from ..cpu.memory import MMAP_THRESHOLD_BYTES
from ..finetune.lora import adapter_config_of
from ..launch import HostWorld, multihost
from ..topology import Topology

#: The marker's field holding the peft adapter's config, for a model holding a ``PeftModel``.
ADAPTER_FIELD = "peft_adapter"


class ModelSource(Protocol):
    """A consolidated model state dict, one tensor at a time (either backend's checkpoint)."""

    @property
    def entries(self) -> Sequence[TensorEntry]: ...

    def produce(self, entry: TensorEntry) -> torch.Tensor: ...


@dataclasses.dataclass
class BackendContext:
    """What a backend needs of the engine's configuration and of the run's workers."""

    #: The worker's Tango ``TrainConfig`` (across hosts, the global one).
    train_config: TrainConfig
    #: The root unit's FSDP options.
    fsdp_config: FSDPConfig
    #: Build the model on ``meta`` and allocate each unit right before it is sharded.
    init_on_meta: bool
    #: Shard within each host, replicate across hosts (torch backend only).
    hybrid_sharding: bool
    #: Check every checkpoint file's SHA-256 before reading it.
    verify_checkpoints: bool
    #: The hosts of a launch across hosts, ``None`` on one host.
    hosts: Optional[HostWorld]
    #: Whether the workers compute on CPUs (gloo) rather than GPUs (NCCL).
    on_cpu: bool

    @property
    def topology(self) -> Topology:
        if self.hosts is not None:
            return self.hosts.topology
        return Topology.one_host(self.train_config.world_size)

    @property
    def rank(self) -> int:
        return self.train_config.worker_id

    def complete_part(
        self, files_of_worker: "multihost.FilesOfWorker"
    ) -> Optional[Callable[[Path, Dict[str, Any]], None]]:
        """
        What a host's leader adds to its marker across hosts (see :mod:`tango_fairscale.launch.multihost`);
        ``files_of_worker`` is the writing backend's :meth:`Backend.files_of_worker`.
        """
        if self.hosts is None:
            return None
        hosts = self.hosts
        return lambda checkpoint_dir, fields: multihost.complete_part(
            checkpoint_dir, hosts, fields, files_of_worker
        )


@dataclasses.dataclass
class LoadedCheckpoint:
    """What a backend restored into the model and optimizer, and the rest for the engine to apply."""

    #: The replicated states by name (``trainer``, ``lr_scheduler``, ``grad_scaler``), those saved.
    states: Dict[str, Any]
    #: The worker's random generator states, ``None`` when resharded (they do not map onto new workers).
    random_state: Optional[Dict[str, Any]]
    #: Whether the checkpoint was saved by another number of workers.
    resharded: bool


class Backend(ABC):
    """One FSDP implementation: how a model is sharded, trained, saved, loaded and consolidated."""

    #: The name in ``training_engine.backend``.
    name: ClassVar[str]
    #: Whether ``hybrid_sharding`` (shards within a host, replicas across hosts) is possible.
    supports_hybrid_sharding: ClassVar[bool] = False
    #: On CPU workers, allocations of this many bytes or more get their own memory mappings
    #: (:func:`~tango_fairscale.cpu.memory.limit_cpu_heap_growth`): the size of the buffers this
    #: backend allocates and frees every step, below which they fragment the heap.
    cpu_mmap_threshold: ClassVar[int] = MMAP_THRESHOLD_BYTES

    #: What the checkpoints' format is called in messages (which backend wrote one, and how).
    format_description: ClassVar[str]

    def __init__(self, context: BackendContext) -> None:
        self.context = context
        #: The model's frozen parameters that are pretrained tensors, unchanged (under
        #: ``init_on_meta``): checkpoints name them instead of holding them. Set by ``note_model``.
        self.base: Optional[pretrained_base.PretrainedBase] = None
        #: The peft adapter's config (``adapter_config.json``'s fields) of a model holding a
        #: ``PeftModel``: recorded in each checkpoint, so that ``consolidate`` writes the adapter.
        self.adapter_config: Optional[Dict[str, Any]] = None

    def note_model(self, model: nn.Module) -> None:
        """What the checkpoints record of the model, noted by ``build`` before it wraps it."""
        self.base = pretrained_base.frozen_base(model) if self.context.init_on_meta else None
        self.adapter_config = adapter_config_of(model)

    def note_resumed(self, marker: Mapping[str, Any]) -> None:
        """
        After a checkpoint of ``marker`` is loaded: the frozen base is what it named as its base
        too (:meth:`~tango_fairscale.checkpointing.pretrained_base.PretrainedBase.after_resuming`).
        A parameter frozen now that the checkpoint held was trained by the run that saved it:
        left to the pretrained files, ``weights.pt`` and the export would have reverted it.
        """
        if self.base is not None:
            self.base = self.base.after_resuming(marker)

    def model_fields(self) -> Dict[str, Any]:
        """The marker's fields about the model (its pretrained base, its adapter); for a host's leader."""
        fields: Dict[str, Any] = {}
        if self.base is not None:
            fields[pretrained_base.MARKER_FIELD] = self.base.marker_fields()
        if self.adapter_config is not None:
            fields[ADAPTER_FIELD] = self.adapter_config
        if fields:  # listed with their digests: one removed or edited later is refused
            fields[model_records.RECORDS_FIELD] = model_records.digests(fields)
        return fields

    # --- its checkpoints, told by their marker ---------------------------------------------------

    @classmethod
    @abstractmethod
    def owns(cls, marker: Mapping[str, Any]) -> bool:
        """
        Whether this backend wrote the checkpoint whose marker this is. Exactly one backend owns
        a marker (:func:`tango_fairscale.backends.lookup.backend_of` asks them in turn), and the
        answer reads the marker alone: nothing of the backend's libraries is needed.
        """

    @classmethod
    def files_of_worker(cls, marker: Mapping[str, Any], rank: int) -> List[str]:
        """
        The files worker ``rank`` wrote into a checkpoint of this backend, relative to its
        directory: its ``worker{rank}_*.pt`` files (the marker's ``files``), and any the backend adds.
        """
        names = checkpointing.saved_file_names(dict(marker))
        return [checkpointing.worker_file(Path(), rank, name).name for name in names]

    # --- options ---------------------------------------------------------------------------------

    @classmethod
    def check_options(cls, fsdp_config: FSDPConfig, where: str) -> None:
        """Refuse, naming the field, every ``fsdp_config`` field this backend cannot honour."""
        return None  # by default every field is honoured

    @classmethod
    def check_wrapper_options(cls, wrapper: Mapping[str, Any]) -> None:
        """Refuse, naming the field, ``with_wrapped_modules`` options this backend cannot honour."""
        return None  # by default every option is honoured

    # --- training --------------------------------------------------------------------------------

    @abstractmethod
    def build(self, model: Union[Model, Lazy[Model]]) -> nn.Module:
        """Construct (if lazy) and shard the model by its wrap plan; return the sharded model."""

    @abstractmethod
    def make_grad_scaler(self, amp_dtype: torch.dtype) -> Any:
        """The loss scaler for AMP in ``amp_dtype`` (``None`` where nothing needs scaling)."""

    @abstractmethod
    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """Backward passes inside keep their gradients local (no reduce-scatter)."""

    @abstractmethod
    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> None:
        """Clip the gradients to a total norm of ``max_norm``, computed across all shards."""

    # --- checkpoints -----------------------------------------------------------------------------

    @abstractmethod
    def save(
        self,
        checkpoint_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        states: Mapping[str, Any],
        step: Optional[int],
    ) -> None:
        """
        Save a checkpoint through :func:`tango_fairscale.checkpointing.commit.commit`: the model's
        and optimizer's shards in the backend's format, and ``states`` (name -> replicated or
        per-worker state) as this worker's files. Collective.
        """

    @abstractmethod
    def load(
        self, checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> LoadedCheckpoint:
        """
        Load a checkpoint of this backend (resolved) into ``model`` and ``optimizer``, resharding
        from another number of workers; every file checked before anything is applied, and a bad
        one a :class:`~tango_fairscale.errors.CheckpointError` on every worker. Collective.
        """

    @abstractmethod
    def write_weights(self, checkpoint_dir: Path, weights_path: Path) -> None:
        """
        Write the plain model's state dict of ``checkpoint_dir`` to ``weights_path`` one tensor
        at a time, on each host's leader (across hosts, after fetching the other hosts' files).
        """

    @classmethod
    @abstractmethod
    def model_source(cls, checkpoint_dir: Path, *, hashes: bool = True) -> ModelSource:
        """The plain model's state dict of a complete checkpoint of this backend, one tensor at a time."""

    @classmethod
    @abstractmethod
    def consolidate(
        cls, checkpoint_dir: Path, *, with_optimizer: bool, progress: Optional[Callable[[], None]] = None
    ) -> Dict[str, Any]:
        """The plain model's (with ``with_optimizer``, and the optimizer's) state dict of a checkpoint."""

    @classmethod
    @abstractmethod
    def files_to_read(cls, marker: Mapping[str, Any], with_optimizer: bool) -> int:
        """How many times :meth:`consolidate` calls ``progress``."""
