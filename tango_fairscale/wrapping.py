"""
Wrapping a model's submodules in FSDP units and/or activation checkpointing:
:func:`with_wrapped_modules`, registered as the Model constructor
``"fairscale::with_wrapped_modules"``.
"""

import difflib
import logging
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Iterable, Iterator, List, Optional, Pattern, Sequence, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from fairscale.nn.checkpoint import checkpoint_wrapper
from tango.integrations.torch import Model

from .config import FSDPConfig
from .devices import worker_device
from .errors import WrapConfigurationError
from .materialize import has_meta_parameters, materialize_module, real_parameters
from .registry import register_model_constructor

logger = logging.getLogger(__name__)

#: The registered name of :func:`with_wrapped_modules`.
WRAPPER_TYPE = "fairscale::with_wrapped_modules"

_deferral = threading.local()
#: Attribute of a model on which a deferred :func:`with_wrapped_modules` leaves its plan.
_RECORDED_PLAN = "_tango_fairscale_wrap_plan"


@contextmanager
def deferred_wrapping() -> Iterator[None]:
    """
    Within this context (on this thread), :func:`with_wrapped_modules` selects its units but
    wraps nothing: it leaves the :class:`WrapPlan` and its ``fsdp_config`` on the model for the
    engine's backend to apply (:func:`recorded_plan`). The ``"torch"`` backend builds models so.
    """
    previous = getattr(_deferral, "active", False)
    _deferral.active = True
    try:
        yield
    finally:
        _deferral.active = previous


def recorded_plan(model: nn.Module) -> "Tuple[Optional[WrapPlan], Optional[FSDPConfig]]":
    """The plan and unit ``fsdp_config`` a deferred :func:`with_wrapped_modules` left on ``model``."""
    return getattr(model, _RECORDED_PLAN, (None, None))


def _unit_name(unit: str) -> str:
    return f"FSDP unit {unit!r}" if unit else "the root FSDP unit"


