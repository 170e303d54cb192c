"""
The interface every sharding backend implements, and what the engine hands it.

The engine (:class:`~tango_fairscale.FairScaleTrainingEngine`) is Tango's adapter: it turns
Tango's calls (build the model, backward, clip, save, load, write ``weights.pt``) into calls of
one :class:`Backend`, chosen by name (:func:`tango_fairscale.backends.backend_class`), and holds no
branch on which one. What both backends share is written once, outside them: the commit of a
checkpoint (:mod:`tango_fairscale.checkpointing.commit`), the resume point
(:mod:`tango_fairscale.checkpointing.resume`), the streaming of ``weights.pt``
(:mod:`tango_fairscale.checkpointing.streaming`). What a backend holds of a training step's
memory, for ``plan``, is its :class:`MemoryModel` (:meth:`Backend.memory_model`).
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
    Tuple,
    Union,
)

import torch
import torch.nn as nn
from tango.common import Lazy
from tango.integrations.torch import Model, TrainConfig

from .. import checkpointing
from ..checkpointing import model_records, pretrained_base
from ..checkpointing.streaming import TensorEntry
from ..cpu.memory import MMAP_THRESHOLD_BYTES
from ..finetune.lora import adapter_config_of
from ..fsdp_options import FSDPOptions
from ..launch import HostWorld, multihost
from ..precision import Precision
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
    fsdp_config: FSDPOptions
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
    #: The dtype each parameter is held and updated in; applied to a unit right before it is sharded.
    precision: Precision = dataclasses.field(default_factory=Precision)

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


# --- what a backend holds of a training step, for ``plan`` ----------------------------------------


class UnitShape(Protocol):
    """One FSDP unit as a memory model sees it: its sizes (``plan``'s :class:`~tango_fairscale.plan.Unit`)."""

    #: Parameters the unit owns (not those of units nested in it), and of them those that train.
    numel: int
    trainable_numel: int
    #: Bytes per element of its gathered parameters (its compute dtype).
    compute_element_size: int

    def shards(self, world_size: int) -> Tuple[int, int]:
        """Elements of its trainable and of its frozen parameters on each of ``world_size`` workers."""
        ...


class MemoryLedger(Protocol):
    """Where a memory model counts what no operation of the step shows (``plan``'s ``LiveTensorBytes``)."""

    def hold(self, kind: str, size: int) -> None:
        """Count ``size`` more bytes (less, if negative) of ``kind`` (:data:`GRADIENTS`, ...)."""


#: The kinds a memory model holds on a :class:`MemoryLedger`: gradient shards that stay after backward,
#: and what reducing the units' gradients takes for a while (a whole gradient, a reduce-scatter bucket).
GRADIENTS = "gradients"
GATHERED_GRADIENTS = "gathered_gradients"


@dataclasses.dataclass(frozen=True)
class MemoryModel(ABC):
    """
    What a backend holds of a training step's memory, in bytes, from its units' sizes alone: no
    process group, no tensor (``python -m tango_fairscale plan``, ``docs/plan.md``). Made by
    :meth:`Backend.memory_model` for a config's root ``fsdp_config`` and its world.
    """

    world_size: int
    #: Bytes per element of the parameters as they are kept: their shards, the gradient shards.
    element_size: int
    #: The root's ``fp32_reduce_scatter``: gradients reduced in the parameters' precision.
    fp32_reduce_scatter: bool = False
    #: Whether each unit's parameters are one flat parameter (its optimizer updates one tensor per unit).
    flat: bool = False
    #: The reduce-scatter bucket, in MiB (``0``: every unit's gradient reduced on its own).
    bucket_cap_mb: int = 0

    #: Whether the backend reduce-scatters small gradients through a bucket (``bucket_cap_mb``).
    reduce_scatter_bucket: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_config(
        cls, fsdp_config: FSDPOptions, units: Sequence[UnitShape], world_size: int, element_size: int
    ) -> "MemoryModel":
        """The model for a step whose root has ``fsdp_config`` and whose FSDP units are ``units``."""

    def gradient_element_size(self, unit: UnitShape) -> int:
        """Bytes per element of ``unit``'s whole gradient as it is reduced."""
        return self.element_size if self.fp32_reduce_scatter else unit.compute_element_size

    def gathered_bytes(self, unit: UnitShape) -> int:
        """
        What ``unit`` takes while gathered: its whole parameters in the compute dtype, and under
        mixed precision the shard cast to that dtype to be gathered (both backends do both).
        """
        shard = sum(unit.shards(self.world_size)) if unit.compute_element_size != self.element_size else 0
        return (unit.numel + shard) * unit.compute_element_size

    def reducing_bytes(self, unit: UnitShape, gradients: int) -> int:
        """
        What reducing ``unit``'s gradient allocates for a while besides its parameters' gradients
        (``gradients`` bytes of them): their whole gradient joined for the reduce-scatter (one flat
        gradient under FairScale, one reduce-scatter input under FSDP2), and with
        ``fp32_reduce_scatter`` a float32 copy of it besides.
        """
        if self.fp32_reduce_scatter and unit.compute_element_size < self.element_size:
            gradients += unit.trainable_numel * self.element_size
        return gradients

    @abstractmethod
    def gradient_bytes(self, units: Sequence[UnitShape], world_size: int) -> int:
        """The gradients of ``units`` that a worker of ``world_size`` holds after backward, sharded."""

    @abstractmethod
    def reduce_scatter(self, ledger: MemoryLedger, accumulating: bool) -> "ReduceScatter":
        """
        The reduce-scatters of one backward, holding their memory on ``ledger``; ``accumulating``:
        later micro-batches add their gradients into the shards the first one made.
        """


class ReduceScatter:
    """
    The reduce-scatters of one backward, at the moments they hold memory: each unit's gradient
    reduced on its own, into a shard that stays (added in place to the shard of an earlier
    micro-batch when ``accumulating``). A backend that buckets gradients extends it.
    """

    def __init__(self, model: MemoryModel, ledger: MemoryLedger, accumulating: bool) -> None:
        self.model = model
        self.ledger = ledger
        self.accumulating = accumulating

    def gradient_joined(self, unit: UnitShape) -> None:
        """``unit``'s whole gradient, joined (:meth:`MemoryModel.reducing_bytes`), is to be reduced."""
        return None

    def gradient_reduced(self, unit: UnitShape) -> None:
        """``unit``'s gradient reduced, its whole gradient and gathered parameters freed: its shard stays."""
        if not self.accumulating:
            self.ledger.hold(GRADIENTS, unit.shards(self.model.world_size)[0] * self.model.element_size)

    def finish(self) -> None:
        """The end of backward: every unit's gradient reduced."""
        return None


class Backend(ABC):
    """One FSDP implementation: how a model is sharded, trained, saved, loaded and consolidated."""

    #: The name in ``training_engine.backend``.
    name: ClassVar[str]
    #: Whether ``hybrid_sharding`` (shards within a host, replicas across hosts) is possible.
    supports_hybrid_sharding: ClassVar[bool] = False
    #: The parameter dtypes below float32 it can train in (``training_engine.param_dtype``).
    low_precision_parameters: ClassVar[Tuple[torch.dtype, ...]] = ()
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

    def marker_fields(self) -> Dict[str, Any]:
        """
        What a host's leader writes into each checkpoint's marker besides the files: the unique id
        of the step that wrote it (a rerun resumes only its own: ``resume.check_own``) and the
        model's fields.
        """
        return {checkpointing.STEP_ID_FIELD: self.context.train_config.step_id, **self.model_fields()}

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
    def check_options(cls, fsdp_config: FSDPOptions, where: str) -> None:
        """Refuse, naming the field, every ``fsdp_config`` field this backend cannot honour."""
        return None  # by default every field is honoured

    @classmethod
    def check_wrapper_options(cls, wrapper: Mapping[str, Any]) -> None:
        """Refuse, naming the field, ``with_wrapped_modules`` options this backend cannot honour."""
        return None  # by default every option is honoured

    # --- its memory, for ``plan`` ----------------------------------------------------------------

    @classmethod
    @abstractmethod
    def memory_model(
        cls, fsdp_config: FSDPOptions, units: Sequence[UnitShape], world_size: int, element_size: int
    ) -> MemoryModel:
        """
        What this backend holds of a training step's memory (:class:`MemoryModel`): for a step
        whose root has ``fsdp_config`` and whose FSDP units are ``units``, on ``world_size``
        workers, its parameters of ``element_size`` bytes each. No process group, no tensor.
        """

    @classmethod
    def wrap_unit(cls, fsdp_config: FSDPOptions, module: nn.Module) -> nn.Module:
        """
        ``module`` as one unit of this backend with ``fsdp_config``'s options, outside a wrap plan
        (``FSDPConfig.wrap``, for the users of ai2-tango's bundled integration).
        """
        raise NotImplementedError(f"the {cls.name} backend wraps units only through a wrap plan")

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
