"""
Materialising: a module's ``meta`` parameters (outside already-built FSDP units) allocated on the
worker, one unit at a time (one buffer per dtype, or a pretrained tensor as it is), and each given
its value: read, replayed, or set by the module's initialisers; and :func:`check_initialisable`,
which raises before any worker starts what materialising would raise.
"""

import math
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError

from .replay import _evaluate, _kind, _track_of
from .tracks import _INITIALISERS, _on_meta


def _modules_outside_units(
    module: nn.Module, is_unit: Optional[Callable[[nn.Module], bool]]
) -> Iterator[nn.Module]:
    """``module`` and its submodules, those inside a submodule that ``is_unit`` says is a unit left out."""
    stack = [module]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(child for child in current.children() if is_unit is None or not is_unit(child))


def _hf_init_function(root: nn.Module) -> Optional[Callable[[nn.Module], None]]:
    """The ``_init_weights`` of the outermost Hugging Face model in ``root``, if there is one."""
    for candidate in root.modules():
        init = getattr(candidate, "_init_weights", None)
        if callable(init) and hasattr(candidate, "config"):
            return init  # type: ignore[no-any-return]
    return None


@torch.no_grad()
def _initialise(touched: List[nn.Module], check: Set[int], root: nn.Module) -> List[str]:
    """Run the initialisers of the ``touched`` modules; the names of those in ``check`` still unset (NaN)."""
    hf_init = _hf_init_function(root)
    for submodule in touched:
        for initialiser in _INITIALISERS:
            reset = getattr(submodule, initialiser, None)
            if callable(reset):
                reset()
                break
        if hf_init is not None:
            hf_init(submodule)
    return [
        f"{type(submodule).__name__}.{name}"
        for submodule in touched
        for name, p in submodule._parameters.items()
        if p is not None and id(p) in check and torch.isnan(p).any()
    ]


def _uncovered_error(names: List[str]) -> ConfigurationError:
    return ConfigurationError(
        f"init_on_meta: no initialiser sets {sorted(set(names))}: their modules have no reset_parameters() "
        "(or _reset_parameters()) that sets them and no Hugging Face _init_weights covers them. Give "
        "those modules a reset_parameters() method, or set init_on_meta: false."
    )


def _unexact_error(refused: List[Tuple[str, str]]) -> ConfigurationError:
    shown = "; ".join(f"{name} ({why})" for name, why in refused[:5])
    more = f"; and {len(refused) - 5} more" if len(refused) > 5 else ""
    return ConfigurationError(
        f"init_on_meta cannot give these parameters the values an eager build of the model gives them: "
        f"{shown}{more}. While the model is built its parameters are on meta, without values: compute "
        "these from constants and random draws (e.g. in reset_parameters()), or set "
        "training_engine.init_on_meta: false."
    )


