"""
The wrap plan of a ``torch::train`` step, without training: which submodules become FSDP
units, how big each is, which are checkpointed, and the model state each worker will hold
compared with DDP. Used by ``python -m tango_fairscale plan``.
"""

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

import torch
import torch.nn as nn
from tango.common import Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import Model, Optimizer, TrainingEngine

from .config import FSDPConfig, parse_dtype
from .engine import FairScaleTrainingEngine
from .materialize import check_initialisable, parameters_on_meta
from .wrapping import WRAPPER_TYPE, WrapPlan

#: Per-element optimizer state tensors kept by common optimizers (beyond the parameter itself).
_STATES_PER_PARAMETER = {
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adagrad": 1,
    "Adadelta": 2,
    "ASGD": 2,
    "Rprop": 2,
}


@dataclass
class Unit:
    """One FSDP unit of the plan."""

    name: str
    """Qualified name of the wrapped module (``""`` for the root)."""
    class_name: str
    numel: int
    """Parameters owned by this unit (not by units nested in it)."""
    shard_numel: int
    """Elements of this unit's flat parameter on each worker (padded to a multiple of the world size)."""
    checkpointed: bool
    children: List["Unit"] = field(default_factory=list)


@dataclass
class Plan:
    """The whole plan and its per-worker byte estimates."""

    step: str
    model_class: str
    world_size: int
    optimizer: str
    states_per_parameter: int
    root: Unit
    element_size: int
    compute_element_size: int
    built_on: str
    #: The step's training engine; with one that does not shard (Tango's DDP ``"torch"``), every
    #: worker holds every unit whole.
    engine: str = "fairscale"
    sharded: bool = True

    @property
    def units(self) -> List[Unit]:
        found: List[Unit] = []

        def visit(unit: Unit) -> None:
            found.append(unit)
            for child in unit.children:
                visit(child)

        visit(self.root)
        return found

    @property
    def total_numel(self) -> int:
        return sum(unit.numel for unit in self.units)

    def bytes_per_worker(self) -> Dict[str, int]:
        shard = sum(unit.shard_numel for unit in self.units) * self.element_size
        return {"parameters": shard, "gradients": shard, "optimizer_state": shard * self.states_per_parameter}

    def ddp_bytes_per_worker(self) -> Dict[str, int]:
        full = self.total_numel * self.element_size
        return {"parameters": full, "gradients": full, "optimizer_state": full * self.states_per_parameter}

    @property
    def largest_unit(self) -> Unit:
        return max(self.units, key=lambda unit: unit.numel)

    def as_dict(self) -> Dict[str, Any]:
        fsdp, ddp = self.bytes_per_worker(), self.ddp_bytes_per_worker()
        return {
            "step": self.step,
            "model": self.model_class,
            "world_size": self.world_size,
            "optimizer": self.optimizer,
            "parameters": self.total_numel,
            "units": [
                {
                    "name": unit.name,
                    "class": unit.class_name,
                    "parameters": unit.numel,
                    "shard_parameters": unit.shard_numel,
                    "checkpointed": unit.checkpointed,
                }
                for unit in self.units
            ],
            "bytes_per_worker": {**fsdp, "total": sum(fsdp.values())},
            "ddp_bytes_per_worker": {**ddp, "total": sum(ddp.values())},
            "largest_unit_gathered_bytes": self.largest_unit.numel * self.compute_element_size,
        }


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{size} B"


def render(plan: Plan) -> str:
    """The plan as a text tree and a table, for people."""
    lines = [
        f'Wrap plan of step "{plan.step}": {plan.model_class}, {plan.total_numel:,} parameters, '
        f"world size {plan.world_size}, optimizer {plan.optimizer} "
        f"({plan.states_per_parameter} state tensor(s) per parameter); built on {plan.built_on}",
        "",
        f"{'FSDP unit':<52} {'parameters':>14} {'per worker':>14}  checkpointed",
    ]
    if not plan.sharded:
        lines[1:1] = [
            f'The training engine "{plan.engine}" does not shard: every worker holds the whole model '
            '(use the "fairscale" engine to shard it).'
        ]

    def visit(unit: Unit, prefix: str, last: bool, depth: int) -> None:
        branch = "" if depth == 0 else ("└── " if last else "├── ")
        label = f"{prefix}{branch}{unit.name or '<root>'} ({unit.class_name})"
        lines.append(
            f"{label:<52} {unit.numel:>14,} {unit.shard_numel:>14,}  {'yes' if unit.checkpointed else ''}"
        )
        child_prefix = prefix + ("" if depth == 0 else ("    " if last else "│   "))
        for index, child in enumerate(unit.children):
            visit(child, child_prefix, index == len(unit.children) - 1, depth + 1)

    visit(plan.root, "", True, 0)
    fsdp, ddp = plan.bytes_per_worker(), plan.ddp_bytes_per_worker()
    lines += ["", f"{'model state per worker':<24} {'this config':>14} {'DDP':>14} {'ratio':>8}"]
    for key in ("parameters", "gradients", "optimizer_state"):
        ratio = fsdp[key] / ddp[key] if ddp[key] else 0.0
        lines.append(
            f"{key.replace('_', ' '):<24} {_human(fsdp[key]):>14} {_human(ddp[key]):>14} {ratio:>8.3f}"
        )
    total, ddp_total = sum(fsdp.values()), sum(ddp.values())
    lines.append(f"{'total':<24} {_human(total):>14} {_human(ddp_total):>14} {total / ddp_total:>8.3f}")
    largest = plan.largest_unit
    lines.append(
        f"plus, while a unit runs, its full parameters: largest is {largest.name or '<root>'} "
        f"({_human(largest.numel * plan.compute_element_size)})"
    )
    return "\n".join(lines)


