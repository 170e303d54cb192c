"""
:func:`make_plan`: a ``torch::train`` step's config read as the run reads it (the engine's options
through :class:`~tango_fairscale.options.EngineOptions`), its model built without memory, its FSDP
units, the backend's memory model, the batch, the optimizer's footprint, and the step's peak measured.
"""

import copy
from typing import Any, Dict, Mapping, Optional, Set

import torch
from tango.common import Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import Model, TrainingEngine

from ..backends.base import MemoryModel
from ..backends.lookup import backend_class
from ..config import FSDPConfig
from ..engine import FairScaleTrainingEngine
from ..finetune.pretrained import shapes_only
from ..materialize import check_initialisable, parameters_on_meta
from ..options import EngineOptions, check_backend
from ..precision import dtype_name
from .batch import batch_spec
from .estimate import Plan, Unit
from .measure import measure_activations
from .model import build_model, inner_model_config, wrap_plan_of
from .optimizer import OptimizerFootprint, optimizer_footprint


def make_plan(
    step_name: str,
    step: Dict[str, Any],
    world_size: Optional[int] = None,
    *,
    steps: Optional[Mapping[str, Any]] = None,
    sequence_length: Optional[int] = None,
    sample_data: bool = False,
    device_memory: Optional[int] = None,
    optimizer_states: Optional[float] = None,
    device: Optional[str] = None,
    measure: bool = True,
) -> Plan:
    """
    The plan of one ``torch::train`` step config (as a dict). ``steps`` (the config's steps) lets it
    find the data step for the batch's shape; ``sequence_length`` gives a language model's tokens
    per example; ``sample_data`` runs the data step for the shape of a real batch;
    ``device_memory`` is judged against; ``optimizer_states`` (state tensors per parameter, in the
    parameters' dtype) stands in for an optimizer whose state cannot be measured; ``device``
    (``"cpu"`` or ``"cuda"``, default: ``"cuda"`` where this process sees a GPU) is the workers';
    without ``measure`` the step's peak is not measured. A pretrained directory of a ``config.json``
    alone is planned as one with its weights (:func:`~tango_fairscale.finetune.pretrained.shapes_only`).
    """
    with shapes_only() as from_config_only:
        plan = _make_plan(
            step_name,
            step,
            world_size,
            steps=steps,
            sequence_length=sequence_length,
            sample_data=sample_data,
            device_memory=device_memory,
            optimizer_states=optimizer_states,
            device=device,
            measure=measure,
        )
    plan.from_config_only = [str(directory) for directory in from_config_only]
    return plan


