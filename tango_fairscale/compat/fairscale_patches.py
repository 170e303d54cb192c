"""
The patches of FairScale: those every process needs (F5, F6, F7, F10, installed by
:func:`tango_fairscale.compat.install`), and those of a process whose FSDP units compute on the
CPU (F1-F4 and F9, :func:`enable_cpu_fsdp`; undone by :func:`disable_cpu_fsdp`). Nothing here
imports FairScale at import: each function imports the piece it patches.
"""

import functools
import logging
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from ..cpu.collectives import GlooCollectives
from .checks import IncompatibleVersionError, _require_attributes, _require_signature, check_version

logger = logging.getLogger(__name__)


# --- F5: autocast state of checkpointed recomputation -------------------------------------------

_AutocastState = Tuple[Tuple[str, torch.dtype], ...]
_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_state() -> _AutocastState:
    """The device types with autocast on, each with its dtype; empty (falsy) when none is on."""
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )


@contextmanager
def _restore_autocast(state: Any) -> Iterator[None]:
    """Re-enter the autocast state that :func:`_autocast_state` recorded."""
    contexts = [torch.autocast(device, dtype=dtype) for device, dtype in (state or ())]
    for context in contexts:
        context.__enter__()
    try:
        yield
    finally:
        for context in reversed(contexts):
            context.__exit__(None, None, None)


# F5 upstream: facebookresearch/fairscale#1199; torch's own checkpoint: pytorch/pytorch#71124
def _install_checkpoint_autocast() -> None:
    from fairscale.nn.checkpoint import checkpoint_activations

    _require_attributes(checkpoint_activations, ("is_autocast_enabled", "autocast"), "F5")
    checkpoint_activations.is_autocast_enabled = _autocast_state  # type: ignore[assignment]
    checkpoint_activations.autocast = _restore_autocast  # type: ignore[assignment]


# --- F6: the root's input cast under mixed precision ---------------------------------------------