def _some(names: Sequence[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _parameter(model: nn.Module, path: str) -> nn.Parameter:
    module_name, _, name = path.rpartition(".")
    parameter: nn.Parameter = getattr(model.get_submodule(module_name) if module_name else model, name)
    return parameter


def refuse_mixed_requires_grad(unit: str, parameters: Iterable[Tuple[str, nn.Parameter]]) -> None:
    """The error of :meth:`WrapPlan.check_uniform_requires_grad` for one unit's own ``(name, parameter)``s."""
    groups: Dict[bool, List[str]] = {}
    for name, parameter in parameters:
        groups.setdefault(parameter.requires_grad, []).append(name)
    if len(groups) < 2:
        return
    frozen, trainable = sorted(groups[False]), sorted(groups[True])
    raise WrapConfigurationError(
        f"with_wrapped_modules: {_unit_name(unit)} holds frozen parameters ({_some(frozen)}) and trainable "
        f"ones ({_some(trainable)}); FairScale's FSDP flattens a unit's parameters into one tensor that is "
        "all frozen or all trainable. Make the frozen modules units of their own (add them to "
        "modules_to_wrap), set flatten_parameters: false in that unit's fsdp_config, or use "
        'training_engine.backend: "torch".'
    )


def require_parameters(model: nn.Module, where: str = "The model") -> None:
    """The one check that a model has something to shard: ``where`` names it in the error."""
    if not any(True for _ in model.parameters()):
        raise WrapConfigurationError(
            f"{where} ({type(model).__name__}) has no parameters: there is nothing to shard or train."
        )


def check_list_option(name: str, value: Any, what: str) -> None:
    """
    ``modules_to_wrap`` and ``wrap_module_classes`` must be lists: Tango's config conversion would
    turn a bare string into the set of its characters. Pre-flight calls this on the raw config.
    """
    if value is None or (isinstance(value, (list, tuple, set, frozenset)) and not isinstance(value, str)):
        return
    hint = f" Write it as a list, e.g. [{value!r}]." if isinstance(value, str) else ""
    raise WrapConfigurationError(
        f"with_wrapped_modules.{name}: expected a list of {what}, got {type(value).__name__} {value!r}.{hint}"
    )


def _compile_patterns(patterns: Any) -> List[Tuple[str, Pattern[str]]]:
    check_list_option("modules_to_wrap", patterns, "regex strings")
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise WrapConfigurationError(
                f"with_wrapped_modules.modules_to_wrap: every entry must be a regex string, "
                f"got {type(pattern).__name__} {pattern!r}."
            )
        try:
            compiled.append((pattern, re.compile(pattern)))
        except re.error as error:
            raise WrapConfigurationError(
                f"with_wrapped_modules.modules_to_wrap: {pattern!r} is not a valid regular "
                f"expression ({error})."
            ) from None
    return compiled


def _depth(name: str) -> int:
    return name.count(".") + 1


def _nearest_names(target: str, names: Sequence[str], limit: int = 5) -> List[str]:
    close = difflib.get_close_matches(target, names, n=limit, cutoff=0.4)
    return close or list(names[:limit])


def plan_wrapping(
    model: nn.Module,
    modules_to_wrap: Optional[Iterable[str]] = None,
    *,
    wrap_module_classes: Optional[Iterable[str]] = None,
    min_num_params: Optional[int] = None,
) -> List[str]:
    """
    Select the submodules to wrap, without changing ``model``, and return their qualified names,
    deepest first.

    A submodule is selected when its name fully matches one of ``modules_to_wrap`` (regexes),
    or its class name is in ``wrap_module_classes``, or (when ``min_num_params`` is set) it is a
    smallest submodule holding at least that many parameters that no other rule selected.
    Every pattern and class name must select something, and none may select the root module
    (the engine always wraps the root itself).
    """
    names = [name for name, _ in model.named_modules() if name]
    modules = dict(model.named_modules())
    selected: Dict[str, str] = {}

    patterns = _compile_patterns(modules_to_wrap if modules_to_wrap is not None else [])
    for pattern, regex in patterns:
        if regex.fullmatch(""):
            raise WrapConfigurationError(
                f"with_wrapped_modules.modules_to_wrap: {pattern!r} matches the root module "
                "(its name is the empty string). The training engine wraps the root itself; "
                'match submodules only, e.g. r"layers\\.[0-9]+".'
            )
        hits = [name for name in names if regex.fullmatch(name)]
        if not hits:
            near = _nearest_names(pattern, names)
            raise WrapConfigurationError(
                f"with_wrapped_modules.modules_to_wrap: {pattern!r} matches no submodule of "
                f"{type(model).__name__}. Patterns must match a whole name from named_modules(). "
                f"Nearest names: {near}."
            )
        for name in hits:
            selected.setdefault(name, f"pattern {pattern!r}")

    check_list_option("wrap_module_classes", wrap_module_classes, "class names")
    classes = list(wrap_module_classes or ())
    if classes:
        present = {type(modules[name]).__name__ for name in names}
        for class_name in classes:
            if class_name in present:
                continue
            if class_name == type(model).__name__:
                raise WrapConfigurationError(
                    f"with_wrapped_modules.wrap_module_classes: {class_name!r} is only the root "
                    "module's own class. The training engine wraps the root itself; list the "
                    "classes of submodules (e.g. the transformer block class)."
                )
            raise WrapConfigurationError(
                f"with_wrapped_modules.wrap_module_classes: no submodule of "
                f"{type(model).__name__} has class {class_name!r}. "
                f"Classes present: {sorted(present)}."
            )
        for name in names:
            if type(modules[name]).__name__ in classes:
                selected.setdefault(name, f"class {type(modules[name]).__name__}")

    if min_num_params is not None:
        if isinstance(min_num_params, bool) or not isinstance(min_num_params, int) or min_num_params < 1:
            raise WrapConfigurationError(
                f"with_wrapped_modules.min_num_params: must be a positive integer, got {min_num_params!r}."
            )
        for name in _smallest_modules_with(model, min_num_params, already=set(selected)):
            selected.setdefault(name, f"min_num_params {min_num_params}")

    return sorted(selected, key=lambda name: (-_depth(name), names.index(name)))


def _own_numel(module: nn.Module, claimed: Set[int]) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) not in claimed)


def _smallest_modules_with(model: nn.Module, min_num_params: int, already: Set[str]) -> List[str]:
    """
    Bottom-up, like PyTorch's size-based auto-wrap policy: a submodule is chosen when the
    parameters not yet claimed by a chosen descendant reach ``min_num_params``.
    """
    modules = dict(model.named_modules())
    claimed: Set[int] = set()
    for name in already:
        claimed.update(id(p) for p in modules[name].parameters())
    chosen: List[str] = []
    for name in sorted((n for n in modules if n), key=lambda n: -_depth(n)):
        if name in already:
            continue
        if _own_numel(modules[name], claimed) >= min_num_params:
            chosen.append(name)
            claimed.update(id(p) for p in modules[name].parameters())
    return chosen


def _outermost(names: Sequence[str]) -> List[str]:
    """Drop names nested inside another name of the list."""
    return [n for n in names if not any(n.startswith(other + ".") for other in names)]


