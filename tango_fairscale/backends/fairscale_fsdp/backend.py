"""
FairScale's FSDP (flat per-unit shards) as a :class:`~tango_fairscale.backends.base.Backend`: the
default backend. Its checkpoints are one set of ``worker{r}_*.pt`` files per worker, resharded
for another number of workers by :mod:`.resharding`'s arithmetic.
"""

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import torch
import torch.distributed as dist
import torch.nn as nn
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.optim.grad_scaler import ShardedGradScaler
from tango.common import Lazy, Tqdm
from tango.integrations.torch import Model

from ... import checkpointing, compat
from ...checkpointing import pretrained_base
from ...checkpointing.commit import Digests, commit
from ...checkpointing.compatible import check_same_optimizer
from ...checkpointing.streaming import stream_save
from ...compat import fairscale_flat_groups as flat_groups
from ...compiling import compile_unit
from ...devices import worker_computes_on_cpu, worker_device
from ...errors import WrapConfigurationError
from ...fsdp_options import FSDPOptions
from ...launch import HostWorld, multihost
from ...materialize import has_meta_parameters, materialize_module, parameters_on_meta, real_parameters
from ...precision import FLOAT32_MASTER, Precision, announce
from ...wrapping import WrapPlan, recorded_plan, replace_submodule, require_parameters
from ..base import Backend, LoadedCheckpoint, MemoryModel, ModelSource, UnitShape
from ..lookup import check_written_by, holds_worker_files
from .bucketing import sufficient_bucket_cap_mb
from .memory_model import FairScaleMemoryModel
from .resharding import (
    ConsolidatedModel,
    check_same_parameter_shapes,
    clean_parameter_name,
    consolidate_model_state,
    consolidate_optimizer_state,
    module_aliases,
    original_names,
    reshard_model_weights,
    reshard_optimizer_state,
    same_shapes,
)

logger = logging.getLogger(__name__)

#: The states besides the replicated ones that every worker saves: its shards.
SHARDED_STATES = ("model", "optimizer")

#: Why the fairscale backend checkpoints only modules that are FSDP units of their own. FairScale's
#: checkpoint is reentrant: each checkpointed module's backward is an autograd run of its own,
#: which ends in its unit's gradient hook; FairScale then frees the unit's gathered parameters and
#: reduce-scatters its gradient. A unit holding several checkpointed modules (or one and other
#: layers) lost its parameters after the first one's backward ("storage of size 0", "data is
#: not allocated yet" in the next one's recomputation).
CHECKPOINT_WITHOUT_UNITS = (
    "with_wrapped_modules.activation_checkpointing without fsdp_config: the fairscale backend checkpoints "
    "only modules that are FSDP units of their own (FairScale frees a unit's parameters at the end "
    "of the first checkpointed backward inside it). Add fsdp_config: {} to with_wrapped_modules, "
    'or use the engine\'s backend: "torch".'
)


