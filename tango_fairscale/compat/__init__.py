"""
The integration boundary: every change this package makes to FairScale, Tango, torch or
Hugging Face ``transformers``.

Nothing here happens at import, and nothing here is the package's logic: T1 and T2 route Tango's
step and worker functions to :mod:`tango_fairscale.train_step`, which :func:`install` is given.
Each patch is installed explicitly, by one function, which
first checks that the library it patches is inside the supported range (``pyproject.toml``'s;
no release inside it is refused as a whole) and that every attribute it rebinds is there, and
refuses with an error naming both otherwise. Where torch releases differ, a patch picks its
variant by a flag of :mod:`tango_fairscale.versions`; where a release lacks a patch's target, only
the feature that needs it is turned off (:func:`tango_fairscale.versions.feature_unavailable`).
``tests/test_canaries.py`` shows, per patch, that the upstream defect is still there:

- :func:`install` (called once by ``import tango_fairscale``) installs what every process
  needs: the step patches (T1, T2), the checkpoint autocast fix (F5), the input cast fix (F6),
  frozen and trainable parameters in one unit (F7), a single worker's mixed-precision gradients
  (F10), a stopped step told once (T6), a step's config mistake told in one line (T8) and the
  warning filters (W1-W5).
- :func:`enable_cpu_fsdp` installs F1-F4 and F9 in a process whose FSDP units compute on the CPU (the
  FairScale backend calls it before wrapping on a CPU worker); GPU workers never call it, so
  their FairScale code path is unchanged. :func:`disable_cpu_fsdp` undoes it (for tests).
- :func:`enable_cpu_fsdp2` installs S1 in a process whose FSDP2 units compute on the CPU (the
  torch backend calls it before sharding on a CPU mesh); :func:`disable_cpu_fsdp2` undoes it.
- :func:`meta_parameter_registration` is the one torch patch (P1), active only while the
  engine builds a model with ``init_on_meta``.
- :func:`install_transformers_patches` (called once by ``import tango_fairscale``) registers H1
  and H2, which are applied only when the module they change is imported (``transformers`` costs
  seconds to import: a process that does not use it never does), and check the ``transformers``
  version then (:data:`CHECKED_WHEN_USED`), not at import.

Each patch has an ID (F: FairScale, T: Tango, W: a warnings filter, D: torch's distributed
checkpoint, P: torch's module and ``nn.init`` functions, S: torch's FSDP2, H: ``transformers``),
which the function that installs it names in its checks and errors. The one list of the patches,
with each one's target, what installs it and why, is the table in ``docs/architecture.md`` ("The integration
boundary"); a new patch gets its row there (``tests/test_docs.py`` checks that every ID named here
has one).

Registration over the bundled integration's names (``exist_ok=True``) is in :mod:`.registry`.
"""

import functools
import importlib.abc
import importlib.util
import inspect
import logging
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import versions
from ..cpu.collectives import GlooCollectives

logger = logging.getLogger(__name__)

#: The releases of the libraries patched in every process, as ``pyproject.toml`` pins them: a
#: release prefix (``"1.3."``) or an exact one. torch is checked against its range instead
#: (:data:`TORCH_RANGE`). pip's resolver keeps an installation inside these; the import refuses
#: only what is outside them (``TANGO_FAIRSCALE_SKIP_VERSION_CHECK=1`` runs it anyway), and each
#: patch checks its own target on the release installed.
CHECKED_VERSIONS: Dict[str, Tuple[str, ...]] = {
    "fairscale": ("0.4.13",),
    "ai2-tango": ("1.3.",),
}
#: torch's supported range (kept in :mod:`tango_fairscale.versions`).
TORCH_RANGE = versions.TORCH_RANGE
#: Libraries patched only in processes that use them (H1, H2): checked when the patch is applied
#: or used, so that another release installed for something else does not refuse the package.
CHECKED_WHEN_USED: Dict[str, Tuple[str, ...]] = {
    "transformers": ("4.57.",),
}
SKIP_VERSION_CHECK_VARIABLE = "TANGO_FAIRSCALE_SKIP_VERSION_CHECK"

__all__ = [
    "CHECKED_VERSIONS",
    "CHECKED_WHEN_USED",
    "IncompatibleVersionError",
    "TORCH_RANGE",
    "cpu_fsdp2_available",
    "cpu_fsdp2_enabled",
    "cpu_fsdp_enabled",
    "disable_cpu_fsdp",
    "disable_cpu_fsdp2",
    "enable_cpu_fsdp",
    "enable_cpu_fsdp2",
    "install",
    "install_transformers_patches",
    "meta_parameter_registration",
]


class IncompatibleVersionError(ImportError):
    """A patched library is a version, or lacks an attribute, that this package was not checked against."""


def _installed_version(distribution: str) -> str:
    if distribution == "torch":
        return torch.__version__
    from importlib.metadata import version

    return version(distribution)


def _in_checked_range(distribution: str, found: str) -> bool:
    if distribution == "torch":
        release = versions.TorchVersion(found.split("+")[0])
        return bool(release >= TORCH_RANGE[0]) and not bool(release >= TORCH_RANGE[1])
    checked = CHECKED_VERSIONS.get(distribution) or CHECKED_WHEN_USED[distribution]
    return any(found == v or (v.endswith(".") and found.startswith(v)) for v in checked)