def _disable_hf_kv_cache(model: nn.Module) -> None:
    """
    Hugging Face models keep a key/value cache object that each attention block appends to
    during forward. A checkpointed block runs its forward again in backward and would append
    to the same cache a second time, so the recomputed attention would see every key twice and
    produce wrong gradients. Like Hugging Face's own gradient checkpointing, turn the cache off
    (it is only useful for generation).
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False  # type: ignore[union-attr]
            logger.info(
                "Activation checkpointing: set %s.config.use_cache = False (a recomputed block would "
                "add to the key/value cache twice)",
                type(module).__name__,
            )


def _replace_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child_name = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent.add_module(child_name, new)


@dataclass(frozen=True)
class WrapPlan:
    """
    What :func:`with_wrapped_modules` does to a model, decided once from its options: the one
    wrap plan that the wrapper applies and that pre-flight, ``plan`` and the backends read.
    """

    selected: Tuple[str, ...]
    """Qualified names of the selected submodules, deepest first (the order they are wrapped in)."""

    checkpointed: FrozenSet[str]
    """The selected submodules whose activations are checkpointed: the outermost ones, when asked for."""

    fsdp: bool
    """Whether the selected submodules become FSDP units (an ``fsdp_config`` was given)."""

    @classmethod
    def build(
        cls,
        model: nn.Module,
        modules_to_wrap: Optional[Iterable[str]] = None,
        *,
        wrap_module_classes: Optional[Iterable[str]] = None,
        min_num_params: Optional[int] = None,
        activation_checkpointing: bool = False,
        fsdp: bool = True,
    ) -> "WrapPlan":
        """Select the submodules of ``model`` (see :func:`plan_wrapping`); ``model`` is not changed."""
        selected = plan_wrapping(
            model, modules_to_wrap, wrap_module_classes=wrap_module_classes, min_num_params=min_num_params
        )
        checkpointed = frozenset(_outermost(selected)) if activation_checkpointing else frozenset()
        return cls(selected=tuple(selected), checkpointed=checkpointed, fsdp=fsdp)

    @property
    def fsdp_units(self) -> Tuple[str, ...]:
        """The submodules that become FSDP units of their own (none without an ``fsdp_config``)."""
        return self.selected if self.fsdp else ()

    def unit_of(self, module_name: str) -> str:
        """The FSDP unit holding ``module_name``'s own parameters: the deepest around it, or root ``""``."""
        units = [
            unit for unit in self.fsdp_units if module_name == unit or module_name.startswith(unit + ".")
        ]
        return max(units, key=len, default="")

    def _units_of_parameters(self, model: nn.Module) -> Dict[int, Dict[str, str]]:
        """Each parameter (by id) -> its names, each with the unit that would hold it under that name."""
        found: Dict[int, Dict[str, str]] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            for name, parameter in module.named_parameters(recurse=False, remove_duplicate=False):
                path = f"{module_name}.{name}" if module_name else name
                found.setdefault(id(parameter), {})[path] = self.unit_of(module_name)
        return found

    def check_shared_parameters(self, model: nn.Module) -> None:
        """
        A parameter reached from two units (a tied embedding and output head, one module used in two
        places) would be sharded by each unit as its own copy: the copies train apart and the tie is
        silently broken. Refused, naming the parameter and the units.
        """
        for names in self._units_of_parameters(model).values():
            units = sorted(set(names.values()))
            if len(units) > 1:
                described = ", ".join(f"{path} in {_unit_name(names[path])}" for path in sorted(names))
                raise WrapConfigurationError(
                    f"with_wrapped_modules: a parameter shared by several modules would be split across FSDP "
                    f"units ({described}), which would untie it. Select a module that contains every use of "
                    "it as one unit, or leave the modules that share it out of modules_to_wrap (the root "
                    "unit then holds it once)."
                )

    def check_uniform_requires_grad(self, model: nn.Module, *, units: bool, root: bool) -> None:
        """
        FairScale's FSDP flattens each unit's parameters into one tensor, which is trainable or frozen
        as a whole: a unit (with ``units``; the root with ``root``) that holds both is refused, naming
        them, before FairScale fails with an assertion in every worker.
        """
        by_unit: Dict[str, List[Tuple[str, nn.Parameter]]] = {}
        for names in self._units_of_parameters(model).values():
            path, unit = min(names.items())
            by_unit.setdefault(unit, []).append((path, _parameter(model, path)))
        for unit, parameters in sorted(by_unit.items()):
            if root if unit == "" else units:
                refuse_mixed_requires_grad(unit, parameters)