def _states_per_parameter(optimizer: Dict[str, Any]) -> int:
    type_name = optimizer.get("type", "")
    try:
        optimizer_class = Optimizer.resolve_class_name(type_name)[0]
        class_name = optimizer_class.__name__
    except Exception:  # noqa: BLE001 - unknown optimizers get Adam's count
        class_name = type_name
    if class_name == "SGD":
        return 1 if optimizer.get("momentum", 0) else 0
    if class_name == "RMSprop":
        return 1 + bool(optimizer.get("momentum", 0)) + bool(optimizer.get("centered", False))
    return _STATES_PER_PARAMETER.get(class_name, 2)


def _build(model_params: Dict[str, Any]) -> "tuple[nn.Module, str]":
    # Each attempt gets its own copy: from_params pops what it reads, nested dicts included.
    try:
        # As init_on_meta builds: a pretrained model (fairscale::from_pretrained, or transformers'
        # from_pretrained, which refuses a meta device otherwise) from its config, no tensor read.
        with torch.device("meta"), parameters_on_meta():
            return Model.from_params(Params(copy.deepcopy(model_params))), "the meta device (no memory)"
    except ConfigurationError:
        raise
    except Exception:  # noqa: BLE001 - some models cannot be built on meta; CPU always works
        pass
    try:
        return Model.from_params(Params(copy.deepcopy(model_params))), "the CPU"
    except ConfigurationError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's constructor: its error, on one line
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        name = model_params.get("type", "the model")
        raise ConfigurationError(f"model: building {name!r} raised {type(error).__name__}: {first}") from None


def make_plan(step_name: str, step: Dict[str, Any], world_size: Optional[int] = None) -> Plan:
    """The plan of one ``torch::train`` step config (as a dict)."""
    model_config = dict(step["model"])
    wrapper: Dict[str, Any] = {}
    if model_config.get("type") == WRAPPER_TYPE:
        wrapper = model_config
        model_config = dict(wrapper["model"])
    model, built_on = _build(model_config)
    engine = dict(step.get("training_engine", {}))
    if engine.get("init_on_meta"):
        with parameters_on_meta():
            check_initialisable(Model.from_params(Params(dict(model_config))))

    wrap_plan = (
        WrapPlan.build(
            model,
            wrapper.get("modules_to_wrap"),
            wrap_module_classes=wrapper.get("wrap_module_classes"),
            min_num_params=wrapper.get("min_num_params"),
            activation_checkpointing=bool(wrapper.get("activation_checkpointing")),
            fsdp=wrapper.get("fsdp_config") is not None,
        )
        if wrapper
        else None
    )
    if wrap_plan is not None and wrap_plan.fsdp:
        # The refusal `tango run` makes (a tie split across units), made here too: a plan is
        # only drawn for a config that trains.
        wrap_plan.check_shared_parameters(model)
    selected = list(wrap_plan.fsdp_units) if wrap_plan else []
    checkpointed: Set[str] = set(wrap_plan.checkpointed) if wrap_plan else set()

    world_size = world_size or int(step.get("device_count", 1))
    if world_size < 1:
        raise ConfigurationError(f"--world-size must be at least 1, got {world_size}")
    engine_type = str(engine.get("type", "torch"))
    sharded = _shards(engine_type)
    engine_fsdp = FSDPConfig.from_params(Params(dict(engine.get("fsdp_config") or {})))
    compute_dtype = parse_dtype("compute_dtype", engine_fsdp.compute_dtype) or (
        torch.float16 if engine_fsdp.mixed_precision else None
    )
    parameters = list(model.parameters())
    element_size = parameters[0].element_size() if parameters else 4

    # Deepest first: each unit owns the parameters not already owned by a unit nested in it.
    claimed: Set[int] = set()
    units: Dict[str, Unit] = {}
    for name in selected + [""]:
        module = model.get_submodule(name) if name else model
        own = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        numel = sum(p.numel() for p in own)
        units[name] = Unit(
            name=name,
            class_name=type(module).__name__,
            numel=numel,
            shard_numel=math.ceil(numel / world_size) if sharded else numel,
            checkpointed=name in checkpointed,
        )
    # Nest each unit under its closest wrapped ancestor, children in module order.
    module_order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    for name in sorted(selected, key=lambda n: (n.count("."), n)):
        parent = max((other for other in selected if name.startswith(other + ".")), key=len, default="")
        units[parent].children.append(units[name])
    for unit in units.values():
        unit.children.sort(key=lambda child: module_order[child.name])

    optimizer = dict(engine.get("optimizer", {}))
    return Plan(
        step=step_name,
        model_class=type(model).__name__,
        world_size=world_size,
        optimizer=str(optimizer.get("type", "?")),
        states_per_parameter=_states_per_parameter(optimizer),
        root=units[""],
        element_size=element_size,
        compute_element_size=torch.empty((), dtype=compute_dtype).element_size()
        if compute_dtype
        else element_size,
        built_on=built_on,
        engine=engine_type,
        sharded=sharded,
    )


def _shards(engine_type: str) -> bool:
    """Whether the engine registered as ``engine_type`` shards the model (this package's engine does)."""
    try:
        engine_class = TrainingEngine.resolve_class_name(engine_type)[0]
    except Exception:  # noqa: BLE001 - an unknown name is Tango's error to report when the step runs
        return True
    return isinstance(engine_class, type) and issubclass(engine_class, FairScaleTrainingEngine)