def _describe_checked(distribution: str) -> str:
    if distribution == "torch":
        return f"torch >= {TORCH_RANGE[0]}, < {TORCH_RANGE[1]}"
    checked = CHECKED_VERSIONS.get(distribution) or CHECKED_WHEN_USED[distribution]
    return f"{distribution} " + " / ".join(v + ("x" if v.endswith(".") else "") for v in checked)


def check_version(distribution: str) -> None:
    """Refuse a release of ``distribution`` outside the range ``pyproject.toml`` requires."""
    found = _installed_version(distribution)
    if _in_checked_range(distribution, found):
        return
    if os.environ.get(SKIP_VERSION_CHECK_VARIABLE) == "1":
        logger.warning(
            "%s %s is outside the releases tango-fairscale supports (%s)",
            distribution,
            found,
            _describe_checked(distribution),
        )
        return
    quoted_extra = "'.[hf]'" if distribution in CHECKED_WHEN_USED else "."
    raise IncompatibleVersionError(
        f"tango-fairscale patches {distribution} and supports {_describe_checked(distribution)}, but "
        f"{found} is installed. Install a supported release (pip install -e {quoted_extra} resolves "
        f"them), or set {SKIP_VERSION_CHECK_VARIABLE}=1 to run unsupported at your own risk."
    )


def _require_attributes(module: Any, names: Sequence[str], patch: str) -> None:
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise IncompatibleVersionError(
            f"tango-fairscale patch {patch} rebinds {module.__name__}.{missing}, which this installation "
            "lacks: the library changed. Install the versions in pyproject.toml."
        )


def _require_signature(function: Any, parameters: Sequence[str], patch: str) -> None:
    """
    ``function`` (which ``patch`` wraps, calling it with these arguments) takes exactly
    ``parameters``, in order: a release that added or renamed one is refused, naming the patch.
    """
    import inspect

    found = list(inspect.signature(function).parameters)
    if found != list(parameters):
        raise IncompatibleVersionError(
            f"tango-fairscale patch {patch} wraps {function.__qualname__}, whose parameters are {found} "
            f"on this installation, not {list(parameters)}: the library changed."
        )


def signature_matches(function: Any, parameters: Sequence[str]) -> bool:
    """Whether :func:`_require_signature` would accept ``function``."""
    try:
        _require_signature(function, parameters, "")
    except IncompatibleVersionError:
        return False
    return True


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


def _install_root_input_cast() -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    _require_attributes(FullyShardedDataParallel, ("forward", "_lazy_init"), "F6")
    if getattr(FullyShardedDataParallel.forward, "__tango_fairscale_patch__", None) != "F6":
        FullyShardedDataParallel.forward = _cast_root_inputs_to_compute_dtype(  # type: ignore[method-assign]
            FullyShardedDataParallel.forward
        )


# --- F7: frozen and trainable parameters in one unit ----------------------------------------------


def _install_flat_groups() -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel, fully_sharded_data_parallel
    from fairscale.nn.misc import FlattenParamsWrapper

    from ..backends.fairscale_fsdp import flat_groups

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


def _install_unsharded_grad_cast() -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    _require_attributes(FullyShardedDataParallel, ("_post_reduction_hook",), "F10")
    hook = FullyShardedDataParallel._post_reduction_hook
    _require_signature(getattr(hook, "__wrapped__", hook), ("self", "param", "reduced_grad"), "F10")
    hook = FullyShardedDataParallel._post_reduction_hook
    if getattr(hook, "__tango_fairscale_patch__", None) != "F10":
        FullyShardedDataParallel._post_reduction_hook = _cast_unsharded_grad_then(hook)  # type: ignore[method-assign]


# --- T1, T2: Tango's torch::train step and its workers ----------------------------------------------

#: What the rebound step and worker functions call: the step's logic, plain code that
#: :func:`install` is given (:mod:`tango_fairscale.train_step`), so that this module imports none of it.
StepLogic = Callable[..., Any]
_step_logic: Optional[StepLogic] = None
_worker_logic: Optional[StepLogic] = None


def _wrap_train_step() -> None:
    """T1 and T2: Tango's step and worker functions call the step's logic, with the originals."""
    from tango.integrations.torch import train as tango_train

    _require_attributes(tango_train, ("TorchTrainStep", "_train"), "T1/T2")
    _require_attributes(tango_train.TorchTrainStep, ("_train",), "T1")
    step_class = tango_train.TorchTrainStep
    original: Callable[..., Any] = step_class._train
    if getattr(original, "_tango_fairscale", False):
        return

    @functools.wraps(original)
    def _train(self: Any, *args: Any, **kwargs: Any) -> Any:
        assert _step_logic is not None  # set by install() before this is bound
        return _step_logic(original, self, *args, **kwargs)

    _train._tango_fairscale = True  # type: ignore[attr-defined]
    step_class._train = _train  # type: ignore[method-assign]
    # T2: a module-level function (not functools.wraps'd), so that mp.spawn pickles it by its own
    # name: the spawned worker imports tango_fairscale to find it, which installs the patches there.
    global _original_train_worker
    if tango_train._train is not _train_worker:
        _original_train_worker = tango_train._train
        tango_train._train = _train_worker  # type: ignore[assignment]


#: Tango's worker function, as it was before T2 rebound it.
_original_train_worker: Optional[Callable[..., Any]] = None