@register_model_constructor(WRAPPER_TYPE)
def with_wrapped_modules(
    model: Model,
    modules_to_wrap: Optional[Set[str]] = None,
    fsdp_config: Optional[FSDPConfig] = None,
    activation_checkpointing: bool = False,
    *,
    wrap_module_classes: Optional[List[str]] = None,
    min_num_params: Optional[int] = None,
    offload_activations: bool = False,
) -> Model:
    """
    Wrap submodules of ``model`` in FSDP units and/or activation checkpointing, in place.

    .. tip::
        Registered as a :class:`~tango.integrations.torch.Model` constructor under the name
        "fairscale::with_wrapped_modules".

    Meant for the :class:`~tango_fairscale.FairScaleTrainingEngine`: each wrapped submodule
    becomes its own FSDP unit, so only one unit's full parameters are gathered at a time.

    Overlapping selections are handled deliberately: when a module and one of its descendants
    are both selected, both become FSDP units (the descendant nested inside the parent's unit),
    but only the outermost is checkpointed, since checkpointing inside a checkpointed module
    only recomputes the same forward twice.

    :param model: The model to wrap.
    :param modules_to_wrap:
        Regular expressions, each fully matched against the names from ``model.named_modules()``
        (e.g. ``"transformer\\\\.h\\\\.[0-9]+"``). Each must match at least one submodule.
    :param fsdp_config:
        The FSDP options of the wrapped units. If not given, submodules are not wrapped in FSDP
        (checkpointing only). FSDP wrapping happens only inside a process group (i.e. in the
        training workers); the model built in the main process for the final weights gets
        checkpointing only, and keeps the plain model's parameter names.
    :param activation_checkpointing:
        Recompute the wrapped submodules' activations in the backward pass instead of storing
        them (FairScale's :func:`~fairscale.nn.checkpoint.checkpoint_wrapper`). For Hugging
        Face models this also sets ``config.use_cache = False``, as their own gradient
        checkpointing does: a recomputed block would otherwise add to the key/value cache twice.
    :param wrap_module_classes:
        Also select every submodule whose class name is listed (e.g. ``["GPT2Block"]``),
        the transformer-layer policy.
    :param min_num_params:
        Also select, bottom-up, each smallest submodule holding at least this many parameters
        that are not in an already selected submodule.
    :param offload_activations:
        With ``activation_checkpointing``, also move the checkpointed blocks' inputs to CPU
        memory until backward. Saves GPU memory, costs transfers; no effect on CPU workers.
    """
    if not modules_to_wrap and not wrap_module_classes and min_num_params is None:
        raise WrapConfigurationError(
            "with_wrapped_modules: nothing to wrap. Give modules_to_wrap (regexes), "
            "wrap_module_classes (class names) or min_num_params."
        )
    if offload_activations and not activation_checkpointing:
        raise WrapConfigurationError(
            "with_wrapped_modules.offload_activations: true needs activation_checkpointing: true."
        )
    require_parameters(model, "with_wrapped_modules: the model")

    plan = WrapPlan.build(
        model,
        modules_to_wrap,
        wrap_module_classes=wrap_module_classes,
        min_num_params=min_num_params,
        activation_checkpointing=activation_checkpointing,
        fsdp=fsdp_config is not None,
    )
    if plan.fsdp:
        plan.check_shared_parameters(model)
    if getattr(_deferral, "active", False):
        if plan.checkpointed:
            _disable_hf_kv_cache(model)
        # Not a submodule or parameter: plain attribute, invisible to state dicts.
        object.__setattr__(model, _RECORDED_PLAN, (plan, fsdp_config))
        return model
    # The model Tango builds in the main process for the final weights has no process group:
    # it gets checkpointing only, and keeps the plain model's parameter names.
    use_fsdp = plan.fsdp and dist.is_available() and dist.is_initialized()
    if use_fsdp:
        assert fsdp_config is not None
        plan.check_uniform_requires_grad(model, units=fsdp_config.flatten_parameters, root=False)
    selected, to_checkpoint = plan.selected, plan.checkpointed
    if to_checkpoint:
        _disable_hf_kv_cache(model)

    # FairScale expects offloaded parameters to start on the CPU.
    offload = fsdp_config is not None and fsdp_config.move_params_to_cpu
    device = torch.device("cpu") if offload or not use_fsdp else worker_device()
    # Deepest first, so that a parent is wrapped after (and around) its wrapped children.
    # Parameters built on meta (the engine's init_on_meta) are allocated one unit at a time,
    # right before the unit is sharded.
    with real_parameters():
        for name in selected:
            module = model.get_submodule(name)
            if use_fsdp and has_meta_parameters(module):
                assert fsdp_config is not None
                materialize_module(module, device, root=model, one_allocation=fsdp_config.flatten_parameters)
            if name in to_checkpoint:
                module = checkpoint_wrapper(module, offload_to_cpu=offload_activations)
            if use_fsdp:
                assert fsdp_config is not None
                module = fsdp_config.wrap(module)
            _replace_submodule(model, name, module)

    logger.debug(
        "Wrapped %d submodule(s)%s%s",
        len(selected),
        " in FSDP" if use_fsdp else "",
        f", {len(to_checkpoint)} checkpointed" if to_checkpoint else "",
    )
    return model
