"""
The integration boundary: every change this package makes to FairScale, Tango or torch.

Nothing here happens at import. Each patch is installed explicitly, by one function, which
first checks the version of the library it patches and that every attribute it rebinds is
there, and refuses with an error naming both otherwise:

- :func:`install` (called once by ``import tango_fairscale``) installs what every process
  needs: the step patch (T1) and the checkpoint autocast fix (F5).
- :func:`enable_cpu_fsdp` installs F1-F4 in a process whose FSDP units compute on the CPU (the
  FairScale backend calls it before wrapping on a CPU worker); GPU workers never call it, so
  their FairScale code path is unchanged. :func:`disable_cpu_fsdp` undoes it (for tests).
- :func:`meta_parameter_registration` is the one torch patch (P1), active only while the
  engine builds a model with ``init_on_meta``.

The patches, with the reason for each (``docs/architecture.md`` has the same list):

F1. ``fairscale.nn.data_parallel.fully_sharded_data_parallel.torch`` becomes a stand-in whose
    ``cuda`` attribute answers the stream calls with no-op CPU streams
    (:mod:`tango_fairscale.cpu.streams`). FairScale's FSDP overlaps communication on CUDA streams
    and never checks that CUDA is there (FairScale has no CPU path; PyTorch's FSDP needed the same
    no-op streams for CPU training, pytorch/pytorch#106099). Every other attribute, and
    ``torch.cuda`` anywhere else, is the real thing.
F2. ``aten::record_stream`` gets a no-op CPU kernel. It has none, and FairScale calls it on
    every gathered buffer; on a CPU it has nothing to protect.
F3. FairScale's ``enable_nccl_base_collectives`` flag (its ``ENABLE_NCCL_BASE_COLLECTIVES=0``
    switch, read at import) is turned off in its FSDP module and its reduce-scatter bucketer:
    gloo's single-tensor reduce-scatter wants ``[world_size * n]`` where FairScale passes
    ``[world_size, n]``; the list forms carry the same data and are what gloo implements.
F4. ``dist`` in the same two modules becomes :class:`~tango_fairscale.cpu.collectives.GlooCollectives`:
    all-gather and reduce-scatter as rings of gloo send/recv, which move half the bytes of an
    all-reduce. Every other ``torch.distributed`` function is the real one.
F5. ``fairscale.nn.checkpoint.checkpoint_activations.is_autocast_enabled`` and ``autocast``
    record and restore the autocast state of every device type with its dtype. FairScale's
    versions look at CUDA autocast only and re-enter it as float16, so a checkpointed unit's
    recomputation in backward ran without CPU bfloat16 autocast (a dtype error, or silently
    float32 gradients), and under CUDA bfloat16 autocast in float16 (facebookresearch/fairscale#1199,
    the same bug as pytorch/pytorch#71124 in torch's own checkpoint). Applies on every device.
T1. ``tango.integrations.torch.train.TorchTrainStep._train`` is wrapped, for every step, to
    (a) add ``tango_fairscale`` to the modules Tango re-imports in its spawned workers
    (``tango.common.util.get_extra_imported_modules()``), so a plain ``import tango_fairscale``
    (a script, a custom step's module, a conftest) works as ``include_package`` does: without it
    the workers resolved ``"fairscale"`` to ai2-tango's bundled engine; (b) for steps on the
    ``"fairscale"`` engine, run :func:`tango_fairscale.preflight.preflight` before the workers
    are spawned; (c) for distributed steps (any engine), serve the workers' rendezvous store from
    the main process (:func:`tango_fairscale.launch.rendezvous_store`): Tango's default
    ``distributed_port`` is replaced by a free one when taken (two runs on one machine), and a
    port the config set that is taken is refused, naming ``distributed_port``.
P1. ``torch.nn.Module.register_parameter``, while :func:`meta_parameter_registration` is active
    in any thread: parameters registered by a thread inside
    :func:`tango_fairscale.materialize.parameters_on_meta` are moved to the ``meta`` device.
    The rebinding is counted process-wide, so one thread leaving cannot remove it under another.

Registration over the bundled integration's names (``exist_ok=True``) is in :mod:`.registry`.
"""

import functools
import logging
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .cpu.collectives import GlooCollectives
from .cpu.streams import NullStream, TorchWithCpuStreams, noop_record_stream

logger = logging.getLogger(__name__)

#: The releases each patch was written against and tested with. Anything else is refused at
#: install time (set ``TANGO_FAIRSCALE_SKIP_VERSION_CHECK=1`` to try anyway).
CHECKED_VERSIONS: Dict[str, Tuple[str, ...]] = {
    "fairscale": ("0.4.13",),
    "ai2-tango": ("1.3.",),
    "torch": ("2.13.",),
}
SKIP_VERSION_CHECK_VARIABLE = "TANGO_FAIRSCALE_SKIP_VERSION_CHECK"

__all__ = [
    "CHECKED_VERSIONS",
    "IncompatibleVersionError",
    "NullStream",
    "cpu_fsdp_enabled",
    "disable_cpu_fsdp",
    "enable_cpu_fsdp",
    "install",
    "meta_parameter_registration",
]


class IncompatibleVersionError(ImportError):
    """A patched library is a version, or lacks an attribute, that this package was not checked against."""


def _installed_version(distribution: str) -> str:
    if distribution == "torch":
        return torch.__version__
    from importlib.metadata import version

    return version(distribution)


