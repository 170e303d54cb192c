"""
PyTorch's FSDP2 (:func:`torch.distributed.fsdp.fully_shard`) as a sharding backend: the library
half of the engine's ``backend: "torch"``.

FSDP2 shards each parameter as a :class:`~torch.distributed.tensor.DTensor` (dim 0 across the
mesh) instead of FairScale's flat per-unit buffers, works on CPU meshes over gloo as well as on
GPUs over NCCL, and saves checkpoints through ``torch.distributed.checkpoint``
(:mod:`tango_fairscale.backends.torch_fsdp2.checkpoint`). This module maps the FairScale-shaped
:class:`~tango_fairscale.FSDPConfig` onto it, field by field (:data:`OPTION_TABLE`, checked by
:func:`check_options`), and applies a :class:`~tango_fairscale.WrapPlan` (:func:`shard_model`).

Each decision was made against torch 2.13's ``torch/distributed/fsdp/_fully_shard`` sources;
``docs/torch-backend.md`` renders the table (:func:`render_option_table`).
"""

import logging
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from tango.common.exceptions import ConfigurationError
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from ... import compat
from ...compiling import compile_unit
from ...devices import worker_computes_on_cpu
from ...fsdp_options import FSDPOptions, parse_dtype
from ...materialize import has_meta_parameters, materialize_module, real_parameters
from ...precision import FLOAT32_MASTER, Precision
from ...wrapping import WrapPlan, disable_hf_kv_cache, replace_submodule
from .collectives import UnitBuffers, use_ring_collectives

logger = logging.getLogger(__name__)

#: The backend's name in messages and in the engine's ``backend`` option.
BACKEND = "torch"

#: FairScale's default ``bucket_cap_mb``; with ``0`` the only values FSDP2's behaviour matches.
_DEFAULT_BUCKET_CAP_MB = 25