def _train_worker(process_index: int, workspace: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
    """T2: Tango's worker function (``tango.integrations.torch.train._train``), which ``mp.spawn`` runs."""
    original = _original_train_worker
    if original is None:  # T2 not installed in this process: Tango's own function is still there
        from tango.integrations.torch import train as tango_train

        original = tango_train._train
    assert _worker_logic is not None  # the worker imported tango_fairscale, which installed it
    return _worker_logic(original, process_index, workspace, config, *args, **kwargs)


def extra_imported_modules() -> Any:
    """T1 (a): the set of modules Tango re-imports in its spawned workers (Tango's own object)."""
    from tango.common import util as tango_util

    _require_attributes(tango_util, ("get_extra_imported_modules",), "T1")
    return tango_util.get_extra_imported_modules()


@contextmanager
def process_group_already_started(config: Any) -> Iterator[None]:
    """
    T5: while Tango's engine constructor runs. It starts the process group itself when the config
    is distributed (with no timeout); the engine has started it already, with one, and a second
    start is an error. So the constructor sees the config as not distributed: nothing else in it
    reads the flag (checked against ai2-tango 1.3's ``TorchTrainingEngine.__init__``).
    """
    _require_attributes(config, ("is_distributed",), "T5")
    distributed = config.is_distributed
    config.is_distributed = False
    try:
        yield
    finally:
        config.is_distributed = distributed


_install_lock = threading.Lock()
_installed = False


def install(
    step_logic: StepLogic, worker_logic: StepLogic, config_error_logic: Optional[StepLogic] = None
) -> None:
    """
    Install the patches every process needs (T1-T3, T6, T8, F5-F7, F10, W1-W5), once; ``import
    tango_fairscale`` calls it with the step's logic (:mod:`tango_fairscale.train_step`): what
    the rebound step (``step_logic(original, step, *args, **kwargs)``) and worker
    (``worker_logic(original, process_index, *args, **kwargs)``) functions run, and what tells a
    step's construction error in one line (``config_error_logic(type_name, keys, error)``, T8).
    """
    global _installed, _step_logic, _worker_logic, _config_error_logic
    with _install_lock:
        _step_logic, _worker_logic = step_logic, worker_logic
        _config_error_logic = config_error_logic
        if _installed:
            return
        for distribution in (*CHECKED_VERSIONS, "torch"):
            check_version(distribution)
        _install_checkpoint_autocast()
        _install_root_input_cast()
        _install_flat_groups()
        _install_unsharded_grad_cast()
        _wrap_train_step()
        _quiet_integration_search()
        silence_internal_warnings()
        _quiet_reported_stops()
        _one_line_step_config_errors()
        _installed = True


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
        from ..backends.fairscale_fsdp.cpu_streams import TorchWithCpuStreams, noop_record_stream

        fsdp_module, _ = _fairscale_modules()
        if _base_collectives_default is None:
            _base_collectives_default = _read_base_collectives_default()
        fsdp_module.torch = TorchWithCpuStreams("torch")
        _set_base_collectives(False)
        set_collectives(GlooCollectives("torch.distributed"))
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


def _install_bucket_without_stack() -> None:
    """F9: FairScale's reduce-scatter bucket filled chunk by chunk (``bucketing``), on CPU workers."""
    from ..backends.fairscale_fsdp import bucketing

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


# --- S1: FSDP2's gathered parameters on CPU workers -----------------------------------------------

_fsdp2_lock = threading.Lock()
#: S1's originals, while it is installed: (``_fsdp_param.alloc_storage``, ``free_storage``,
#: ``FSDPParam.init_all_gather_outputs``, ``_fsdp_param_group.alloc_storage``).
_fsdp2_originals: Optional[Tuple[Any, Any, Any, Any]] = None


def _fsdp2_modules() -> Tuple[Any, Any]:
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    _require_attributes(_fsdp_param, ("alloc_storage", "free_storage", "FSDPParam"), "S1")
    _require_attributes(_fsdp_param.FSDPParam, ("init_all_gather_outputs",), "S1")
    _require_attributes(_fsdp_param_group, ("alloc_storage",), "S1")
    return _fsdp_param, _fsdp_param_group


def cpu_fsdp2_available() -> bool:
    """
    Whether S1 can run on this torch: it swaps new memory into the storage FSDP2 keeps with
    ``UntypedStorage._swap_data_ptr_``, which torch 2.11 lacks. Without it, a CPU worker's FSDP2
    units gather through torch's allocator, as FSDP2 does itself (correct; more heap on LoRA runs).
    """
    if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return False
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    init = _fsdp_param.FSDPParam.init_all_gather_outputs
    # S1's replacement takes these and no more (torch 2.11's adds force_recreate).
    return signature_matches(getattr(init, "__wrapped__", init), _S1_INIT_PARAMETERS)


#: The parameters of ``FSDPParam.init_all_gather_outputs`` that S1's replacement passes on.
_S1_INIT_PARAMETERS = ("self", "all_gather_input_numels", "all_gather_input_dtypes", "world_size", "device")


def _bind_fsdp2(functions: Tuple[Any, Any, Any, Any]) -> None:
    """Bind S1's four names (in the order of ``_fsdp2_originals``) to ``functions``."""
    param_module, group_module = _fsdp2_modules()
    param_module.alloc_storage, param_module.free_storage = functions[0], functions[1]
    param_module.FSDPParam.init_all_gather_outputs = functions[2]
    group_module.alloc_storage = functions[3]


def enable_cpu_fsdp2() -> None:
    """
    S1: FSDP2's gathered parameters on a CPU worker each in a memory mapping of its own, unmapped
    when the unit reshards (:mod:`~tango_fairscale.backends.torch_fsdp2.gathered_memory`); the
    torch backend calls it before sharding on a CPU mesh. GPU workers never call it. Idempotent and
    thread-safe; :func:`disable_cpu_fsdp2` undoes it.
    """
    global _fsdp2_originals
    with _fsdp2_lock:
        if _fsdp2_originals is not None:
            return
        check_version("torch")
        if not cpu_fsdp2_available():
            versions.feature_unavailable(
                "FSDP2's gathered parameters in mappings of their own on CPU workers",
                "S1",
                "torch.UntypedStorage._swap_data_ptr_ and FSDPParam.init_all_gather_outputs"
                f"{_S1_INIT_PARAMETERS[1:]}",
                "the torch backend's CPU workers gather through torch's allocator (the same values; "
                "a LoRA worker's heap can grow more, docs/capacity.md)",
            )
            return
        from ..backends.torch_fsdp2 import gathered_memory

        param_module, group_module = _fsdp2_modules()
        originals = (
            param_module.alloc_storage,
            param_module.free_storage,
            param_module.FSDPParam.init_all_gather_outputs,
            group_module.alloc_storage,
        )
        alloc, free, init, group_alloc = originals

        def alloc_storage(tensor: torch.Tensor) -> None:
            gathered_memory.alloc_storage(tensor, alloc)

        def free_storage(tensor: torch.Tensor) -> None:
            gathered_memory.free_storage(tensor, free)

        @functools.wraps(init)
        def init_all_gather_outputs(
            self: Any,
            all_gather_input_numels: Sequence[int],
            all_gather_input_dtypes: Sequence[torch.dtype],
            world_size: int,
            device: Any,
        ) -> None:
            gathered_memory.init_all_gather_outputs(
                self, all_gather_input_numels, all_gather_input_dtypes, world_size, device, init
            )

        def group_alloc_storage(tensor: torch.Tensor) -> None:
            gathered_memory.alloc_storage(tensor, group_alloc)

        _bind_fsdp2((alloc_storage, free_storage, init_all_gather_outputs, group_alloc_storage))
        _fsdp2_originals = originals


def disable_cpu_fsdp2() -> None:
    """Undo :func:`enable_cpu_fsdp2` (for tests), once no unit sharded under it is used any more."""
    global _fsdp2_originals
    with _fsdp2_lock:
        if _fsdp2_originals is None:
            return
        _bind_fsdp2(_fsdp2_originals)
        _fsdp2_originals = None


def cpu_fsdp2_enabled() -> bool:
    """Whether :func:`enable_cpu_fsdp2` is in effect in this process."""
    return _fsdp2_originals is not None


# --- P1: parameters registered on meta ----------------------------------------------------------------

_original_register_parameter = nn.Module.register_parameter
_meta_lock = threading.Lock()
_meta_users = 0

#: P1: the ``torch.nn.init`` functions that return at once when given a meta tensor on some
#: releases (torch 2.13 and 2.15; on 2.11 they run on meta like the others), so that recording
#: sees none of their operators (``trunc_normal_`` through its helper, which every caller of it
#: reaches however it was imported). P1 takes over those that skip on the installed release
#: (:func:`meta_skipping_initialisers`, a check of the behaviour, not of the version).
META_SKIPPING_INITIALISERS = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")
_original_initialisers: Dict[str, Callable[..., Any]] = {}
_meta_skipping: Optional[Tuple[str, ...]] = None


def _meta_arguments(name: str) -> Tuple[Any, ...]:
    """Arguments for ``torch.nn.init``'s ``name`` on a meta tensor (``dirac_`` needs 3 dimensions)."""
    tensor = torch.empty(4, 4, 3, device="meta") if name == "dirac_" else torch.empty(4, 4, device="meta")
    extra = {"_no_grad_trunc_normal_": (0.0, 1.0, -2.0, 2.0), "sparse_": (0.5,)}
    return (tensor, *extra.get(name, ()))


def dispatched_on_meta(function: Callable[..., Any], *args: Any) -> List[str]:
    """
    The aten operators ``function(*args)`` dispatches (given meta tensors): what recording sees.
    The random generators are as before the call (``sparse_`` draws a permutation on the CPU even
    for a meta tensor): a probe must not move the draws of the build that follows it.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    operators: List[str] = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            operators.append(str(func))
            return func(*args, **(kwargs or {}))

    with torch.random.fork_rng(devices=[]), Recording():
        function(*args)
    return operators


def meta_skipping_initialisers() -> Tuple[str, ...]:
    """
    Those of :data:`META_SKIPPING_INITIALISERS` that dispatch nothing on a meta tensor on the
    installed torch: the ones P1 must take over. Probed once per process (on meta: no memory).
    """
    global _meta_skipping
    if _meta_skipping is None:
        _require_attributes(torch.nn.init, META_SKIPPING_INITIALISERS, "P1")
        _meta_skipping = tuple(name for name in META_SKIPPING_INITIALISERS if _skips_meta(name))
    return _meta_skipping


def _skips_meta(name: str) -> bool:
    function = getattr(torch.nn.init, name)
    # A function that never asks whether a tensor is on meta runs on it like any other: no call
    # needed (running them on meta costs 51 MiB of the process's memory once on torch 2.11).
    code = getattr(function, "__code__", None)
    if code is not None and "is_meta" not in code.co_names:
        return False
    return not dispatched_on_meta(function, *_meta_arguments(name))


def _through(initialiser: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        return initialiser(original, *args, **kwargs)

    return call


@contextmanager
def meta_parameter_registration(
    hook: Callable[[nn.Module, str, nn.Parameter], None],
    initialiser: Optional[Callable[..., Any]] = None,
) -> Iterator[None]:
    """
    While active (in any thread), ``nn.Module.register_parameter`` calls ``hook(module, name,
    param)`` after registering a parameter, and (given ``initialiser``) each of
    :func:`meta_skipping_initialisers` calls ``initialiser(original, *args, **kwargs)``. The
    rebindings are shared by all threads and counted, so they are removed only when the last user
    leaves; the first user's functions serve every thread (they check the thread's own state).
    """
    global _meta_users

    def register_parameter(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        _original_register_parameter(self, name, param)
        if param is not None:
            hook(self, name, param)

    with _meta_lock:
        if _meta_users == 0:
            if initialiser is not None:
                for name in meta_skipping_initialisers():
                    _original_initialisers[name] = getattr(torch.nn.init, name)
                    setattr(torch.nn.init, name, _through(initialiser, _original_initialisers[name]))
            nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        _meta_users += 1
    try:
        yield
    finally:
        with _meta_lock:
            _meta_users -= 1
            if _meta_users == 0:
                nn.Module.register_parameter = _original_register_parameter  # type: ignore[method-assign]
                for name, original in _original_initialisers.items():
                    setattr(torch.nn.init, name, original)
                _original_initialisers.clear()


# --- H1, H2: Hugging Face transformers, in the processes that import it ---------------------------------


class _ImportHooks(importlib.abc.MetaPathFinder):
    """
    Runs a function just before a named module is first executed (``before``), or just after
    (``after``, given the module), whoever imports it. First on ``sys.meta_path``, it only looks at
    the names it has hooks for and then leaves finding the module to the finders after it.
    """

    def __init__(self) -> None:
        self.before: Dict[str, List[Callable[[], None]]] = {}
        self.after: Dict[str, List[Callable[[ModuleType], None]]] = {}
        # The names being looked up by the other finders on our behalf (the import lock of each
        # name is held meanwhile, so one thread at a time).
        self._finding: Set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in self._finding or (fullname not in self.before and fullname not in self.after):
            return None
        for hook in self.before.get(fullname, ()):
            hook()  # an error here is the import's error
        after = self.after.get(fullname)
        if not after:
            return None
        self._finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            for hook in after:
                hook(module)

        # On this module's own loader object: its type, and what reads it, are unchanged.
        loader.exec_module = exec_module
        return spec


_import_hooks: Optional[_ImportHooks] = None
_import_hooks_lock = threading.Lock()


def _when_imported(name: str, hook: Callable[[ModuleType], None]) -> None:
    """``hook(module)`` now if ``name`` is imported, else right after it is."""
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    _hooks().after.setdefault(name, []).append(hook)


def _before_import(name: str, hook: Callable[[], None]) -> None:
    """``hook()`` before ``name`` is executed, each time an import of it is attempted (idempotent hooks)."""
    if name not in sys.modules:
        _hooks().before.setdefault(name, []).append(hook)


def _hooks() -> _ImportHooks:
    global _import_hooks
    with _import_hooks_lock:
        if _import_hooks is None:
            _import_hooks = _ImportHooks()
            sys.meta_path.insert(0, _import_hooks)
        return _import_hooks


#: The module of Tango's that imports ``Conv1D`` from where ``transformers`` 4.57 no longer has it.
TANGO_IA3_MODULE = "tango.integrations.transformers.ia3"


def _alias_conv1d() -> None:
    """
    H1, before Tango's ``ia3`` module runs: ``transformers.modeling_utils.Conv1D`` becomes the
    class that module means, ``transformers.pytorch_utils.Conv1D`` (which GPT-2's attention and MLP
    layers are, so its ``isinstance`` checks still find them). Where ``transformers`` still has
    the name there, nothing changes.
    """
    from transformers import modeling_utils, pytorch_utils

    if hasattr(modeling_utils, "Conv1D"):
        return
    check_version("transformers")
    _require_attributes(pytorch_utils, ("Conv1D",), "H1")
    conv1d = pytorch_utils.Conv1D
    if not (isinstance(conv1d, type) and issubclass(conv1d, nn.Module)):
        raise IncompatibleVersionError(
            f"tango-fairscale patch H1 aliases transformers.pytorch_utils.Conv1D, which is {conv1d!r} "
            "here, not a torch module class: the library changed. Install the versions in pyproject.toml."
        )
    modeling_utils.Conv1D = conv1d  # type: ignore[attr-defined]


#: H2's two functions: whether this thread builds on meta, and the loader to call then.
_building_on_meta: Optional[Callable[[], bool]] = None
_load_on_meta: Optional[Callable[..., Any]] = None


def _route_from_pretrained(modeling_utils: ModuleType) -> None:
    """H2: ``PreTrainedModel.from_pretrained`` calls the meta loader in a thread that builds on meta."""
    _require_attributes(modeling_utils, ("PreTrainedModel",), "H2")
    model_class = modeling_utils.PreTrainedModel
    descriptor = model_class.__dict__.get("from_pretrained")
    if not isinstance(descriptor, classmethod):
        raise IncompatibleVersionError(
            "tango-fairscale patch H2 wraps transformers.PreTrainedModel.from_pretrained, which is not a "
            "classmethod here: the library changed. Install the versions in pyproject.toml."
        )
    original: Callable[..., Any] = descriptor.__func__
    if getattr(original, "_tango_fairscale", False):
        return

    @functools.wraps(original)
    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if _building_on_meta is None or _load_on_meta is None or not _building_on_meta():
            return original(cls, *args, **kwargs)
        # Only the routing depends on what transformers' loading does: checked where it happens.
        check_version("transformers")
        return _load_on_meta(cls, *args, **kwargs)

    from_pretrained._tango_fairscale = True  # type: ignore[attr-defined]
    model_class.from_pretrained = classmethod(from_pretrained)


def install_transformers_patches(
    building_on_meta: Callable[[], bool], load_on_meta: Callable[..., Any]
) -> None:
    """
    H1 and H2, each applied when the module it changes is first imported (at once if it already
    is). ``load_on_meta(model_class, *args, **kwargs)`` takes over ``from_pretrained``'s call in a
    thread where ``building_on_meta()`` is true (H2). Idempotent.
    """
    global _building_on_meta, _load_on_meta
    with _install_lock:
        first = _building_on_meta is None
        _building_on_meta, _load_on_meta = building_on_meta, load_on_meta
        if not first:
            return
    _before_import(TANGO_IA3_MODULE, _alias_conv1d)
    _when_imported("transformers.modeling_utils", _route_from_pretrained)


# --- T3: Tango's search for a registered name ---------------------------------------------------------


def _quiet_integration_search() -> None:
    """
    When a config names an unregistered type, Tango imports each of its bundled integrations to
    look for it, skipping those whose dependencies are missing, but only when the integration
    itself says so: its ``transformers`` integration fails with ``No module named 'datasets'``
    whenever ``transformers`` is installed without ``datasets`` (the examples extra without hf), and
    that error replaced Tango's "not a registered name" answer to a typo. While Tango imports an
    integration in that search, an import error for another, absent top-level package becomes the
    ``IntegrationMissingError`` Tango already skips.
    """
    from tango.common import registrable
    from tango.common.exceptions import IntegrationMissingError

    _require_attributes(registrable, ("import_module_and_submodules",), "T3")
    original = registrable.import_module_and_submodules
    if getattr(original, "_tango_fairscale", False):
        return

    @functools.wraps(original)
    def import_module_and_submodules(package_name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(package_name, *args, **kwargs)
        except ImportError as error:
            missing = (error.name or "").split(".")[0]
            if not package_name.startswith("tango.integrations.") or not missing or missing == "tango":
                raise
            raise IntegrationMissingError(package_name.rsplit(".", 1)[-1], {missing}) from error

    import_module_and_submodules._tango_fairscale = True  # type: ignore[attr-defined]
    registrable.import_module_and_submodules = import_module_and_submodules


# --- W1: a warning about FairScale's internals ---------------------------------------------------------


def silence_internal_warnings() -> None:
    """
    FairScale calls ``Tensor.storage()``, and torch warns once per process that ``TypedStorage``
    is deprecated: one line per worker, every run, about FairScale's internals, nothing a user
    can act on. Only that warning, only when FairScale's code triggers it, is silenced.
    """
    import warnings

    warnings.filterwarnings(
        "ignore", message="TypedStorage is deprecated", category=UserWarning, module=r"fairscale\."
    )
    # FairScale's checkpoint wrapper feeds a tensor that requires grad into every checkpointed
    # call, so the block's parameters always get gradients, but it still runs torch's input
    # check, which warns "Gradients will be None" whenever the block's own inputs do not require
    # grad (e.g. the first block after the embedding of integer token ids). The warning is false
    # there; silenced for warnings raised from that one FairScale module only.
    warnings.filterwarnings(
        "ignore",
        message="None of the inputs have requires_grad=True",
        category=UserWarning,
        module=r"fairscale\.nn\.checkpoint\.checkpoint_activations",
    )
    # W4: FairScale's ShardedGradScaler (float16 AMP on GPUs) subclasses torch.cuda.amp.GradScaler,
    # whose constructor torch deprecated for torch.amp.GradScaler("cuda"): a FutureWarning in every
    # worker of every float16 run (seen on the first GPU run), about FairScale's code.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.cuda\.amp\.GradScaler\(args\.\.\.\)` is deprecated",
        category=FutureWarning,
        module=r"fairscale\.optim\.grad_scaler",
    )
    # W3: Tango imports pkg_resources to record the installed packages of every step it runs, and
    # setuptools warns that the module is deprecated: one line in every run, about Tango's code.
    warnings.filterwarnings(
        "ignore", message="pkg_resources is deprecated", category=Warning, module=r"tango\.step_info"
    )
    # W5: Tango stamps each step's start with datetime.utcnow(), which Python 3.12 deprecates: one
    # DeprecationWarning in every tango run there, about Tango's code (ai2-tango 1.3.2 is frozen).
    warnings.filterwarnings(
        "ignore",
        message=r"datetime\.datetime\.utcnow\(\) is deprecated",
        category=DeprecationWarning,
        module=r"tango\.common\.util",
    )


# --- T6: a stopped step, told once ---------------------------------------------------------------------


def _quiet_reported_stops() -> None:
    """
    T6: SIGINT or SIGTERM ends a step with
    :class:`~tango_fairscale.launch.signals.TrainingStopped` after its handler logged one line
    (what stopped the run, how to resume). Tango's step logs every exception that leaves
    ``run()`` (``Step.log_failure``): a ``SystemExit`` as "Uncaught exception" with its traceback,
    then "Step failed"; the run's log capture (``insert_handlers``) logs it again unless Tango
    counts it as logged. For this one exception, unless the step's logger is at debug level, the
    wrapper logs nothing and adds it to Tango's own list of logged exceptions
    (``tango.common.logging._EXCEPTIONS_LOGGED``, which ``log_exception`` consults). Everything
    else Tango does with it (recording the step as failed) is unchanged.
    """
    from tango.common import logging as tango_logging
    from tango.step import Step

    from ..launch.signals import STOPPED_HOOKS, TrainingStopped

    _require_attributes(Step, ("log_failure",), "T6")
    _require_attributes(tango_logging, ("_EXCEPTIONS_LOGGED",), "T6")
    if not isinstance(tango_logging._EXCEPTIONS_LOGGED, list):
        raise IncompatibleVersionError("T6: tango.common.logging._EXCEPTIONS_LOGGED is no longer a list.")
    original = Step.log_failure
    if getattr(original, "_tango_fairscale", False):
        return

    @functools.wraps(original)
    def log_failure(self: Any, exception: Optional[BaseException] = None) -> None:
        if isinstance(exception, TrainingStopped) and not self.logger.isEnabledFor(logging.DEBUG):
            tango_logging._EXCEPTIONS_LOGGED.append(exception)
            return
        original(self, exception)

    log_failure._tango_fairscale = True  # type: ignore[attr-defined]
    Step.log_failure = log_failure  # type: ignore[method-assign]

    def count_as_logged(stopped: BaseException) -> None:
        # A stop outside any step (between two steps) reaches the run's log capture without
        # passing log_failure: counted as logged as soon as its line is (unless debugging).
        if not logging.getLogger("tango").isEnabledFor(logging.DEBUG):
            tango_logging._EXCEPTIONS_LOGGED.append(stopped)

    STOPPED_HOOKS.append(count_as_logged)


# --- T9: Tango's progress bars off where progress goes out as lines -----------------------------------


def progress_bars_off() -> None:
    """
    T9: in this process from now on, Tango's progress bars (``tango.common.tqdm.Tqdm.tqdm``: the
    training loop's, the validation's, catching the data loader up, the checkpoint's) are created
    disabled: a worker whose standard error is no terminal prints its progress as lines instead
    (:mod:`tango_fairscale.telemetry.progress`). Tango's bar passes ``disable`` itself (off on
    workers other than the first), so neither tqdm's ``TQDM_DISABLE`` nor Tango's
    ``FILE_FRIENDLY_LOGGING`` (a cleaned bar every 2 s, and again in the log every 10 s) can do it.
    """
    from tango.common.tqdm import Tqdm

    _require_attributes(Tqdm, ("tqdm",), "T9")
    original = Tqdm.__dict__["tqdm"]
    function = getattr(original, "__func__", original)
    if getattr(function, "_tango_fairscale", False):
        return

    @functools.wraps(function)
    def tqdm(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **{**kwargs, "disable": True})

    tqdm._tango_fairscale = True  # type: ignore[attr-defined]
    Tqdm.tqdm = staticmethod(tqdm)  # type: ignore[method-assign,assignment]


#: T8's logic: the one-line error (or None) for a step's construction error; :func:`install` sets it.
_config_error_logic: Optional[StepLogic] = None


def _step_type_and_keys(params: Any) -> Tuple[Any, List[str]]:
    if isinstance(params, str):
        return params, []
    if hasattr(params, "get") and hasattr(params, "keys"):  # a dict or Tango's Params
        return params.get("type"), [str(key) for key in params.keys()]
    return None, []


def _one_line_step_config_errors() -> None:
    """
    T8: an option that is not one, or a value of the wrong type, in the config of one of the
    package's steps (``fairscale::tokenize_text``, ``fairscale::evaluate``): Tango's
    ``Step.from_params`` raised it inside a 38-42-line traceback ("Extra parameters passed to
    TokenizeText", "Expected block_size to be int"); the wrapper raises the one line the logic
    gives (with the nearest option), a ``CliRunError`` that Tango prints alone. Other steps'
    errors, and anything the logic does not recognise, pass unchanged.
    """
    from tango.common.exceptions import ConfigurationError
    from tango.step import Step

    _require_attributes(Step, ("from_params",), "T8")
    original = inspect.getattr_static(Step, "from_params")
    if not isinstance(original, classmethod):
        raise IncompatibleVersionError("T8: tango.step.Step.from_params is no longer a classmethod.")
    function = original.__func__
    if getattr(function, "_tango_fairscale", False):
        return

    @functools.wraps(function)
    def from_params(cls: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        type_name, keys = _step_type_and_keys(params)
        try:
            return function(cls, params, *args, **kwargs)
        except (TypeError, ConfigurationError) as error:
            one_line = None if _config_error_logic is None else _config_error_logic(type_name, keys, error)
            if one_line is None:
                raise
            raise one_line from error

    from_params._tango_fairscale = True  # type: ignore[attr-defined]
    Step.from_params = classmethod(from_params)  # type: ignore[method-assign,assignment]


def undo_step_config_errors() -> None:
    """Undo T8 (for the canary test)."""
    from tango.step import Step

    current = inspect.getattr_static(Step, "from_params")
    wrapped = getattr(current.__func__, "__wrapped__", None)
    if getattr(current.__func__, "_tango_fairscale", False) and wrapped is not None:
        Step.from_params = classmethod(wrapped)  # type: ignore[method-assign,assignment]


# --- D1: DCP's save planner, overridden by the torch backend -----------------------------------------


def check_dcp_planner_overrides(planner_class: Any) -> None:
    """
    D1: the torch backend's per-host save planner overrides two private methods of DCP's
    ``DefaultSavePlanner`` (``_dedup_save_plans``, ``_create_global_plan``): no rebinding, but a
    dependency on torch internals, so checked like one: torch's version, and that both methods
    are still there to override. Called when the torch backend's checkpoint module is imported.
    """
    check_version("torch")
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    _require_attributes(DefaultSavePlanner, ("_dedup_save_plans", "_create_global_plan"), "D1")
    if not issubclass(planner_class, DefaultSavePlanner):
        raise IncompatibleVersionError(
            f"{planner_class.__name__} must subclass DCP's DefaultSavePlanner (D1)."
        )


# --- T4: how long Tango's step waits for workers after one failed ---------------------------------------

#: Seconds ``mp.spawn`` gives the other workers after one failed: to exit by themselves, then
#: again after SIGTERM, before SIGKILL.
SPAWN_GRACE_SECONDS = 5.0

_spawn_grace_lock = threading.Lock()
#: How many ``spawn_grace`` blocks are open, in all threads; the rebinding lives while any is.
_spawn_grace_blocks = 0
#: ``ProcessContext.join`` as it was before the first open block rebound it.
_spawn_join_original: Optional[Callable[..., Any]] = None
#: Per thread: how many ``spawn_grace`` blocks this thread is inside.
_spawn_grace_local = threading.local()


def _spawn_grace_depth() -> int:
    depth: int = getattr(_spawn_grace_local, "depth", 0)
    return depth


@contextmanager
def final_weights_from_disk(path: Path, load_final_weights: Callable[..., Any]) -> Iterator[None]:
    """
    T7: inside, this thread's ``torch.load`` of ``path`` (Tango's load of the step's
    ``weights.pt`` into the step's result, in its main process, after the workers) goes to
    ``load_final_weights(torch.load, path, ...)``
    (:func:`tango_fairscale.step_result.load_final_weights`: the tensors views of a shared
    mapping of a private copy, not a private copy in memory). Every other load, and every other
    thread's, is passed through unchanged; ``torch.load`` is restored when the block ends.
    Tango's ``_train`` calls ``torch.load`` as an attribute of the ``torch`` module, so only that
    name reaches it. The step's logic opens it around Tango's ``_train``
    (:func:`tango_fairscale.train_step.run_step`).
    """
    _require_attributes(torch, ("load",), "T7")
    _require_attributes(torch.serialization, ("set_default_mmap_options",), "T7")
    original = torch.load
    target = Path(path).resolve()
    thread = threading.get_ident()
    # Off once the block ends, should another patch have rebound torch.load over this one meanwhile.
    active = [True]

    @functools.wraps(original)
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            active[0]
            and threading.get_ident() == thread
            and isinstance(f, (str, os.PathLike))
            and Path(f).resolve() == target
            and not kwargs.get("mmap")
        ):
            return load_final_weights(original, Path(f), *args, **kwargs)
        return original(f, *args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        active[0] = False
        if torch.load is load:
            torch.load = original


@contextmanager
def spawn_grace() -> Iterator[None]:
    """
    T4: inside, ``torch.multiprocessing``'s spawn contexts joined by this thread without a grace
    period (as Tango's step calls ``mp.spawn``) get :data:`SPAWN_GRACE_SECONDS`. When one of
    Tango's workers fails, the spawn context sends the others SIGTERM and waits 30 s before
    SIGKILL; a worker that hangs (stopped, or stuck in C++ code that never returns to Python's
    signal handling) ignores SIGTERM, so every such failure cost 30 s more than the
    ``collective_timeout`` that detected it. ``mp.spawn`` takes no grace period, so Tango's step
    cannot be given one: ``ProcessContext.join`` is rebound while a block is open (in any thread:
    counted, so one thread leaving cannot remove it under another), and restored when the last one
    ends; other threads' joins, and joins given a grace period, are passed through unchanged.
    The step's logic opens it around Tango's ``_train`` (:func:`tango_fairscale.train_step.run_step`).
    """
    global _spawn_grace_blocks, _spawn_join_original
    # The module: ``torch.multiprocessing.spawn`` as an attribute is the function of that name.
    spawn = importlib.import_module("torch.multiprocessing.spawn")
    with _spawn_grace_lock:
        if _spawn_grace_blocks == 0:
            _require_attributes(spawn, ("ProcessContext",), "T4")
            _require_attributes(spawn.ProcessContext, ("join",), "T4")
            original = spawn.ProcessContext.join
            _require_signature(original, ("self", "timeout", "grace_period"), "T4")

            @functools.wraps(original)
            def join(self: Any, timeout: Optional[float] = None, grace_period: Optional[float] = None) -> Any:
                if grace_period is None and _spawn_grace_depth() > 0:
                    grace_period = SPAWN_GRACE_SECONDS
                return original(self, timeout, grace_period)

            join._tango_fairscale = True  # type: ignore[attr-defined]
            spawn.ProcessContext.join = join  # type: ignore[method-assign]
            _spawn_join_original = original
        _spawn_grace_blocks += 1
    _spawn_grace_local.depth = _spawn_grace_depth() + 1
    try:
        yield
    finally:
        _spawn_grace_local.depth -= 1
        with _spawn_grace_lock:
            _spawn_grace_blocks -= 1
            if _spawn_grace_blocks == 0:
                if getattr(spawn.ProcessContext.join, "_tango_fairscale", False):
                    spawn.ProcessContext.join = _spawn_join_original  # type: ignore[method-assign]
                else:  # rebound again by someone else meanwhile: theirs is left in place
                    logger.warning("ProcessContext.join was rebound during a step: left as it is (T4)")
                _spawn_join_original = None
