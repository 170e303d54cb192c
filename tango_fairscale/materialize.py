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
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError

from .compat import meta_parameter_registration

logger = logging.getLogger(__name__)

_state = threading.local()

#: The methods PyTorch's own modules initialise their parameters with (``nn.MultiheadAttention``
#: has ``_reset_parameters``), in the order they are tried.
_INITIALISERS = ("reset_parameters", "_reset_parameters")


def _moving_to_meta() -> bool:
    return getattr(_state, "depth", 0) > 0 and not getattr(_state, "paused", False)


#: Attribute of a ``meta`` parameter holding the value its module's constructor gave it, kept
#: when nothing else could initialise it again (see :func:`_to_meta`).
_CONSTRUCTED = "_tango_fairscale_constructed"


#: Attribute of a ``meta`` parameter: a function that reads its pretrained value (see
#: :func:`mark_pretrained`), called when its unit is materialised.
_PRETRAINED = "_tango_fairscale_pretrained"


def building_on_meta() -> bool:
    """Whether parameters registered now (on this thread) are moved to ``meta``."""
    return _moving_to_meta()


def mark_pretrained(param: nn.Parameter, read: Callable[[], torch.Tensor]) -> None:
    """
    Give a ``meta`` parameter its pretrained value, read by ``read()`` only when its unit is
    materialised (:func:`materialize_module`), in place of any initialiser: a worker reads one
    unit's tensors at a time from memory-mapped files, never the whole model. The tensor
    ``read()`` returns may become the parameter's data until the unit is sharded (see
    ``one_allocation``), never written through.
    """
    if not param.is_meta:
        raise ValueError("mark_pretrained takes meta parameters")
    setattr(param, _PRETRAINED, read)


def _has_initialiser(module: nn.Module) -> bool:
    return any(callable(getattr(module, name, None)) for name in _INITIALISERS)


def _to_meta(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """
    Registration hook: in a thread inside :func:`parameters_on_meta`, move the new parameter to
    meta. A parameter that no initialiser could set again (a bare ``nn.Parameter`` on a module
    without ``reset_parameters``, e.g. a learned scale) keeps the value its constructor gave it,
    so it is materialised exactly as an eager build would have it. Hugging Face modules are left
    to the model's ``_init_weights``: keeping their values would hold the whole model.
    """
    if not _moving_to_meta() or param.is_meta:
        return
    meta = nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)
    if not _has_initialiser(module) and not type(module).__module__.startswith("transformers."):
        setattr(meta, _CONSTRUCTED, param.data)
    module._parameters[name] = meta


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
def _allocate(
    module: nn.Module, device: torch.device, replaced: Dict[int, nn.Parameter], one_allocation: bool
) -> List[nn.Module]:
    """
    Replace the ``meta`` parameters of ``module`` and of its submodules outside FSDP units; with
    ``one_allocation``, see :func:`materialize_module`. Returns the modules to initialise.
    """
    found: List[Tuple[nn.Module, str, nn.Parameter]] = []
    for submodule in _modules_outside_fsdp(module):
        for name, param in submodule._parameters.items():
            if param is not None and param.is_meta:
                found.append((submodule, name, param))
    # A module whose parameters are all pretrained is not initialised (that would overwrite them).
    touched = list(dict.fromkeys(m for m, _, p in found if getattr(p, _PRETRAINED, None) is None))
    untouched_only = {id(p) for _, _, p in found} - {id(p) for m, _, p in found if m in touched}
    fresh = {id(p): p for _, _, p in found if id(p) not in replaced}  # tied parameters once
    # Pretrained values taken as they are read (see materialize_module), the others copied.
    values: Dict[int, torch.Tensor] = {}
    for key, old in fresh.items():
        read = getattr(old, _PRETRAINED, None)
        value = read() if read is not None else getattr(old, _CONSTRUCTED, None)
        if value is None:
            continue
        if tuple(value.shape) != tuple(old.shape):
            holder, name = next((m, n) for m, n, p in found if p is old)
            raise ConfigurationError(
                f"{type(holder).__name__}.{name}: the value to load has shape {list(value.shape)}, "
                f"the parameter {list(old.shape)}."
            )
        values[key] = value
    aliased = {
        key
        for key, value in values.items()
        if one_allocation
        and key in untouched_only
        and getattr(fresh[key], _PRETRAINED, None) is not None
        and value.dtype == fresh[key].dtype
        and value.device.type == device.type == "cpu"
    }
    buffers: Dict[torch.dtype, torch.Tensor] = {}
    if one_allocation:
        for dtype in dict.fromkeys(p.dtype for key, p in fresh.items() if key not in aliased):
            total = sum(p.numel() for key, p in fresh.items() if p.dtype == dtype and key not in aliased)
            buffers[dtype] = torch.empty(total, dtype=dtype, device=device)
    offsets = dict.fromkeys(buffers, 0)
    for key, old in fresh.items():
        if key in aliased:
            new = values[key]
        elif one_allocation:
            start = offsets[old.dtype]
            offsets[old.dtype] += old.numel()
            new = buffers[old.dtype][start : start + old.numel()].view(old.shape)
        else:
            new = torch.empty(old.shape, dtype=old.dtype, device=device)
        if key not in aliased:
            if key in values:
                new.copy_(values[key])
            else:
                new.fill_(math.nan)  # NaN marks what no initialiser touched
        replaced[key] = nn.Parameter(new, requires_grad=old.requires_grad)
    for submodule, name, old in found:
        submodule._parameters[name] = replaced[id(old)]
    return touched