#: Every :class:`FSDPConfig` field -> (its FSDP2 meaning, or ``None`` where FSDP2 has none and only
#: the default is accepted; why). :func:`check_options` enforces the refusals, :func:`shard_model`
#: applies the mappings, ``docs/torch-backend.md`` renders this table.
OPTION_TABLE: Dict[str, Tuple[Optional[str], str]] = {
    "reshard_after_forward": (
        "`fully_shard(reshard_after_forward=...)` of each unit",
        "Same meaning: free a unit's unsharded parameters after forward and all-gather them again in "
        "backward. Passed explicitly, so FSDP2's own root rule (`None`: root keeps them) does not apply; "
        "see `disable_reshard_on_root`.",
    ),
    "move_params_to_cpu": (
        "`fully_shard(offload_policy=CPUOffloadPolicy())` on GPU meshes; nothing on CPU meshes",
        "FSDP2's CPU offload keeps the sharded parameters and gradients, and so the optimizer step, in "
        "(pinned) CPU memory, copying each unit to the GPU for its all-gather: FairScale's meaning. On CPU "
        "workers everything already is in CPU memory, as with FairScale.",
    ),
    "move_grads_to_cpu": (
        "follows `move_params_to_cpu`: `CPUOffloadPolicy` offloads the sharded gradients as well",
        "FSDP2 offloads gradients only together with the parameters, so `true` without "
        "`move_params_to_cpu` is refused (`false` with it is refused by FSDPConfig already).",
    ),
    "mixed_precision": (
        "`MixedPrecisionPolicy(param_dtype=<compute dtype>, cast_forward_inputs=True)`",
        "FP32 sharded parameters (the optimizer's), all-gather and compute in the compute dtype, gradients "
        "reduced in it (unless `fp32_reduce_scatter`) and kept in FP32: FairScale's meaning. FSDP2 casts "
        "floating inputs at every unit, FairScale at the root only (inner units get inputs in that dtype).",
    ),
    "flatten_parameters": (
        "no effect: FSDP2 always does what either value asks for",
        "`true` buys one all-gather and one reduce-scatter per unit, `false` keeps the original parameters "
        "(names, shapes, per-parameter optimizer groups). FSDP2 does both: each parameter stays its own "
        "DTensor, and a unit's parameters are copied into one buffer per collective. Results do not depend "
        "on it.",
    ),
    "disable_reshard_on_root": (
        "the root's `reshard_after_forward = reshard_after_forward and not disable_reshard_on_root`",
        "Same meaning. FSDP2 would also keep the root unsharded, but only when `reshard_after_forward` is "
        "left `None`; this backend always passes it, so the root gets it from this rule. No effect on units "
        "(a unit is never the root).",
    ),
    "compute_dtype": (
        "`MixedPrecisionPolicy.param_dtype`; default float16 on GPUs, bfloat16 on CPU workers",
        "With `mixed_precision`: as FairScale (`FSDPConfig.resolved_compute_dtype`). Without it FSDP2 "
        "computes in the parameters' own dtype, so a `compute_dtype` other than float32 is refused there "
        "(FairScale's pure-float16 mode: leave it unset and build the model in float16).",
    ),
    "buffer_dtype": (
        "floating-point buffers of each unit cast to it (default: the compute dtype under "
        "`mixed_precision`) when the unit is sharded",
        "`MixedPrecisionPolicy` never touches buffers, so this backend casts them as FairScale does: else "
        "a float32 buffer would turn a unit's low-precision activations back into float32 and the next "
        "unit's matmul would fail without autocast. Without `mixed_precision` and unset, buffers keep "
        "their dtype. Checkpoints hold buffers in that dtype; loading consolidated weights into the plain "
        "model copies them into its buffers' dtype.",
    ),
    "fp32_reduce_scatter": (
        "`MixedPrecisionPolicy(reduce_dtype=torch.float32)`",
        "Same meaning: reduce-scatter the gradients in FP32 while computing in the compute dtype.",
    ),
    "bucket_cap_mb": (
        "FSDP2's one reduce-scatter per unit, which is FairScale's `bucket_cap_mb: 0`",
        "FSDP2 never buckets gradients across units. The default (25) and 0 are accepted; another size is "
        "refused, since no FSDP2 setting would honour it.",
    ),
    "no_broadcast_optim_state": (
        None,
        "FSDP2 has no full-optimizer-state gather with per-unit broadcasts: checkpoints save each worker's "
        "shards through DCP, and mixture-of-experts layers that differ per worker are not units FSDP2 "
        "shards. `true` is refused.",
    ),
    "state_dict_device": (
        "`full_state_dict()`: the device of the gathered tensors",
        "FSDP2's `state_dict()` is sharded (DTensors); `full_state_dict()` gathers it one tensor at a time "
        "and puts each on this device (default: the parameters' device). Checkpoints (DCP) are sharded "
        "and unaffected.",
    ),
    "state_dict_on_rank_0_only": (
        "`full_state_dict()`: ranks other than 0 get `{}`",
        "Every rank takes part in each gather; only rank 0 keeps the tensors. Checkpoints are unaffected.",
    ),
    "clear_autocast_cache": (
        "a forward hook on each unit that calls `torch.clear_autocast_cache()`",
        "FSDP2 has no such option; the hook does what FairScale does after each unit's forward, so the "
        "autocast cache does not keep the unit's low-precision weight copies alive.",
    ),
    "force_input_to_fp32": (
        "without `mixed_precision`: "
        "`MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=True)`",
        "FSDP2 casts floating inputs to `param_dtype`, and ignores a `param_dtype` equal to the parameters' "
        "own (float32), so only the inputs are cast. With `mixed_precision` it has no effect, as in "
        "FairScale.",
    ),
    "verbose": (
        "each unit's FSDP2 settings logged (INFO) when it is sharded",
        "FSDP2 modules keep their own class and `repr`; the log line gives what FairScale's verbose `repr` "
        "gave.",
    ),
    "gradient_predivide_factor": (
        None,
        "FSDP2 chooses the split itself: `ReduceOp.AVG` for float32/bfloat16 reductions, and for float16 "
        "a division by about sqrt(N) before and N/that after, FairScale's default rule. Its "
        "`set_gradient_divide_factor` sets the total divisor, not the split, so it would change the "
        "gradients' scale. A set factor is refused.",
    ),
    "allow_reset_parameters": (
        None,
        "FSDP2 does not guard `reset_parameters()` (so `false` is not enforced either), and calling it "
        "after sharding is wrong on CPU meshes: DTensor random ops there repeat the same values in every "
        "shard. Initialise before sharding (`init_on_meta` does, per unit). `true` is refused.",
    ),
}