def check_version(distribution: str) -> None:
    """Refuse a release of ``distribution`` outside :data:`CHECKED_VERSIONS`."""
    found = _installed_version(distribution)
    checked = CHECKED_VERSIONS[distribution]
    if any(found == v or (v.endswith(".") and found.startswith(v)) for v in checked):
        return
    if os.environ.get(SKIP_VERSION_CHECK_VARIABLE) == "1":
        logger.warning(
            "%s %s was not checked with tango-fairscale (checked: %s)", distribution, found, checked
        )
        return
    raise IncompatibleVersionError(
        f"tango-fairscale patches {distribution} and was checked against {distribution} "
        f"{' / '.join(v + ('x' if v.endswith('.') else '') for v in checked)}, but {found} is installed. "
        f"Install a checked version (pip install -e . resolves them), or set "
        f"{SKIP_VERSION_CHECK_VARIABLE}=1 to run unchecked at your own risk."
    )


def _require_attributes(module: Any, names: Sequence[str], patch: str) -> None:
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise IncompatibleVersionError(
            f"tango-fairscale patch {patch} rebinds {module.__name__}.{missing}, which this installation "
            "lacks: the library changed. Install the versions in pyproject.toml."
        )


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


# --- T1: Tango's torch::train step ----------------------------------------------------------------

PACKAGE = "tango_fairscale"
#: ``torch::train``'s default ``distributed_port``.
TANGO_DEFAULT_PORT = 54761


def _wrap_train_step() -> None:
    from tango.common import util as tango_util
    from tango.integrations.torch import train as tango_train

    _require_attributes(tango_train, ("TorchTrainStep",), "T1")
    _require_attributes(tango_train.TorchTrainStep, ("_train",), "T1")
    _require_attributes(tango_util, ("get_extra_imported_modules",), "T1")
    step_class = tango_train.TorchTrainStep
    original: Callable[..., Any] = step_class._train
    if getattr(original, "_tango_fairscale", False):
        return

    @functools.wraps(original)
    def _train(
        self: Any, model: Any, training_engine: Any, dataset_dict: Any, train_dataloader: Any, **kwargs: Any
    ) -> Any:
        from .launch import rendezvous_store
        from .preflight import preflight, uses_fairscale_engine

        # (a) The set is Tango's own; it is passed to mp.spawn by the original _train.
        tango_util.get_extra_imported_modules().add(PACKAGE)
        if uses_fairscale_engine(training_engine):
            preflight(
                model=model,
                training_engine=training_engine,
                dataset_dict=dataset_dict,
                train_dataloader=train_dataloader,
                work_dir=self.work_dir,
                **kwargs,
            )
        devices = kwargs.get("devices")
        if not (devices and len(devices) > 1):
            return original(self, model, training_engine, dataset_dict, train_dataloader, **kwargs)
        # (b) Served from this process for the life of the step (see tango_fairscale.launch).
        configured = getattr(self, "_config", None) or {}
        with rendezvous_store(
            kwargs.get("distributed_port", TANGO_DEFAULT_PORT),
            set_in_config="distributed_port" in configured,
        ) as port:
            kwargs["distributed_port"] = port
            return original(self, model, training_engine, dataset_dict, train_dataloader, **kwargs)

    _train._tango_fairscale = True  # type: ignore[attr-defined]
    step_class._train = _train  # type: ignore[method-assign]


_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Install the patches every process needs (T1, F5), once. Called by ``import tango_fairscale``."""
    global _installed
    with _install_lock:
        if _installed:
            return
        for distribution in CHECKED_VERSIONS:
            check_version(distribution)
        _install_checkpoint_autocast()
        _wrap_train_step()
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
    Make FairScale's FSDP run with a CPU compute device over the gloo backend (F1-F4).
    Idempotent and thread-safe.
    """
    global _cpu_enabled, _record_stream_library, _base_collectives_default
    with _cpu_lock:
        if _cpu_enabled:
            return
        check_version("fairscale")
        fsdp_module, _ = _fairscale_modules()
        if _base_collectives_default is None:
            _base_collectives_default = _read_base_collectives_default()
        fsdp_module.torch = TorchWithCpuStreams("torch")
        _set_base_collectives(False)
        set_collectives(GlooCollectives("torch.distributed"))
        library = torch.library.Library("aten", "IMPL")
        library.impl("record_stream", noop_record_stream, "CPU")
        _record_stream_library = library
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
        _cpu_enabled = False


def cpu_fsdp_enabled() -> bool:
    """Whether :func:`enable_cpu_fsdp` is in effect in this process."""
    return _cpu_enabled


# --- P1: parameters registered on meta ----------------------------------------------------------------

_original_register_parameter = nn.Module.register_parameter
_meta_lock = threading.Lock()
_meta_users = 0


@contextmanager
def meta_parameter_registration(hook: Callable[[nn.Module, str, nn.Parameter], None]) -> Iterator[None]:
    """
    While active (in any thread), ``nn.Module.register_parameter`` calls ``hook(module, name,
    param)`` after registering a parameter. The rebinding is shared by all threads and counted,
    so it is removed only when the last user leaves.
    """
    global _meta_users

    def register_parameter(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        _original_register_parameter(self, name, param)
        if param is not None:
            hook(self, name, param)

    with _meta_lock:
        if _meta_users == 0:
            nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        _meta_users += 1
    try:
        yield
    finally:
        with _meta_lock:
            _meta_users -= 1
            if _meta_users == 0:
                nn.Module.register_parameter = _original_register_parameter  # type: ignore[method-assign]
