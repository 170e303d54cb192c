"""
Building a model without ever holding all of it: parameters are created on the ``meta``
device (shapes only, no memory) and each FSDP unit's parameters are allocated and initialised
on the worker just before FairScale shards them, so a worker's peak is its shards plus one
unit, not the whole model.

- :func:`parameters_on_meta` is the construction context: every parameter registered while it
  is active is moved to ``meta``. Buffers stay real, because many are computed in
  ``__init__`` (causal masks, position tables) and could not be recomputed later.
- :func:`materialize_module` allocates a module's ``meta`` parameters (outside already-built
  FSDP units) and initialises them: each module's ``reset_parameters()``, then, for Hugging
  Face models, the model's own ``_init_weights``. Every worker does the same thing in the same
  order from the same seed, so all workers agree. Values differ from an eager build (the random
  draws happen in another order); the distributions are the same.
"""

import logging
import math
import threading
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError

from .compat import meta_parameter_registration

logger = logging.getLogger(__name__)

_state = threading.local()


def _moving_to_meta() -> bool:
    return getattr(_state, "depth", 0) > 0 and not getattr(_state, "paused", False)


def _to_meta(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Registration hook: in a thread inside :func:`parameters_on_meta`, move the new parameter to meta."""
    if _moving_to_meta() and not param.is_meta:
        module._parameters[name] = nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """
    Within this context (on this thread), new parameters are moved to the ``meta`` device.
    Other threads are not affected; the registration hook itself is installed process-wide by
    :func:`tango_fairscale.compat.meta_parameter_registration` (patch P1).
    """
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        with meta_parameter_registration(_to_meta):
            yield
    finally:
        _state.depth = depth


@contextmanager
def real_parameters() -> Iterator[None]:
    """Suspend :func:`parameters_on_meta` (while materialising or wrapping a unit)."""
    paused = getattr(_state, "paused", False)
    _state.paused = True
    try:
        yield
    finally:
        _state.paused = paused


#: The methods PyTorch's own modules initialise their parameters with (``nn.MultiheadAttention``
#: has ``_reset_parameters``), in the order they are tried.
_INITIALISERS = ("reset_parameters", "_reset_parameters")


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _modules_outside_fsdp(module: nn.Module) -> Iterator[nn.Module]:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    stack = [module]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(child for child in current.children() if not isinstance(child, FSDP))


def _hf_init_function(root: nn.Module) -> Optional[Callable[[nn.Module], None]]:
    """The ``_init_weights`` of the outermost Hugging Face model in ``root``, if there is one."""
    for candidate in root.modules():
        init = getattr(candidate, "_init_weights", None)
        if callable(init) and hasattr(candidate, "config"):
            return init  # type: ignore[no-any-return]
    return None


@torch.no_grad()
def materialize_module(module: nn.Module, device: torch.device, root: Optional[nn.Module] = None) -> int:
    """
    Allocate ``module``'s ``meta`` parameters on ``device`` (skipping FSDP units already built
    inside it) and initialise them. Returns the number of elements materialised.
    """
    replaced: Dict[int, nn.Parameter] = {}
    touched: List[nn.Module] = []
    for submodule in _modules_outside_fsdp(module):
        names = [n for n, p in submodule._parameters.items() if p is not None and p.is_meta]
        for name in names:
            old = submodule._parameters[name]
            assert old is not None
            if id(old) not in replaced:  # tied parameters stay tied
                # NaN marks what no initialiser touched.
                fresh = torch.full(old.shape, math.nan, dtype=old.dtype, device=device)
                replaced[id(old)] = nn.Parameter(fresh, requires_grad=old.requires_grad)
            submodule._parameters[name] = replaced[id(old)]
        if names:
            touched.append(submodule)
    if not touched:
        return 0
    hf_init = _hf_init_function(root if root is not None else module)
    for submodule in touched:
        for initialiser in _INITIALISERS:
            reset = getattr(submodule, initialiser, None)
            if callable(reset):
                reset()
                break
        if hf_init is not None:
            hf_init(submodule)
    uninitialised = [
        f"{type(submodule).__name__}.{name}"
        for submodule in touched
        for name, p in submodule._parameters.items()
        if p is not None and id(p) in {id(v) for v in replaced.values()} and torch.isnan(p).any()
    ]
    if uninitialised:
        raise ConfigurationError(
            f"init_on_meta: no initialiser set {sorted(set(uninitialised))[:5]}: their modules have no "
            "reset_parameters() and no Hugging Face _init_weights covers them. Give those modules a "
            "reset_parameters() method, or set init_on_meta: false."
        )
    return sum(p.numel() for p in replaced.values())
