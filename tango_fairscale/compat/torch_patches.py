"""
The patches of torch: FSDP2's gathered parameters on CPU workers (S1, :func:`enable_cpu_fsdp2`),
parameters registered on meta while a model is built with ``init_on_meta`` (P1,
:func:`meta_parameter_registration`), and the check of the private DCP methods the torch
backend's save planner overrides (D1, :func:`check_dcp_planner_overrides`).
"""

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .. import versions
from .checks import IncompatibleVersionError, _require_attributes, check_version, signature_matches

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


# S1 upstream: none found
def enable_cpu_fsdp2() -> None:
    """
    S1: FSDP2's gathered parameters on a CPU worker each in a memory mapping of its own, unmapped
    when the unit reshards (:mod:`~tango_fairscale.compat.fsdp2_gathered_memory`); the
    torch backend calls it before sharding on a CPU mesh. GPU workers never call it. Idempotent and
    thread-safe; :func:`disable_cpu_fsdp2` undoes it.
    """
    global _fsdp2_originals
    with _fsdp2_lock:
        if _fsdp2_originals is not None:
            return
        check_version("torch")
        # Looked up through the package, whose name is the one a test replaces to stand for a torch
        # without S1's target (tests/test_gathered_memory.py).
        from .. import compat

        if not compat.cpu_fsdp2_available():
            versions.feature_unavailable(
                "FSDP2's gathered parameters in mappings of their own on CPU workers",
                "S1",
                "torch.UntypedStorage._swap_data_ptr_ and FSDPParam.init_all_gather_outputs"
                f"{_S1_INIT_PARAMETERS[1:]}",
                "the torch backend's CPU workers gather through torch's allocator (the same values; "
                "a LoRA worker's heap can grow more, docs/capacity.md)",
            )
            return
        from . import fsdp2_gathered_memory as gathered_memory

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


# P1 upstream: the initialisers' early returns on meta, pytorch/pytorch#176240 and pytorch/pytorch#176614
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


# --- D1: DCP's save planner, overridden by the torch backend -----------------------------------------


# D1 upstream: none found (a private API, no defect)
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