def _cast_root_inputs_to_compute_dtype(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def cast_then_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._lazy_init()  # decides _is_root; FairScale's forward calls it again, a no-op then
        dtype = self.compute_dtype
        if self._is_root and self.mixed_precision and dtype not in (torch.float16, torch.float32):
            from fairscale.internal.containers import apply_to_tensors

            def cast(tensor: torch.Tensor) -> torch.Tensor:
                if tensor.dtype is not torch.float32:
                    return tensor
                cast_tensor = tensor.to(dtype)
                if tensor.is_leaf:
                    cast_tensor.requires_grad = tensor.requires_grad
                return cast_tensor

            # As FairScale's own cast: under no_grad, requires_grad kept on leaves.
            with torch.no_grad():
                args, kwargs = apply_to_tensors(cast, args), apply_to_tensors(cast, kwargs)
        return forward(self, *args, **kwargs)

    cast_then_forward.__tango_fairscale_patch__ = "F6"  # type: ignore[attr-defined]
    return cast_then_forward


# F6 upstream: none found
def _install_root_input_cast() -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    _require_attributes(FullyShardedDataParallel, ("forward", "_lazy_init"), "F6")
    if getattr(FullyShardedDataParallel.forward, "__tango_fairscale_patch__", None) != "F6":
        FullyShardedDataParallel.forward = _cast_root_inputs_to_compute_dtype(  # type: ignore[method-assign]
            FullyShardedDataParallel.forward
        )


# --- F7: frozen and trainable parameters in one unit ----------------------------------------------


# F7 upstream: facebookresearch/fairscale#1047; the frozen release: facebookresearch/fairscale#1159
def _install_flat_groups() -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel, fully_sharded_data_parallel
    from fairscale.nn.misc import FlattenParamsWrapper

    from . import fairscale_flat_groups as flat_groups

    _require_attributes(fully_sharded_data_parallel, ("FlattenParamsWrapper",), "F7")
    _require_attributes(
        FullyShardedDataParallel,
        (
            "forward",
            "_wait_for_post_backward",
            "_free_full_params",
            "_free_fp16_param_shard",
            "_use_fp32_param_shard",
        ),
        "F7",
    )
    current = fully_sharded_data_parallel.FlattenParamsWrapper
    if current is not flat_groups.FlattenTrainableApart:
        if current is not FlattenParamsWrapper:
            raise IncompatibleVersionError(
                f"F7: fairscale's FSDP module uses {current!r} as its FlattenParamsWrapper, not FairScale's "
                "own: another package replaced it, and tango_fairscale will not replace it again."
            )
        fully_sharded_data_parallel.FlattenParamsWrapper = flat_groups.FlattenTrainableApart  # type: ignore[misc]
    forward = FullyShardedDataParallel.forward
    if getattr(forward, "__tango_fairscale_patch__", None) != "F7":

        @functools.wraps(forward)
        def forward_then_release_frozen(self: Any, *args: Any, **kwargs: Any) -> Any:
            output = forward(self, *args, **kwargs)
            flat_groups.release_frozen_after_backward(self, args, kwargs)
            return output

        forward_then_release_frozen.__tango_fairscale_patch__ = "F7"  # type: ignore[attr-defined]
        FullyShardedDataParallel.forward = forward_then_release_frozen  # type: ignore[method-assign]
    wait = FullyShardedDataParallel._wait_for_post_backward
    if getattr(wait, "__tango_fairscale_patch__", None) != "F7":

        @functools.wraps(wait)
        def wait_then_release_frozen(self: Any) -> None:
            wait(self)
            flat_groups.release_all_frozen(self)

        wait_then_release_frozen.__tango_fairscale_patch__ = "F7"  # type: ignore[attr-defined]
        FullyShardedDataParallel._wait_for_post_backward = wait_then_release_frozen  # type: ignore[method-assign]


# --- F10: a single worker's mixed-precision gradients ---------------------------------------------


def _cast_unsharded_grad_then(hook: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(hook)
    def cast_then_hook(self: Any, param: Any, reduced_grad: torch.Tensor) -> None:
        grad = param.grad
        if (
            self.mixed_precision
            and not param._is_sharded
            # Offloaded gradients reach the optimizer through FairScale's float32 ``_cpu_grad``,
            # which the hook fills from its cast: a float32 copy here would only hold GPU memory.
            and not self.move_grads_to_cpu
            and grad is not None
            and grad.dtype != param.dtype
        ):
            # World size 1: FairScale hands this hook ``param.grad.data``, a fresh alias, so the
            # hook's cast to float32 replaces the alias's data and never reaches ``param.grad``,
            # which the optimizer then meets in float16/bfloat16 beside its float32 parameter
            # (reported downstream as Lightning-AI/pytorch-lightning#16303; FairScale is archived).
            param.grad.data = grad.data.to(param.dtype)
            reduced_grad = param.grad.data
        hook(self, param, reduced_grad)

    cast_then_hook.__tango_fairscale_patch__ = "F10"  # type: ignore[attr-defined]
    return cast_then_hook


# F10 upstream: reported downstream as Lightning-AI/pytorch-lightning#16303
def _install_unsharded_grad_cast() -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    _require_attributes(FullyShardedDataParallel, ("_post_reduction_hook",), "F10")
    hook = FullyShardedDataParallel._post_reduction_hook
    _require_signature(getattr(hook, "__wrapped__", hook), ("self", "param", "reduced_grad"), "F10")
    hook = FullyShardedDataParallel._post_reduction_hook
    if getattr(hook, "__tango_fairscale_patch__", None) != "F10":
        FullyShardedDataParallel._post_reduction_hook = _cast_unsharded_grad_then(hook)  # type: ignore[method-assign]


# --- F1-F4: FairScale's FSDP on CPU workers ---------------------------------------------------------

_cpu_lock = threading.Lock()
_cpu_enabled = False
# Held for the life of the process: dropping the Library object would unregister the kernel.
_record_stream_library: Optional[torch.library.Library] = None


def _fairscale_modules() -> Tuple[Any, Any]:
    from fairscale.internal import reduce_scatter_bucketer
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module

    _require_attributes(fsdp_module, ("torch", "dist", "enable_nccl_base_collectives"), "F1/F3/F4")
    _require_attributes(reduce_scatter_bucketer, ("dist", "enable_nccl_base_collectives"), "F3/F4")
    return fsdp_module, reduce_scatter_bucketer


def _read_base_collectives_default() -> bool:
    _, bucketer = _fairscale_modules()
    return bool(bucketer.enable_nccl_base_collectives)


_base_collectives_default: Optional[bool] = None


def set_collectives(module: Any) -> None:
    """F4's seam: what FairScale's FSDP module and its bucketer call ``torch.distributed``."""
    fsdp_module, bucketer = _fairscale_modules()
    fsdp_module.dist = module
    bucketer.dist = module


def current_collectives() -> Any:
    """What FairScale's FSDP module currently calls ``torch.distributed``."""
    fsdp_module, _ = _fairscale_modules()
    return fsdp_module.dist


def _set_base_collectives(enabled: bool) -> None:
    fsdp_module, bucketer = _fairscale_modules()
    fsdp_module.enable_nccl_base_collectives = enabled
    bucketer.enable_nccl_base_collectives = enabled


def enable_cpu_fsdp() -> None:
    """
    Make FairScale's FSDP run with a CPU compute device over the gloo backend (F1-F4), its
    reduce-scatter bucket filled without a stacked copy (F9). Idempotent and thread-safe.
    """
    global _cpu_enabled, _record_stream_library, _base_collectives_default
    with _cpu_lock:
        if _cpu_enabled:
            return
        check_version("fairscale")
        # Imported here, so that importing compat (every process) imports no FairScale piece.
        from .fairscale_cpu_streams import TorchWithCpuStreams, noop_record_stream

        fsdp_module, _ = _fairscale_modules()
        if _base_collectives_default is None:
            _base_collectives_default = _read_base_collectives_default()
        # F1 upstream: none in FairScale; PyTorch's FSDP needed the same stubs: pytorch/pytorch#106099
        fsdp_module.torch = TorchWithCpuStreams("torch")
        # F3 upstream: the flags are facebookresearch/fairscale#799; on gloo, none found
        _set_base_collectives(False)
        # F4 upstream: gloo's reduce-scatter came later, one all-reduce per rank: pytorch/pytorch#149869
        set_collectives(GlooCollectives("torch.distributed"))
        # F2 upstream: PyTorch's FSDP stopped calling record_stream on CPU: pytorch/pytorch#103171
        library = torch.library.Library("aten", "IMPL")
        library.impl("record_stream", noop_record_stream, "CPU")
        _record_stream_library = library
        _install_bucket_without_stack()
        _cpu_enabled = True
        logger.debug("Enabled FairScale FSDP on CPU workers")


def disable_cpu_fsdp() -> None:
    """Undo :func:`enable_cpu_fsdp` (used by tests that check the CUDA path is untouched)."""
    global _cpu_enabled, _record_stream_library
    with _cpu_lock:
        if not _cpu_enabled:
            return
        fsdp_module, _ = _fairscale_modules()
        fsdp_module.torch = torch
        _set_base_collectives(bool(_base_collectives_default))
        set_collectives(dist)
        if _record_stream_library is not None:
            _record_stream_library._destroy()
            _record_stream_library = None
        bucketer = _fairscale_modules()[1].ReduceScatterBucketer
        if getattr(bucketer.reduce_scatter_async, "__tango_fairscale_patch__", None) == "F9":
            bucketer.reduce_scatter_async = bucketer.reduce_scatter_async.__wrapped__
        _cpu_enabled = False


# F9 upstream: none found
def _install_bucket_without_stack() -> None:
    """F9: FairScale's reduce-scatter bucket filled chunk by chunk (``bucketing``), on CPU workers."""
    from . import fairscale_bucket as bucketing

    bucketer = _fairscale_modules()[1].ReduceScatterBucketer
    _require_attributes(bucketer, ("reduce_scatter_async", "_get_shard_size", "_get_bucket"), "F9")
    original = bucketer.reduce_scatter_async
    _require_signature(
        getattr(original, "__wrapped__", original), ("self", "input_list", "group", "callback_fn"), "F9"
    )
    if getattr(original, "__tango_fairscale_patch__", None) == "F9":
        return

    @functools.wraps(original)
    def reduce_scatter_async(self: Any, input_list: Any, group: Any, callback_fn: Any = None) -> None:
        bucketing.reduce_scatter_async(original, self, input_list, group, callback_fn)

    reduce_scatter_async.__tango_fairscale_patch__ = "F9"  # type: ignore[attr-defined]
    bucketer.reduce_scatter_async = reduce_scatter_async


def cpu_fsdp_enabled() -> bool:
    """Whether :func:`enable_cpu_fsdp` is in effect in this process."""
    return _cpu_enabled