def _refuse(where: str, field: str, value: Any, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"{where}.{field}: {value!r} is not supported by the {BACKEND} backend ({why}); "
        f'remove it or use backend: "fairscale".'
    )


def check_options(config: FSDPOptions, *, where: str = "FSDPConfig") -> None:
    """
    Raise a :class:`ConfigurationError` naming the field and the backend for every value FSDP2
    cannot honour (see :data:`OPTION_TABLE`); every other value is mapped by :func:`shard_model`.
    ``where`` is the field's place in the config (e.g. ``"training_engine.fsdp_config"``).
    """
    if config.move_grads_to_cpu and not config.move_params_to_cpu:
        raise _refuse(
            where,
            "move_grads_to_cpu",
            True,
            "FSDP2's CPUOffloadPolicy offloads gradients only together with the parameters; "
            "set move_params_to_cpu: true as well",
        )
    compute_dtype = parse_dtype("compute_dtype", config.compute_dtype)
    if not config.mixed_precision and compute_dtype not in (None, torch.float32):
        raise _refuse(
            where,
            "compute_dtype",
            config.compute_dtype,
            "without mixed_precision FSDP2 computes in the parameters' own dtype; set mixed_precision: true, "
            "or leave compute_dtype unset for a model built in that dtype",
        )
    if config.bucket_cap_mb not in (0, _DEFAULT_BUCKET_CAP_MB):
        raise _refuse(
            where,
            "bucket_cap_mb",
            config.bucket_cap_mb,
            "FSDP2 reduce-scatters each unit's gradients in one collective and never buckets across units, "
            "which is bucket_cap_mb: 0",
        )
    if config.no_broadcast_optim_state:
        raise _refuse(
            where,
            "no_broadcast_optim_state",
            True,
            "FSDP2 has no full optimizer-state gather to exempt units from; checkpoints are sharded",
        )
    if config.gradient_predivide_factor is not None:
        raise _refuse(
            where,
            "gradient_predivide_factor",
            config.gradient_predivide_factor,
            "FSDP2 splits the division itself (about sqrt(N) before a float16 reduction, an exact average "
            "otherwise) and set_gradient_divide_factor would change the total, not the split",
        )
    if config.allow_reset_parameters:
        raise _refuse(
            where,
            "allow_reset_parameters",
            True,
            "FSDP2 does not guard reset_parameters(), and calling it on sharded parameters repeats the same "
            "random values in every shard on CPU meshes; initialise before sharding (init_on_meta)",
        )


def render_option_table(with_reasons: bool = True) -> str:
    """
    :data:`OPTION_TABLE` as the Markdown table of ``docs/torch-backend.md``; without the reasons,
    that of ``docs/configuration.md``.
    """
    lines = (
        ["| field | FSDP2 meaning | why |", "|---|---|---|"]
        if with_reasons
        else ['| `FSDPConfig` field | with `backend: "torch"` |', "|---|---|"]
    )
    for field, (meaning, reason) in OPTION_TABLE.items():
        shown = meaning if meaning is not None else "none: **refused** unless left at its default"
        lines.append(f"| `{field}` | {shown} | {reason} |" if with_reasons else f"| `{field}` | {shown} |")
    return "\n".join(lines)


def fully_shard_kwargs(config: FSDPOptions, *, on_cpu: bool, root: bool) -> Dict[str, Any]:
    """
    The keyword arguments of :func:`fully_shard` for a unit (or, with ``root``, the root) with
    ``config``, on a CPU mesh or not. Call :func:`check_options` first.
    """
    reshard = config.reshard_after_forward and not (root and config.disable_reshard_on_root)
    if config.mixed_precision:
        mp_policy = MixedPrecisionPolicy(
            param_dtype=config.resolved_compute_dtype(on_cpu),
            reduce_dtype=torch.float32 if config.fp32_reduce_scatter else None,
            cast_forward_inputs=True,
        )
    elif config.force_input_to_fp32:
        # A param_dtype equal to the parameters' own is ignored for them (FSDPParam.init_dtype_attrs):
        # only the inputs are cast.
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=True)
    else:
        mp_policy = MixedPrecisionPolicy()
    # CPUOffloadPolicy pins memory, which needs CUDA; on CPU workers there is nothing to move.
    offload: OffloadPolicy = (
        CPUOffloadPolicy() if config.move_params_to_cpu and not on_cpu else OffloadPolicy()
    )
    return {"reshard_after_forward": reshard, "mp_policy": mp_policy, "offload_policy": offload}