@torch.no_grad()
def materialize_module(
    module: nn.Module,
    device: torch.device,
    root: Optional[nn.Module] = None,
    one_allocation: bool = False,
    is_unit: Optional[Callable[[nn.Module], bool]] = None,
) -> int:
    """
    Allocate ``module``'s ``meta`` parameters on ``device`` and give them their values (see the
    module's docstring). Returns the number of elements materialised.

    ``is_unit``, given by the backend that shards right after: whether a submodule is already a
    unit of its own (built and sharded), whose parameters are the unit's and are skipped, with
    everything inside it. This module knows no backend's types.

    ``one_allocation``, for a module that FSDP2, or FairScale with ``flatten_parameters``, shards
    right after (both copy every parameter out before anything writes to it):

    - the new parameters of one dtype are views of one buffer, so that a unit is one allocation,
      freed as one once sharding has copied every parameter out of it. Allocated parameter by
      parameter, those under the CPU mmap threshold (:mod:`tango_fairscale.cpu.memory`) came from
      the heap, which each unit's shard then fragmented: loading GPT-2 small (124 M parameters, 2
      workers, a unit per block) grew a worker's private memory 133 MiB more than its shards;
    - a pretrained parameter of a module not initialised (none of its parameters left to an
      initialiser) on the CPU, with no op recorded on it, is the tensor its reader gives, not a
      copy: from ``fairscale::from_pretrained``, a view of the read-only mapped file, whose pages
      are the page cache's. Copying it first held every unit twice in private memory while it was
      sharded.

    Not for FairScale's unflattened sharding, which frees each parameter's storage in place: views
    of one buffer share it, and a mapped file's cannot be freed.
    """
    found: List[Tuple[nn.Module, str, nn.Parameter]] = []
    for submodule in _modules_outside_units(module, is_unit):
        for name, param in submodule._parameters.items():
            if param is not None and _on_meta(param):
                found.append((submodule, name, param))
    fresh = {id(p): p for _, _, p in found}  # tied parameters once
    tracks = {key: _track_of(p) for key, p in fresh.items()}
    kinds = {key: _kind(track) for key, track in tracks.items()}
    refused = [
        (f"{type(m).__name__}.{n}", str(tracks[id(p)].unexact))  # type: ignore[union-attr]
        for m, n, p in found
        if kinds[id(p)] == "refuse"
    ]
    if refused:
        raise _unexact_error(refused)
    # Modules with a parameter left to initialisers run them, which may overwrite their others:
    # those are set after, and none of a touched module's parameters can be a read-only mapping.
    touched = list(dict.fromkeys(m for m, _, p in found if kinds[id(p)] == "initialise"))
    in_touched = {id(p) for m in touched for p in m._parameters.values() if p is not None}
    values: Dict[int, torch.Tensor] = {}
    for key, old in fresh.items():
        if kinds[key] != "read":
            continue
        value = tracks[key].read()  # type: ignore[union-attr,misc]
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
        and key not in in_touched
        and value.dtype == fresh[key].dtype
        and value.device.type == device.type == "cpu"
    }
    buffers: Dict[torch.dtype, torch.Tensor] = {}
    if one_allocation:
        for dtype in dict.fromkeys(p.dtype for key, p in fresh.items() if key not in aliased):
            total = sum(p.numel() for key, p in fresh.items() if p.dtype == dtype and key not in aliased)
            buffers[dtype] = torch.empty(total, dtype=dtype, device=device)
    offsets = dict.fromkeys(buffers, 0)
    replaced: Dict[int, nn.Parameter] = {}
    for key, old in fresh.items():
        if key in aliased:
            new = values[key]
        elif one_allocation:
            start = offsets[old.dtype]
            offsets[old.dtype] += old.numel()
            new = buffers[old.dtype][start : start + old.numel()].view(old.shape)
        else:
            new = torch.empty(old.shape, dtype=old.dtype, device=device)
        if kinds[key] == "initialise":
            new.fill_(math.nan)  # NaN marks what no initialiser touched
        replaced[key] = nn.Parameter(new, requires_grad=old.requires_grad)
    for submodule, name, old in found:
        submodule._parameters[name] = replaced[id(old)]
    if touched:
        check = {id(replaced[key]) for key, kind in kinds.items() if kind == "initialise"}
        unset = _initialise(touched, check, root if root is not None else module)
        if unset:
            raise _uncovered_error(unset)
    for key, kind in kinds.items():
        new = replaced[key]
        track = tracks[key]
        if kind == "read" and key not in aliased:
            new.copy_(values[key])
        elif kind == "exact":
            _evaluate(track, into=new)  # type: ignore[arg-type]
        elif kind == "initialise" and track is not None and track.log:
            _evaluate(track, into=new, initialised=True)
    return sum(p.numel() for p in replaced.values())


def check_initialisable(model: nn.Module) -> None:
    """
    Raise one :class:`ConfigurationError` listing every parameter of a model built under
    :func:`parameters_on_meta` whose eager value cannot be reproduced, or, failing that, every one
    that materialising would leave unset, without materialising the model: the modules with
    parameters left to initialisers are tried on the CPU, one per class and set of such
    parameters (initialisers act per class), so the cost is bounded by the distinct classes, not
    the model's size. For pre-flight and ``plan``.
    """
    refused: List[Tuple[str, str]] = []
    for path, param in model.named_parameters():
        if _on_meta(param):
            track = _track_of(param)
            if _kind(track) == "refuse":
                refused.append((path, str(track.unexact)))  # type: ignore[union-attr]
    if refused:
        raise _unexact_error(refused)
    tried: Dict[Tuple[type, Tuple[str, ...]], List[str]] = {}
    unset: List[str] = []
    for path, module in model.named_modules():
        left = tuple(
            name
            for name, p in module._parameters.items()
            if p is not None and _on_meta(p) and _kind(_track_of(p)) == "initialise"
        )
        if not left:
            continue
        kind = (type(module), left)
        if kind not in tried:
            check = _allocate_own(module, left)
            tried[kind] = [name.split(".", 1)[1] for name in _initialise([module], check, model)]
        unset += [f"{path}.{name}" if path else name for name in tried[kind]]
    if unset:
        raise _uncovered_error(unset)


@torch.no_grad()
def _allocate_own(module: nn.Module, left: Tuple[str, ...]) -> Set[int]:
    """
    Allocate ``module``'s own ``meta`` parameters on the CPU for a trial initialisation: NaN for
    those ``left`` to initialisers (whose ids are returned), zeros for the others.
    """
    check: Set[int] = set()
    for name, old in list(module._parameters.items()):
        if old is None or not _on_meta(old):
            continue
        fresh = torch.full(old.shape, math.nan if name in left else 0.0, dtype=old.dtype)
        module._parameters[name] = nn.Parameter(fresh, requires_grad=old.requires_grad)
        if name in left:
            check.add(id(module._parameters[name]))
    return check