def _make_plan(
    step_name: str,
    step: Dict[str, Any],
    world_size: Optional[int],
    *,
    steps: Optional[Mapping[str, Any]],
    sequence_length: Optional[int],
    sample_data: bool,
    device_memory: Optional[int],
    optimizer_states: Optional[float],
    device: Optional[str],
    measure: bool,
) -> Plan:
    model_config, wrapper = inner_model_config(step)
    engine = dict(step.get("training_engine", {}))
    # The engine's options as the engine reads them, its defaults included.
    options = EngineOptions.from_config(engine)
    init_on_meta = bool(options.init_on_meta)
    model, built_on = build_model(model_config, init_on_meta)
    if init_on_meta:
        with parameters_on_meta():
            check_initialisable(Model.from_params(Params(copy.deepcopy(model_config))))

    wrap_plan = wrap_plan_of(model, wrapper)
    if wrap_plan is not None and wrap_plan.fsdp:
        # The refusal `tango run` makes (a tie split across units), made here too: a plan is
        # only drawn for a config that trains.
        wrap_plan.check_shared_parameters(model)
    selected = list(wrap_plan.fsdp_units) if wrap_plan else []
    checkpointed: Set[str] = set(wrap_plan.checkpointed) if wrap_plan else set()

    world_size = world_size or int(step.get("device_count", 1))
    if world_size < 1:
        raise ConfigurationError(f"--world-size must be at least 1, got {world_size}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigurationError(f"--device must be cpu or cuda, got {device!r}")
    engine_type = str(engine.get("type", "torch"))  # torch::train's default: Tango's DDP engine
    sharded = _shards(engine_type)
    engine_fsdp = options.fsdp_config or FSDPConfig()
    unit_fsdp = FSDPConfig.from_params(Params(dict(wrapper.get("fsdp_config") or {})))
    parameters = list(model.parameters())
    built_dtype = parameters[0].dtype if parameters else torch.float32
    # What the workers hold: the engine's master dtype (a bfloat16 checkpoint is upcast), DDP's as built.
    held_dtype = options.precision.held_dtype(built_dtype) if sharded else built_dtype
    element_size = held_dtype.itemsize

    def compute_dtype(config: FSDPConfig) -> torch.dtype:
        if not sharded or not config.mixed_precision:
            return held_dtype
        return config.resolved_compute_dtype(on_cpu=device == "cpu")

    def compute_size(config: FSDPConfig) -> int:
        return compute_dtype(config).itemsize

    # Deepest first: each unit owns the parameters not already owned by a unit nested in it.
    claimed: Set[int] = set()
    units: Dict[str, Unit] = {}
    for name in selected + [""]:
        module = model.get_submodule(name) if name else model
        own = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        numel = sum(p.numel() for p in own)
        trainable = sum(p.numel() for p in own if p.requires_grad)
        config = engine_fsdp if name == "" else unit_fsdp
        unit = Unit(
            name=name,
            class_name=type(module).__name__,
            numel=numel,
            shard_numel=0,
            checkpointed=name in checkpointed,
            trainable_numel=trainable,
            compute_element_size=compute_size(config),
            # The root's backward comes right after its forward (disable_reshard_on_root).
            reshard_after_forward=config.reshard_after_forward
            and not (name == "" and config.disable_reshard_on_root),
        )
        # Frozen and trainable parameters are flat parameters of their own, each padded (F7).
        unit.shard_numel = sum(unit.shards(world_size if sharded else 1))
        units[name] = unit
    # Nest each unit under its closest wrapped ancestor, children in module order.
    module_order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    for name in sorted(selected, key=lambda n: (n.count("."), n)):
        parent = max((other for other in selected if name.startswith(other + ".")), key=len, default="")
        units[parent].children.append(units[name])
    for unit in units.values():
        unit.children.sort(key=lambda child: module_order[child.name])

    memory: Optional[MemoryModel] = None
    if sharded:
        # What the engine's backend holds of the step, as the backend itself says.
        check_backend(options.backend, None)
        memory = backend_class(options.backend).memory_model(
            engine_fsdp, list(units.values()), world_size, element_size
        )
    optimizer = dict(engine.get("optimizer", {}))
    footprint = optimizer_footprint(optimizer, memory is not None and memory.flat)
    if optimizer_states is not None:
        footprint = OptimizerFootprint(
            optimizer_states * element_size, footprint.step_bytes, footprint.all_at_once
        )
    grad_accum = int(step.get("grad_accum", 1))
    plan = Plan(
        step=step_name,
        model_class=type(model).__name__,
        world_size=world_size,
        optimizer=str(optimizer.get("type", "?")),
        optimizer_state_bytes=footprint.state_bytes,
        optimizer_note=footprint.note if optimizer_states is None else "",
        optimizer_step_bytes=footprint.step_bytes,
        optimizer_step_all_at_once=footprint.all_at_once or (device == "cuda" and footprint.foreach_default),
        root=units[""],
        element_size=element_size,
        compute_element_size=units[""].compute_element_size,
        built_on=built_on,
        engine=engine_type,
        memory=memory,
        backend=options.backend,
        init_on_meta=init_on_meta,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        largest_parameter_numel=max((p.numel() for p in parameters if p.requires_grad), default=0),
        accumulates_unsharded=sharded and bool(options.accumulate_grads_locally) and grad_accum > 1,
        device=device,
        device_memory=device_memory,
        built_dtype=dtype_name(built_dtype),
        parameter_dtype=dtype_name(held_dtype),
        compute_dtype=dtype_name(compute_dtype(engine_fsdp)),
    )
    plan.batch, plan.batch_note = batch_spec(step, steps or {}, model, sequence_length, sample_data)
    if measure:
        plan.activations = measure_activations(plan, model_config, wrap_plan, options, engine_fsdp, unit_fsdp)
    return plan


def _shards(engine_type: str) -> bool:
    """Whether the engine registered as ``engine_type`` shards the model (this package's engine does)."""
    try:
        engine_class = TrainingEngine.resolve_class_name(engine_type)[0]
    except Exception:  # noqa: BLE001 - an unknown name is Tango's error to report when the step runs
        return True
    return isinstance(engine_class, type) and issubclass(engine_class, FairScaleTrainingEngine)