def make_mesh(world_size: int, hosts: int = 1, device_type: Optional[str] = None) -> DeviceMesh:
    """
    The device mesh FSDP2 shards over. With one host, 1-D (``("shard",)``): every parameter
    sharded across all workers. With ``hosts`` > 1, 2-D ``("replicate", "shard")``: hybrid
    sharding (HSDP), each parameter sharded across the workers of a host (consecutive ranks) and
    replicated across hosts, so all-gathers stay within a host and only the gradient all-reduce
    crosses hosts. ``device_type`` defaults to ``"cpu"`` on CPU workers, else ``"cuda"``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("make_mesh needs an initialised default process group.")
    if world_size != dist.get_world_size():
        raise ConfigurationError(
            f"make_mesh: world_size {world_size} differs from the process group's {dist.get_world_size()}."
        )
    if hosts < 1 or world_size % hosts:
        raise ConfigurationError(
            f"make_mesh: {world_size} workers cannot be split evenly over {hosts} hosts."
        )
    if device_type is None:
        device_type = "cpu" if worker_computes_on_cpu() else "cuda"
    if hosts == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (hosts, world_size // hosts), mesh_dim_names=("replicate", "shard"))


def _modules_outside_units(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its descendants, not descending into FSDP2 units already sharded inside it."""
    stack = [module]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(child for child in current.children() if not isinstance(child, FSDPModule))


def _cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point buffers of ``module`` outside nested units, as FairScale's ``buffer_dtype``."""
    for submodule in _modules_outside_units(module):
        for name, buffer in submodule._buffers.items():
            if buffer is not None and torch.is_floating_point(buffer):
                submodule._buffers[name] = buffer.to(dtype)