@torch.no_grad()
def _initialise(touched: List[nn.Module], replaced: Dict[int, nn.Parameter], root: nn.Module) -> List[str]:
    """Run the initialisers of the ``touched`` modules; return the names of parameters still unset."""
    hf_init = _hf_init_function(root)
    for submodule in touched:
        for initialiser in _INITIALISERS:
            reset = getattr(submodule, initialiser, None)
            if callable(reset):
                reset()
                break
        if hf_init is not None:
            hf_init(submodule)
    fresh = {id(v) for v in replaced.values()}
    return [
        f"{type(submodule).__name__}.{name}"
        for submodule in touched
        for name, p in submodule._parameters.items()
        if p is not None and id(p) in fresh and torch.isnan(p).any()
    ]


def _uncovered_error(names: List[str]) -> ConfigurationError:
    return ConfigurationError(
        f"init_on_meta: no initialiser sets {sorted(set(names))}: their modules have no reset_parameters() "
        "(or _reset_parameters()) that sets them and no Hugging Face _init_weights covers them. Give "
        "those modules a reset_parameters() method, or set init_on_meta: false."
    )


def materialize_module(
    module: nn.Module, device: torch.device, root: Optional[nn.Module] = None, one_allocation: bool = False
) -> int:
    """
    Allocate ``module``'s ``meta`` parameters on ``device`` (skipping FSDP units already built
    inside it) and initialise them. Returns the number of elements materialised.

    ``one_allocation``, for a module that FSDP2, or FairScale with ``flatten_parameters``, shards
    right after (both copy every parameter out before anything writes to it):

    - the new parameters of one dtype are views of one buffer, so that a unit is one allocation,
      freed as one once sharding has copied every parameter out of it. Allocated parameter by
      parameter, those under the CPU mmap threshold (:mod:`tango_fairscale.cpu.memory`) came from
      the heap, which each unit's shard then fragmented: loading GPT-2 small (124 M parameters, 2
      workers, a unit per block) grew a worker's private memory 133 MiB more than its shards;
    - a pretrained parameter of a module not initialised (all its parameters pretrained) on the
      CPU is the tensor its reader gives, not a copy: from ``fairscale::from_pretrained``, a view
      of the read-only mapped file, whose pages are the page cache's. Copying it first held every
      unit twice in private memory while it was sharded.

    Not for FairScale's unflattened sharding, which frees each parameter's storage in place: views
    of one buffer share it, and a mapped file's cannot be freed.
    """
    replaced: Dict[int, nn.Parameter] = {}
    touched = _allocate(module, device, replaced, one_allocation)
    if touched:
        uninitialised = _initialise(touched, replaced, root if root is not None else module)
        if uninitialised:
            raise _uncovered_error(uninitialised)
    return sum(p.numel() for p in replaced.values())


def check_initialisable(model: nn.Module) -> None:
    """
    Raise one :class:`ConfigurationError` listing every parameter of a model built under
    :func:`parameters_on_meta` that materialising would leave unset, without materialising
    the model: one module of each class is tried on the CPU (initialisers act per class), so the
    cost is bounded by the distinct classes, not the model's size. For pre-flight and ``plan``.
    """
    tried: Dict[type, List[str]] = {}
    unset: List[str] = []
    for path, module in model.named_modules():
        if not any(p is not None and p.is_meta for p in module._parameters.values()):
            continue
        kind = type(module)
        if kind not in tried:
            replaced: Dict[int, nn.Parameter] = {}
            touched = [module] if _allocate_own(module, replaced) else []
            tried[kind] = [name.split(".", 1)[1] for name in _initialise(touched, replaced, model)]
        unset += [f"{path}.{name}" if path else name for name in tried[kind]]
    if unset:
        raise _uncovered_error(unset)


@torch.no_grad()
def _allocate_own(module: nn.Module, replaced: Dict[int, nn.Parameter]) -> bool:
    """Allocate only ``module``'s own ``meta`` parameters on the CPU (for a trial initialisation)."""
    for name, old in list(module._parameters.items()):
        if old is None or not old.is_meta:
            continue
        constructed = getattr(old, _CONSTRUCTED, None)
        if getattr(old, _PRETRAINED, None) is not None:
            fresh = torch.zeros(old.shape, dtype=old.dtype)  # set from its file, not read for a trial
        elif constructed is not None:
            fresh = constructed.clone()
        else:
            fresh = torch.full(old.shape, math.nan, dtype=old.dtype)
        replaced[id(old)] = nn.Parameter(fresh, requires_grad=old.requires_grad)
        module._parameters[name] = replaced[id(old)]
    return bool(replaced)