class FairScaleBackend(Backend):
    """FairScale's :class:`~fairscale.nn.FullyShardedDataParallel`, on GPUs (NCCL) and CPU workers (gloo)."""

    name = "fairscale"
    format_description = "FairScale's flat shards"
    supports_hybrid_sharding = False
    # FairScale's FSDP takes float32 parameters, or float16 ones in its pure float16 mode only
    # (its constructor's "Expecting FP16 param type" checks): no pure bfloat16.
    low_precision_parameters = ()

    #: ``(canonical, alias)`` paths of modules reachable under several names, saved with the model.
    module_aliases: List[Any] = []

    @classmethod
    def memory_model(
        cls, fsdp_config: FSDPOptions, units: Sequence[UnitShape], world_size: int, element_size: int
    ) -> MemoryModel:
        return FairScaleMemoryModel.from_config(fsdp_config, units, world_size, element_size)

    @classmethod
    def wrap_unit(cls, fsdp_config: FSDPOptions, module: nn.Module) -> nn.Module:
        return wrap(fsdp_config, module)

    @classmethod
    def check_wrapper_options(cls, wrapper: Mapping[str, Any]) -> None:
        if wrapper.get("activation_checkpointing") and wrapper.get("fsdp_config") is None:
            raise WrapConfigurationError(CHECKPOINT_WITHOUT_UNITS)

    # --- its checkpoints -------------------------------------------------------------------------

    @classmethod
    def owns(cls, marker: Mapping[str, Any]) -> bool:
        # Its markers name no backend and no format: it wrote checkpoints before the torch
        # backend, whose markers say both, existed.
        return "backend" not in marker and "format" not in marker

    # --- training --------------------------------------------------------------------------------

    def build(self, model: Union[Model, Lazy[Model]]) -> nn.Module:
        """Build the model (on ``meta`` with ``init_on_meta``), apply its wrap plan, wrap the root."""
        context = self.context
        if isinstance(model, Lazy):
            with parameters_on_meta() if context.init_on_meta else nullcontext():
                model = model.construct()
        require_parameters(model)
        self.note_model(model)
        plan = recorded_plan(model) or WrapPlan.root_only()
        root_config = context.fsdp_config
        # FairScale expects offloaded parameters to start on the CPU.
        root_device = (
            torch.device("cpu")
            if root_config.move_params_to_cpu
            else context.train_config.worker_local_default_device
        )
        with real_parameters():
            cast = apply_wrap_plan(model, plan, worker_device(), precision=context.precision)
            if has_meta_parameters(model):
                # The root's own parameters: those the plan's units did not take.
                materialize_module(
                    model,
                    root_device,
                    root=model,
                    one_allocation=root_config.flatten_parameters,
                    is_unit=is_unit,
                )
        if not worker_computes_on_cpu() and not root_config.move_params_to_cpu:
            model.to(context.train_config.worker_local_default_device)
        self.module_aliases = module_aliases(model)
        for name, count in context.precision.cast_parameters(model, skip=is_unit).items():
            cast[name] = cast.get(name, 0) + count
        announce(context.precision, cast, context.rank)
        root = wrap(root_config, model)
        # FairScale makes the bucket all units share at the first forward, of the root's size:
        # no larger than the gradients that go into it (bucketing.py), the same collectives.
        configured = root.bucket_cap_mb
        root.bucket_cap_mb = sufficient_bucket_cap_mb(configured, reduced_gradients(root))
        logger.debug("Reduce-scatter bucket: %s MiB (bucket_cap_mb %s)", root.bucket_cap_mb, configured)
        return root

    def make_grad_scaler(self, amp_dtype: torch.dtype) -> Any:
        # Loss scaling exists for float16's narrow range; bfloat16 has float32's.
        return ShardedGradScaler() if amp_dtype == torch.float16 else None

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        return model.no_sync()  # type: ignore[operator,no-any-return]

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> None:
        if not worker_computes_on_cpu():
            model.clip_grad_norm_(max_norm)  # type: ignore[operator]
            return
        # FairScale's clip_grad_norm_ moves the norm to CUDA; on CPU workers compute the same
        # thing here: every worker holds a disjoint shard (padding is zero), so the squared
        # norms add up across workers.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        local = torch.zeros((), dtype=torch.float32)
        for grad in grads:
            local += grad.detach().float().pow(2).sum()
        dist.all_reduce(local)
        total_norm = local.sqrt()
        clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.detach().mul_(clip_coef.to(grad.dtype))

    # --- checkpoints -----------------------------------------------------------------------------

    @staticmethod
    def _optimizer_keys(model: nn.Module, optimizer: torch.optim.Optimizer) -> List[str]:
        """The local state-dict key of each parameter, in the optimizer's state order."""
        names = {id(p): clean_parameter_name(n) for n, p in model.named_parameters()}
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]

    def save(
        self,
        checkpoint_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        states: Mapping[str, Any],
        step: Optional[int],
    ) -> None:
        fsdp: FSDP = model  # type: ignore[assignment]
        config = self.context.train_config
        rank = config.worker_id
        metadata = fsdp.local_metadata_dict()
        weights = fsdp.local_state_dict()
        left_out = self._base_keys(weights, metadata)
        fields: Dict[str, Any] = {"training_steps": step, "files": sorted([*SHARDED_STATES, *states])}
        if self.context.topology.is_leader(rank):  # the processes that write markers
            fields.update(self.marker_fields())

        def write() -> Digests:
            files: Dict[str, Any] = {
                "model": {
                    "weights": {key: value for key, value in weights.items() if key not in left_out},
                    "metadata": metadata,
                    "optimizer_keys": self._optimizer_keys(model, optimizer),
                    "module_aliases": self.module_aliases,
                },
                "optimizer": optimizer.state_dict(),
                **states,
            }
            digests: Digests = {}
            for name, state in Tqdm.tqdm(
                files.items(), desc=f"Saving checkpoint {checkpoint_dir.name}", leave=False, disable=rank != 0
            ):
                digests.update(self.write_file(checkpoint_dir, name, state, step))
            return digests

        commit(
            checkpoint_dir,
            self.context.topology,
            rank,
            write,
            fields,
            complete_part=self.context.complete_part(self.files_of_worker),
        )

    def _base_keys(self, weights: Mapping[str, Any], metadata: Dict[str, Any]) -> List[str]:
        """The flat parameters (local state-dict keys) that hold only the pretrained frozen base."""
        if self.base is None:
            return []
        names = self.base.names
        flat = {_flat_key(unit, backing) for unit in metadata["param_metadata"] for backing in unit["params"]}
        return [
            key
            for key in weights
            if key in flat and all(name in names for name in original_names(key, metadata))
        ]

    def write_file(self, checkpoint_dir: Path, name: str, state: Any, step: Optional[int]) -> Digests:
        """
        Write one of this worker's checkpoint files (``name`` is ``"model"``, ``"optimizer"``, ...),
        with the header that ties it to this worker, world size and step; return its digest.
        """
        config = self.context.train_config
        path = checkpointing.worker_file(checkpoint_dir, config.worker_id, name)
        state = checkpointing.with_header(
            state, kind=name, rank=config.worker_id, world_size=config.world_size, step=step
        )
        return {path.name: checkpointing.atomic_save(state, path)}

    def _loadable_marker(self, checkpoint_dir: Path) -> Dict[str, Any]:
        """
        The marker of a checkpoint this worker can load: a complete one, or (across hosts) this
        host's part of one of the same world size that holds this worker's files, which is all
        a worker reads when nothing is resharded.
        """
        config = self.context.train_config
        marker = checkpointing.read_marker(checkpoint_dir) if checkpoint_dir.is_dir() else None
        if marker is not None:
            check_written_by(checkpoint_dir, marker, self.name)
            if self.context.hosts is not None and holds_worker_files(
                checkpoint_dir, marker, config.world_size, config.worker_id
            ):
                return marker
        try:
            return checkpointing.require_complete(checkpoint_dir)
        except checkpointing.CheckpointError as error:
            raise multihost.explain_part(error, checkpoint_dir) from None

    def load(
        self, checkpoint_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> LoadedCheckpoint:
        marker = self._loadable_marker(checkpoint_dir)
        saved_world_size = marker["world_size"]
        config = self.context.train_config
        worker, world_size = config.worker_id, config.world_size
        # Replicated state (scheduler, scaler, trainer) is the same in every worker's file;
        # a worker that did not exist in the saved run reads worker 0's.
        source_worker = worker if worker < saved_world_size else 0
        saved_names = checkpointing.saved_file_names(marker)
        verify = self.context.verify_checkpoints

        def load(name: str, from_worker: int = source_worker, mmap: bool = False, hashes: bool = True) -> Any:
            # Checked against the marker's size and SHA-256 and the file's own header.
            return checkpointing.read_worker_state(
                checkpoint_dir, marker, from_worker, name, mmap=mmap, hashes=hashes and verify
            )

        fsdp: FSDP = model  # type: ignore[assignment]
        local_weights = fsdp.local_state_dict()
        local_metadata = fsdp.local_metadata_dict()
        # Flat parameters of the pretrained frozen base the checkpoint left out: the model holds
        # them already, read from the same files (checked below).
        kept: Dict[str, torch.Tensor] = {}
        # Everything is read and checked before anything is applied, and the workers agree on the
        # outcome: a worker that finds a bad file must not leave the others waiting in a collective.
        try:
            own_model = load("model")
            check_same_parameter_shapes(own_model["metadata"], local_metadata)
            kept = self._kept_base(own_model["weights"], local_weights, local_metadata, marker)
            local_weights = {key: value for key, value in local_weights.items() if key not in kept}
            same_layout = saved_world_size == world_size and same_shapes(own_model["weights"], local_weights)
            if same_layout:
                model_shards, optimizer_shards = [own_model], [load("optimizer")]
            else:
                # Every worker needs a slice of every saved file: mapped, not read whole, so that a
                # host running N workers does not hold N copies of the full model and optimizer.
                # Each file's SHA-256 is checked by one worker, not all.
                model_shards = [
                    load("model", w, mmap=True, hashes=w % world_size == worker)
                    for w in range(saved_world_size)
                ]
                optimizer_shards = [
                    load("optimizer", w, mmap=True, hashes=w % world_size == worker)
                    for w in range(saved_world_size)
                ]
            _check_same_optimizer(optimizer_shards[0], optimizer, checkpoint_dir)
            states: Dict[str, Any] = {
                name: load(name)
                for name in ("lr_scheduler", "grad_scaler", "trainer")
                if name in saved_names or name == "trainer"
            }
            saved_random_state = (
                load("random_state")
                if "random_state" in saved_names and saved_world_size == world_size
                else None
            )
            problem = None
        except checkpointing.CheckpointError as error:
            problem = str(error)
        problems: List[Optional[str]] = [None] * world_size
        dist.all_gather_object(problems, problem)
        found = [(rank, text) for rank, text in enumerate(problems) if text is not None]
        if found:
            rank, text = found[0]
            raise checkpointing.CheckpointError(
                f"Cannot resume from {checkpoint_dir} (found by worker {rank}"
                f"{f' and {len(found) - 1} other(s)' if len(found) > 1 else ''}): {text}"
            )

        if same_layout:
            fsdp.load_local_state_dict({**own_model["weights"], **kept})
            optimizer.load_state_dict(optimizer_shards[0])
        else:
            logger.info(
                "Resharding checkpoint %s from %d to %d workers", checkpoint_dir, saved_world_size, world_size
            )
            fsdp.load_local_state_dict({**reshard_model_weights(model_shards, local_weights, worker), **kept})
            optimizer.load_state_dict(
                reshard_optimizer_state(
                    model_shards,
                    optimizer_shards,
                    local_weights,
                    self._optimizer_keys(model, optimizer),
                    worker,
                )
            )
        self.note_resumed(marker)
        return LoadedCheckpoint(states, saved_random_state, resharded=saved_world_size != world_size)

    def _kept_base(
        self,
        saved: Mapping[str, Any],
        local: Mapping[str, torch.Tensor],
        metadata: Dict[str, Any],
        marker: Mapping[str, Any],
    ) -> Dict[str, torch.Tensor]:
        """
        This model's flat parameters that the checkpoint left out, checked to be the pretrained
        frozen base of both (same tensors, unchanged files); raises ``CheckpointError`` otherwise.
        """
        missing = [key for key in local if key not in saved]
        if not missing:
            return {}
        base = pretrained_base.saved_base(marker)
        names = [name for key in missing for name in original_names(key, metadata)]
        pretrained_base.check_same_base(base, self.base, names)
        assert base is not None  # check_same_base refused a checkpoint without one
        # Each host's first worker hashes the files; the others check their sizes.
        pretrained_base.check_files(
            base,
            hashes=self.context.verify_checkpoints and self.context.topology.is_leader(self.context.rank),
        )
        return {key: local[key] for key in missing}

    def write_weights(self, checkpoint_dir: Path, weights_path: Path) -> None:
        hosts, verify = self.context.hosts, self.context.verify_checkpoints
        if hosts is None:
            source = self.model_source(checkpoint_dir, hashes=verify)
        else:
            # Tango calls this on each host's first worker only (is_local_main_process): they
            # exchange what they lack, so every host's weights.pt is the whole model.
            source = ConsolidatedModel(gather_model_shards(checkpoint_dir, hosts, hashes=verify))
            marker = checkpointing.read_marker(checkpoint_dir) or {}
            source = pretrained_base.with_base(source, marker, hashes=verify)
        stream_save(source.entries, source.produce, weights_path)

    @classmethod
    def model_source(cls, checkpoint_dir: Path, *, hashes: bool = True) -> ModelSource:
        marker = checkpointing.require_complete(checkpoint_dir)
        shards = [
            # Mapped and shared: the pages are the page cache's, not this process's private memory.
            checkpointing.read_worker_state(
                checkpoint_dir, marker, worker, "model", mmap=True, shared=True, hashes=hashes
            )
            for worker in range(marker["world_size"])
        ]
        return pretrained_base.with_base(ConsolidatedModel(shards), marker, hashes=hashes)  # type: ignore[no-any-return]

    @classmethod
    def consolidate(
        cls, checkpoint_dir: Path, *, with_optimizer: bool, progress: Optional[Callable[[], None]] = None
    ) -> Dict[str, Any]:
        marker = checkpointing.require_complete(checkpoint_dir)
        kinds = ["model", "optimizer"] if with_optimizer else ["model"]
        loaded: Dict[str, Any] = {kind: [] for kind in kinds}
        for kind in kinds:
            for worker in range(marker["world_size"]):
                # Checked against the marker's sizes and hashes and the file's own header.
                loaded[kind].append(checkpointing.read_worker_state(checkpoint_dir, marker, worker, kind))
                if progress is not None:
                    progress()
        if pretrained_base.saved_base(marker) is None:
            model_state: Dict[str, torch.Tensor] = consolidate_model_state(loaded["model"])
        else:  # the frozen base left to the pretrained files
            source = pretrained_base.with_base(ConsolidatedModel(loaded["model"]), marker)
            model_state = pretrained_base.materialize(source)
        if not with_optimizer:
            return model_state
        return {
            "model": model_state,
            "optimizer": consolidate_optimizer_state(loaded["model"], loaded["optimizer"]),
        }

    @classmethod
    def files_to_read(cls, marker: Mapping[str, Any], with_optimizer: bool) -> int:
        return int(marker["world_size"]) * (2 if with_optimizer else 1)


def _check_same_optimizer(
    saved: Dict[str, Any], optimizer: torch.optim.Optimizer, checkpoint_dir: Path
) -> None:
    """A checkpoint of another optimizer (type or options) would fail deep in PyTorch with a KeyError."""
    check_same_optimizer([list(group) for group in saved.get("param_groups", [])], optimizer, checkpoint_dir)


def apply_wrap_plan(
    model: nn.Module, plan: WrapPlan, device: torch.device, *, precision: Precision = FLOAT32_MASTER
) -> Dict[str, int]:
    """
    Apply ``plan`` to ``model`` in place with FairScale: each selected module, deepest first (so
    that a parent is wrapped after, and around, its wrapped children), is allocated if its
    parameters are on ``meta`` (``init_on_meta``: one unit at a time, right before it is sharded),
    checkpointed with FairScale's :func:`checkpoint_wrapper` if the plan says so, and made an FSDP
    unit with the plan's ``unit_config``. A unit may hold frozen and trainable parameters: they
    become two flat parameters (patch F7), and the frozen one gets no gradient. Right before a
    unit is made, its parameters are cast to the dtype ``precision`` holds them in. Needs a
    process group when the plan has FSDP units. Returns how many parameters were cast, by dtype.
    """
    if plan.checkpointed and not plan.fsdp:
        raise WrapConfigurationError(CHECKPOINT_WITHOUT_UNITS)
    unit_config = plan.unit_config if plan.unit_config is not None else FSDPOptions()
    # FairScale expects offloaded parameters to start on the CPU.
    offload = plan.fsdp and unit_config.move_params_to_cpu
    unit_device = torch.device("cpu") if offload or not plan.fsdp else device
    units = set(plan.fsdp_units)
    cast: Dict[str, int] = {}
    for name in plan.selected:
        module = model.get_submodule(name)
        if name in units and has_meta_parameters(module):
            materialize_module(
                module,
                unit_device,
                root=model,
                one_allocation=unit_config.flatten_parameters,
                is_unit=is_unit,
            )
        if name in units:
            for dtype, count in precision.cast_parameters(module, skip=is_unit).items():
                cast[dtype] = cast.get(dtype, 0) + count
        if name in plan.checkpointed:
            module = checkpoint_wrapper(module, offload_to_cpu=plan.offload_activations)
        if plan.compile is not None and name in plan.compiled:
            compile_unit(module, plan.compile, name)
        if name in units:
            module = wrap(unit_config, module)
        replace_submodule(model, name, module)
    logger.debug(
        "Wrapped %d submodule(s)%s%s",
        len(plan.selected),
        " in FSDP" if plan.fsdp else "",
        f", {len(plan.checkpointed)} checkpointed" if plan.checkpointed else "",
    )
    return cast


def is_unit(module: nn.Module) -> bool:
    """Whether ``module`` is already a FairScale FSDP unit (materialising skips what is inside one)."""
    return isinstance(module, FSDP)


def reduced_gradients(root: FSDP) -> Iterator[Tuple[int, int, int]]:
    """
    ``(numel, element size, workers)`` of each gradient FairScale reduce-scatters in a backward of
    ``root`` (:func:`~.bucketing.sufficient_bucket_cap_mb`): every sharded trainable flat
    parameter's, whole, in the dtype it is reduced in (the compute dtype under mixed precision,
    unless ``fp32_reduce_scatter``), over its unit's reduce-scatter group.
    """
    for unit in root.modules():
        if not isinstance(unit, FSDP):
            continue
        workers = unit.process_group_reduce_scatter.size()
        low_precision = unit.mixed_precision and not unit.fp32_reduce_scatter
        for param in unit.params:
            if param.requires_grad and getattr(param, "_is_sharded", False):
                dtype = unit.compute_dtype if low_precision else param.dtype
                yield param._orig_size.numel(), torch.empty((), dtype=dtype).element_size(), workers


def wrap(config: FSDPOptions, module: nn.Module) -> FSDP:
    """
    Wrap ``module`` in :class:`~fairscale.nn.FullyShardedDataParallel` with ``config``'s options
    (what :meth:`FSDPConfig.wrap <tango_fairscale.config.FSDPConfig.wrap>` does). Needs an
    initialised default process group. On CPU workers (no CUDA, or a gloo process group) it
    computes on the CPU, with :func:`~tango_fairscale.compat.enable_cpu_fsdp`.
    """
    kwargs = config.as_kwargs()
    if worker_computes_on_cpu():
        compat.enable_cpu_fsdp()
        kwargs["compute_device"] = torch.device("cpu")
        if config.mixed_precision:
            kwargs["compute_dtype"] = config.resolved_compute_dtype(on_cpu=True)
        if config.move_params_to_cpu or config.move_grads_to_cpu:
            # Nothing to move on a CPU worker, and FairScale would try to pin memory.
            logger.debug("move_params_to_cpu/move_grads_to_cpu have no effect on CPU workers")
        kwargs["move_params_to_cpu"] = False
        kwargs["move_grads_to_cpu"] = False
        unit = FSDP(module, **kwargs)
        # Gathered parameters freed before the flat gradient is assembled: a unit's size less in
        # each unit's backward (F8).
        flat_groups.release_early_in(unit)
        return unit
    return FSDP(module, **kwargs)


def gather_model_shards(
    checkpoint_dir: Path, world: HostWorld, *, hashes: bool = True
) -> List[Dict[str, Any]]:
    """
    Every worker's model state of a checkpoint of this backend, on the first worker of each host
    (call it on each of them, and only there: it exchanges point-to-point with the others only).
    Files this host has are read here (and checked against the marker, SHA-256 with ``hashes``);
    the others are sent by the first worker of the host that wrote them
    (:func:`~tango_fairscale.launch.multihost.receive_missing_files`) into a temporary directory beside
    the checkpoint.
    """
    checkpoint_dir = Path(checkpoint_dir)
    with multihost.received_files_dir(checkpoint_dir) as received_dir:
        received = multihost.receive_missing_files(
            checkpoint_dir,
            world,
            lambda marker, rank: checkpointing.worker_file(Path(), rank, "model").name,
            received_dir,
        )
        marker = checkpointing.read_marker(checkpoint_dir)
        if marker is None:
            raise checkpointing.CheckpointError(f"{checkpoint_dir} has no {checkpointing.MARKER}.")
        shards = []
        for rank in range(world.world_size):
            sent = checkpointing.worker_file(Path(), rank, "model").name in received
            shards.append(
                checkpointing.read_worker_state(
                    received_dir if sent else checkpoint_dir,
                    marker,
                    rank,
                    "model",
                    # Mapped and shared, so that consolidating holds none of it in private memory;
                    # the mapping outlives the received file's removal.
                    mmap=True,
                    shared=True,
                    # A received file was hashed on arrival.
                    hashes=hashes and not sent,
                )
            )
    if world.node_rank == 0:
        logger.info("Gathered the model files of %d workers on %d hosts", world.world_size, world.num_nodes)
    return shards


def _flat_key(unit: Mapping[str, Any], backing_name: str) -> str:
    """The local state-dict key of a unit's flat parameter, as its shard metadata names it."""
    return f"{unit['fsdp_path']}.{backing_name}" if unit["fsdp_path"] else backing_name