def _clear_autocast_cache(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of ``clear_autocast_cache``: drop autocast's copies of the unit's weights."""
    torch.clear_autocast_cache()


def _materialize_device(config: FSDPOptions, mesh: DeviceMesh) -> torch.device:
    """Where ``meta`` parameters are allocated: offloaded ones start on the CPU (FSDP2 requires it)."""
    if mesh.device_type == "cpu" or config.move_params_to_cpu:
        return torch.device("cpu")
    handle = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())


def _shard(
    module: nn.Module,
    config: FSDPOptions,
    mesh: DeviceMesh,
    *,
    root: bool,
    name: str,
    unit_buffers: UnitBuffers,
) -> None:
    kwargs = fully_shard_kwargs(config, on_cpu=mesh.device_type == "cpu", root=root)
    buffer_dtype = parse_dtype("buffer_dtype", config.buffer_dtype)
    if buffer_dtype is None and config.mixed_precision:
        buffer_dtype = config.resolved_compute_dtype(mesh.device_type == "cpu")
    if buffer_dtype is not None:
        _cast_buffers(module, buffer_dtype)
    fully_shard(module, mesh=mesh, **kwargs)
    if mesh.device_type == "cpu":
        # Gloo's own all_gather_into_tensor / reduce_scatter_tensor copy whole buffers on CPU.
        use_ring_collectives(module, unit_buffers, root=root, name=repr(name) if name else "the root unit")
    if config.clear_autocast_cache:
        # Registered after fully_shard's own hooks, so it runs after the unit has resharded.
        module.register_forward_hook(_clear_autocast_cache)
    if config.verbose:
        logger.info(
            "fully_shard(%s): mesh=%s, %s, buffer_dtype=%s, clear_autocast_cache=%s",
            name or "<root>",
            mesh,
            kwargs,
            buffer_dtype,
            config.clear_autocast_cache,
        )


def checkpointed(module: nn.Module, on_cpu: bool) -> nn.Module:
    """
    ``module`` with its activations checkpointed (recomputed in backward), as :func:`shard_model`
    wraps a checkpointed module: on GPUs in torch's non-reentrant :func:`checkpoint_wrapper`, as
    upstream runs FSDP2; on a CPU mesh with FairScale's reentrant wrapper, as the fairscale backend
    (its autocast restored by patch F5; it returns ``module`` itself, its forward replaced).

    Why the CPU differs: a non-reentrant checkpoint runs the forward with autograd recording, so
    every operation of every checkpointed layer leaves its graph node (small allocations, kept until
    backward) in glibc's heap between that layer's freed activations, and the next layer's
    megabyte activations did not fit the holes: with each layer's activations checkpointed, a
    torch-backend LoRA worker's heap grew megabytes per layer that no live tensor held. A reentrant
    one runs the forward without autograd and records it during the recompute, one layer at a time.
    Measured together with S1 (``docs/capacity.md``, "LoRA vs full fine-tuning").
    """
    if on_cpu:
        from fairscale.nn.checkpoint import checkpoint_wrapper as reentrant_checkpoint_wrapper

        return reentrant_checkpoint_wrapper(module)
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def shard_model(
    model: nn.Module,
    plan: WrapPlan,
    root_config: FSDPOptions,
    mesh: DeviceMesh,
    *,
    precision: Precision = FLOAT32_MASTER,
    cast: Optional[Dict[str, int]] = None,
) -> nn.Module:
    """
    Apply ``plan`` to ``model`` in place with FSDP2 and return it: each selected module, deepest
    first, is allocated if its parameters are on ``meta``, checkpointed (:func:`checkpointed`) if
    the plan says so, and sharded if it is an
    FSDP unit with the plan's ``unit_config``; then the root's remaining ``meta`` parameters are
    allocated and the root is sharded with ``root_config``. On a CPU mesh it first installs patch S1
    (:func:`~tango_fairscale.compat.enable_cpu_fsdp2`: gathered parameters in mappings of their
    own). Frozen and trainable parameters may
    share a unit: each parameter is its own DTensor, and a frozen one gets no gradient.

    ``init_on_meta``: a unit's parameters are allocated whole and initialised on every worker
    (:func:`~tango_fairscale.materialize.materialize_module`, same seed, same order, so every
    worker holds the same values), then sharded at once, so a worker's peak is its shards plus one
    unit. FSDP2's usual recipe (shard on ``meta``, ``to_empty``, ``reset_parameters`` on the
    shards) is not used: on CPU meshes DTensor random ops repeat the same values in every shard,
    and on GPUs they draw other values than the FairScale backend does.

    Parameter names are the plain model's, plus ``_checkpoint_wrapped_module.`` inside modules
    checkpointed on GPUs; :func:`torch.distributed.checkpoint.state_dict.get_state_dict` and
    :func:`full_state_dict` drop that part. A plan without ``unit_config`` means FairScale's defaults
    (as ``fsdp_config: {}``). Needs an initialised process group and ``mesh`` (:func:`make_mesh`).

    Right before each unit (and the root) is sharded, its parameters are cast to the dtype
    ``precision`` holds them in (float32 master weights by default); ``cast`` gets the count of
    parameters cast, by dtype.
    """
    unit_config = plan.unit_config if plan.unit_config is not None else FSDPOptions()
    if plan.fsdp_units:
        check_options(unit_config, where="with_wrapped_modules.fsdp_config")
    check_options(root_config, where="training_engine.fsdp_config")
    units = set(plan.fsdp_units)
    on_cpu = mesh.device_type == "cpu"
    if on_cpu:
        compat.enable_cpu_fsdp2()
    unit_buffers = UnitBuffers()
    if plan.checkpointed:
        disable_hf_kv_cache(model)
    with real_parameters():
        # Deepest first, so that a parent is sharded after (and around) its sharded children: a
        # unit's parameters are those not already in a unit inside it.
        for name in plan.selected:
            module = model.get_submodule(name)
            if name in units and has_meta_parameters(module):
                materialize_module(
                    module, _materialize_device(unit_config, mesh), root=model, one_allocation=True
                )
            if name in plan.checkpointed:
                module = checkpointed(module, on_cpu)
                replace_submodule(model, name, module)
            if plan.compile is not None and name in plan.compiled:
                compile_unit(module, plan.compile, name)
            if name in units:
                _count(cast, precision.cast_parameters(module, skip=_is_unit))
                _shard(module, unit_config, mesh, root=False, name=name, unit_buffers=unit_buffers)
        if has_meta_parameters(model):
            materialize_module(model, _materialize_device(root_config, mesh), root=model, one_allocation=True)
        _count(cast, precision.cast_parameters(model, skip=_is_unit))
        _shard(model, root_config, mesh, root=True, name="", unit_buffers=unit_buffers)
    return model


def _is_unit(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def _count(total: Optional[Dict[str, int]], cast: Dict[str, int]) -> None:
    if total is not None:
        for dtype, count in cast.items():
            total[dtype] = total.get(dtype, 0) + count


_Parameters = Union[nn.Module, Iterable[torch.Tensor]]


def _grads(parameters: _Parameters) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    return params, [p.grad for p in params if p.grad is not None]


@torch.no_grad()
def clip_grad_norm_(parameters: _Parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """
    Clip the gradients of an FSDP2 model (or of ``parameters``) to a total norm of ``max_norm``
    and return that total norm (before clipping), a plain tensor equal on every worker.

    The gradients are DTensor shards: :func:`torch.nn.utils.get_total_norm` computes per-mesh
    norms as DTensors, whose ``full_tensor()`` reduces them across the shards; gradients on
    different meshes (or plain, replicated ones) are combined here, since ``torch.stack`` cannot
    mix them. Every worker must call this (it is collective).
    """
    params, grads = _grads(parameters)
    if not grads:
        return torch.zeros(())
    groups: Dict[Any, List[torch.Tensor]] = {}
    for grad in grads:
        key = ("dtensor", id(grad.device_mesh)) if isinstance(grad, DTensor) else ("plain", grad.device)
        groups.setdefault(key, []).append(grad)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.float())
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    total = stacked.max() if norm_type == float("inf") else torch.linalg.vector_norm(stacked, norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def make_grad_scaler(amp_dtype: torch.dtype, device_type: str) -> Optional[torch.amp.GradScaler]:
    """
    The loss scaler for AMP in ``amp_dtype``: ``None`` for bfloat16 (float32's range, nothing to
    scale) and float32, :class:`torch.amp.GradScaler` for float16.

    torch's plain ``GradScaler`` is right for FSDP2, unlike for FairScale: the gradients are
    DTensors, and DTensor dispatches ``_amp_foreach_non_finite_check_and_unscale_`` to a handler
    that max-reduces ``found_inf`` across the gradient's mesh
    (``torch/distributed/tensor/_dispatch.py``, ``found_inf_reduce_handler``), so a worker whose
    shard overflowed makes every worker skip the step. FSDP1's ``ShardedGradScaler`` would
    all-reduce again, to the same result. The engine refuses float16 AMP on CPU workers; this
    function does not decide that.
    """
    if amp_dtype != torch.float16:
        return None
    return torch.amp.GradScaler(device_type)


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """
    Gradient accumulation without communication, FSDP2's ``no_sync``: inside, backward passes
    skip the reduce-scatter (and HSDP's all-reduce) and accumulate unsharded gradients locally;
    the first backward outside reduces the sum. Use it around every micro-batch but the last.
    Costs each unit's full-size gradients in memory until then, as FairScale's ``no_sync``.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(f"no_sync needs a model sharded with fully_shard, got {type(model).__name__}.")
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_state_dict(model: nn.Module, config: Optional[FSDPOptions] = None) -> Dict[str, torch.Tensor]:
    """
    The plain model's state dict (unsharded tensors, plain names), gathered one tensor at a time:
    on ``config.state_dict_device`` (default: where the parameters are), and only on rank 0 with
    ``config.state_dict_on_rank_0_only`` (``{}`` elsewhere). Collective: every worker calls it.
    For checkpoints use :mod:`~tango_fairscale.backends.torch_fsdp2.checkpoint`, which never
    gathers.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    config = config or FSDPOptions()
    device = torch.device(config.state_dict_device) if config.state_dict_device is not None else None
    keep = not config.state_dict_on_rank_0_only or dist.get_rank() == 0
    result: Dict[str, torch.Tensor] = {}
    for key, value in get_model_state_dict(model).items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"full_state_dict: {key!r} is a {type(value).__name__}, not a tensor.")
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            result[key] = full.detach().to(device) if device is not None else full.detach()
    return result


#: What the engine needs, in one place.
__all__ = [
    "BACKEND",
    "OPTION_TABLE",
    "check_options",
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard_kwargs",
    "make_grad_scaler",
    "make_mesh",
    "no_sync",
    "render_option_table",
    "shard_model",
]
