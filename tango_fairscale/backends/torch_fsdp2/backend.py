"""
PyTorch's FSDP2 as a :class:`~tango_fairscale.backends.base.Backend` (``backend: "torch"``): the
model sharded by :mod:`.sharding`, checkpoints through DCP (:mod:`.checkpoint`).
"""

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn
from tango.common import Lazy
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import Model

from ... import checkpointing
from ...checkpointing.streaming import stream_save
from ...fsdp_options import FSDPOptions
from ...launch import multihost
from ...materialize import parameters_on_meta
from ...precision import announce
from ...wrapping import WrapPlan, recorded_plan, require_parameters
from ..base import Backend, LoadedCheckpoint, MemoryModel, ModelSource, UnitShape
from . import checkpoint, sharding
from .memory_model import TorchMemoryModel

logger = logging.getLogger(__name__)


class TorchBackend(Backend):
    """PyTorch's :func:`~torch.distributed.fsdp.fully_shard` (FSDP2), each parameter a sharded DTensor."""

    name = "torch"
    format_description = "DCP"
    supports_hybrid_sharding = True
    # FSDP2 shards parameters of any dtype; MixedPrecisionPolicy casts from theirs.
    low_precision_parameters = (torch.bfloat16, torch.float16)
    # FSDP2 gathers into and frees one tensor per parameter, not one per unit (2.25 to 9 MiB each
    # for GPT-2 of width 768): under the fairscale backend's 16 MiB those fragment the heap. At 4
    # MiB the larger ones get mappings of their own while a step's smaller tensors (its
    # activations: 3 MiB each for the benchmark's GPT-2) come from the heap, reused from step to
    # step rather than paged in anew; what outlives a step is a long-lived allocation
    # (cpu/memory.py). Measured against 2 and 16 MiB in docs/benchmarks-backends.md (speed: set
    # through MALLOC_MMAP_THRESHOLD_, long-lived allocations off; capacity: in the code, on).
    cpu_mmap_threshold = 4 << 20

    @classmethod
    def memory_model(
        cls, fsdp_config: FSDPOptions, units: Sequence[UnitShape], world_size: int, element_size: int
    ) -> MemoryModel:
        return TorchMemoryModel.from_config(fsdp_config, units, world_size, element_size)

    @classmethod
    def check_options(cls, fsdp_config: Any, where: str) -> None:
        sharding.check_options(fsdp_config, where=where)

    @classmethod
    def check_wrapper_options(cls, wrapper: Mapping[str, Any]) -> None:
        if wrapper.get("offload_activations"):
            raise ConfigurationError(
                "model.offload_activations: not supported by the torch backend (torch's checkpoint wrapper "
                'has no activation offload); remove it or use backend: "fairscale".'
            )

    # --- its checkpoints -------------------------------------------------------------------------

    @classmethod
    def owns(cls, marker: Mapping[str, Any]) -> bool:
        return checkpoint.is_torch_checkpoint(marker)

    @classmethod
    def files_of_worker(cls, marker: Mapping[str, Any], rank: int) -> List[str]:
        # Its per-worker files, and the DCP data files it wrote (the model's and optimizer's shards).
        return super().files_of_worker(marker, rank) + checkpoint.dcp_files_of_worker(marker, rank)

    # --- training --------------------------------------------------------------------------------

    def build(self, model: Union[Model, Lazy[Model]]) -> nn.Module:
        """Build the model (on ``meta`` with ``init_on_meta``), then shard it by its wrap plan."""
        context = self.context
        if isinstance(model, Lazy):
            with parameters_on_meta() if context.init_on_meta else nullcontext():
                model = model.construct()
        else:
            refuse_sharded_model(model, self.name)
        require_parameters(model)
        self.note_model(model)
        plan = recorded_plan(model) or WrapPlan.root_only()
        # Hybrid sharding: a 2-D mesh, shards within each host, replicas across hosts.
        topology = context.topology
        hosts = topology.num_hosts if context.hybrid_sharding else 1
        mesh = sharding.make_mesh(topology.world_size, hosts)
        if context.rank == 0:
            logger.info(
                "Sharding over the device mesh %s %s",
                mesh.mesh_dim_names,
                " x ".join(str(size) for size in mesh.shape),
            )
        cast: Dict[str, int] = {}
        sharded = sharding.shard_model(
            model, plan, context.fsdp_config, mesh, precision=context.precision, cast=cast
        )
        announce(context.precision, cast, context.rank)
        return sharded

    def make_grad_scaler(self, amp_dtype: torch.dtype) -> Any:
        return sharding.make_grad_scaler(amp_dtype, "cpu" if self.context.on_cpu else "cuda")

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        return sharding.no_sync(model)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> None:
        sharding.clip_grad_norm_(model, max_norm)

    # --- checkpoints -----------------------------------------------------------------------------

    def save(
        self,
        checkpoint_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        states: Mapping[str, Any],
        step: Optional[int],
    ) -> None:
        # The model and optimizer shards through DCP, the rest per worker, then the marker.
        checkpoint.save_sharded(
            checkpoint_dir,
            model,
            optimizer,
            states,
            step=step,
            topology=self.context.topology,
            complete_part=self.context.complete_part(self.files_of_worker),
            base=self.base,
            fields=self.marker_fields() if self.context.topology.is_leader(self.context.rank) else {},
        )

    def load(
        self, checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> LoadedCheckpoint:
        # DCP reads each worker's part of the saved shards, for any number of workers.
        try:
            states = checkpoint.load_sharded(
                checkpoint_dir,
                model,
                optimizer,
                hashes=self.context.verify_checkpoints,
                base=self.base,
                # Each host's first worker hashes the pretrained files; the others check sizes.
                hash_base=self.context.topology.is_leader(self.context.rank),
            )
        except checkpointing.CheckpointError as error:
            raise multihost.explain_part(error, checkpoint_dir) from None
        marker = checkpointing.read_marker(checkpoint_dir)
        assert marker is not None  # load_sharded checked it
        world_size = self.context.train_config.world_size
        resharded = marker["world_size"] != world_size
        if resharded:
            logger.info(
                "Resharding checkpoint %s from %d to %d workers",
                checkpoint_dir,
                marker["world_size"],
                world_size,
            )
        random_state = states.pop("random_state", None)
        self.note_resumed(marker)
        return LoadedCheckpoint(states, None if resharded else random_state, resharded=resharded)

    def write_weights(self, checkpoint_dir: Path, weights_path: Path) -> None:
        hosts, verify = self.context.hosts, self.context.verify_checkpoints
        if hosts is None:
            source = self.model_source(checkpoint_dir, hashes=verify)
            stream_save(source.entries, source.produce, weights_path)
            return
        # Each host's leader fetches the DCP data files it lacks (one per worker: save_sharded
        # writes single_file_per_rank; they hold the optimizer state besides the model's).
        with multihost.received_files_dir(checkpoint_dir) as received_dir:
            multihost.receive_missing_files(
                checkpoint_dir,
                hosts,
                lambda marker, rank: next(iter(checkpoint.dcp_files_of_worker(marker, rank)), None),
                received_dir,
            )
            part = checkpoint.dcp_part_model_source(checkpoint_dir, received_dir, hashes=verify)
            stream_save(part.entries, part.produce, weights_path)

    @classmethod
    def model_source(cls, checkpoint_dir: Path, *, hashes: bool = True) -> ModelSource:
        return checkpoint.dcp_model_source(checkpoint_dir, hashes=hashes)

    @classmethod
    def consolidate(
        cls, checkpoint_dir: Path, *, with_optimizer: bool, progress: Optional[Callable[[], None]] = None
    ) -> Dict[str, Any]:
        # DCP reads every worker's file in one call.
        result = checkpoint.consolidate_dcp(checkpoint_dir, with_optimizer=with_optimizer)
        if progress is not None:
            progress()
        return result

    @classmethod
    def files_to_read(cls, marker: Mapping[str, Any], with_optimizer: bool) -> int:
        return 1


def refuse_sharded_model(model: nn.Module, backend: str) -> None:
    """
    A model already holding FSDP units of another implementation (FairScale's, or torch's FSDP1:
    both keep the wrapped module as ``_fsdp_wrapped_module``) cannot be sharded again by FSDP2.
    """
    if any(hasattr(module, "_fsdp_wrapped_module") for module in model.modules()):
        raise ConfigurationError(
            f'training_engine.backend: "{backend}" got a model with FSDP units already in it: pass the '
            "model to the engine unconstructed (as a config does), so that the backend applies "
            'with_wrapped_modules\' plan itself, or use backend: "fairscale" for a FairScale-wrapped model.'
        )
