"""
The peak of a micro-batch's forward and backward, measured on fake tensors (shapes and dtypes, no
storage: PyTorch's ``FakeTensorMode``) under :class:`~.live_bytes.LiveTensorBytes`, with what
FSDP holds besides added by hooks on the units (:class:`_FsdpTimeline`), each amount as the
engine's backend holds it (its :class:`~tango_fairscale.backends.base.MemoryModel`). It costs no
memory at any size.
"""

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError
from torch.utils._pytree import tree_flatten, tree_map_only

from ..backends.base import GATHERED_GRADIENTS, GRADIENTS
from ..config import FSDPConfig
from ..engine import name_causal_lm_loss
from ..options import EngineOptions
from ..options import amp_dtype as autocast_dtype
from ..wrapping import WrapPlan, disable_hf_kv_cache
from .batch import BatchSpec
from .estimate import Activations, Plan, StepPeak, Unit
from .live_bytes import LiveTensorBytes
from .model import build_model
from .text import one_line


class _FsdpTimeline:
    """
    What FSDP holds during a micro-batch besides the step's own tensors, added to a
    :class:`LiveTensorBytes` by hooks on the model's FSDP units, at the moments FSDP holds it, each
    amount as the backend's memory model (:attr:`Plan.memory`) says:

    - a unit's gathered parameters, from its forward's start to its end (to the end of backward
      for the root, and for a unit that does not reshard after forward), and again from its
      backward's start (a gradient reaching its outputs) to its end;
    - its parameters' gradients, kept until every one of the unit's has come, when they are
      joined into the unit's whole gradient for a moment, before it is reduced to a shard that
      stays; and what the backend's reduce-scatters hold besides (FairScale's bucket).

    Unsharded (DDP, one worker) the gradients stay whole, and DDP's buckets hold a copy of them.
    """

    def __init__(self, plan: Plan, model: nn.Module, tracker: LiveTensorBytes) -> None:
        self.plan = plan
        self.tracker = tracker
        self.units = plan.units
        self.gathered: Set[str] = set()
        self.done: Set[str] = set()
        self.in_backward = False
        # Later micro-batches add their gradients into the shards the first one made.
        self.accumulating = plan.batch is not None and plan.batch.grad_accum > 1
        # Sharded across workers: what the backend holds; unsharded, nothing is gathered or reduced.
        self.memory = plan.memory if plan.fsdp_sharded else None
        self.reduce_scatter = (
            self.memory.reduce_scatter(tracker, self.accumulating) if self.memory is not None else None
        )
        # Each unit's parameters whose gradient of this backward has come, with its bytes.
        self.grads: Dict[str, List[Tuple[nn.Parameter, int]]] = {unit.name: [] for unit in self.units}
        self.pending: Dict[str, int] = {}
        # The last micro-batch of several adds its gradients in place to those already there.
        self.in_place = (
            plan.batch is not None
            and plan.batch.grad_accum > 1
            and (plan.accumulates_unsharded or not plan.fsdp_sharded)
        )
        owner: Dict[int, str] = {}
        for unit in sorted(self.units, key=lambda u: -u.name.count(".") if u.name else 1):
            module = model.get_submodule(unit.name) if unit.name else model
            for parameter in module.parameters():
                owner.setdefault(id(parameter), unit.name)
        self.owned: Dict[str, List[nn.Parameter]] = {unit.name: [] for unit in self.units}
        seen: Set[int] = set()
        for parameter in model.parameters():
            if id(parameter) not in seen:
                seen.add(id(parameter))
                self.owned[owner[id(parameter)]].append(parameter)
        for parameter in model.parameters():
            if parameter.requires_grad:
                name = owner[id(parameter)]
                parameter.register_post_accumulate_grad_hook(lambda p, name=name: self._gradient(name, p))
        if plan.fsdp_sharded:
            for unit in self.units:
                module = model.get_submodule(unit.name) if unit.name else model
                module.register_forward_pre_hook(
                    lambda _m, args, kwargs, unit=unit: self._forward_start(unit, args, kwargs),
                    with_kwargs=True,
                )
                module.register_forward_hook(lambda _m, _a, out, unit=unit: self._forward_done(unit, out))

    def start(self) -> None:
        """A micro-batch begins, with what earlier micro-batches left (and, under DDP, its buckets)."""
        plan = self.plan
        self.pending = {
            unit.name: sum(1 for p in self.owned[unit.name] if p.requires_grad) for unit in self.units
        }
        if plan.batch is not None and plan.batch.grad_accum > 1:
            # The last micro-batch of a step: the earlier ones' gradients are there, added to in place.
            if plan.accumulates_unsharded or not plan.fsdp_sharded:
                self.tracker.hold(
                    GRADIENTS, sum(u.trainable_numel * u.compute_element_size for u in self.units)
                )
            else:
                self.tracker.hold(GRADIENTS, plan.gradient_bytes())
        if not plan.fsdp_sharded and plan.world_size > 1:
            # DDP copies each gradient into its buckets, allocated with the model.
            self.tracker.hold(GATHERED_GRADIENTS, plan.trainable_numel * plan.element_size)

    def finish(self) -> None:
        """The end of backward: every unit's gradients reduced, the reduce-scatters done, the units freed."""
        for unit in self.units:
            if unit.name not in self.done:
                self._reduce(unit)
        if self.reduce_scatter is not None:
            self.reduce_scatter.finish()
        for unit in self.units:
            if unit.name in self.gathered:
                self._release(unit)

    def _gather(self, unit: Unit) -> None:
        if unit.name not in self.gathered and unit.name not in self.done and self.memory is not None:
            self.gathered.add(unit.name)
            self.tracker.hold("gathered_parameters", self.memory.gathered_bytes(unit))

    def _release(self, unit: Unit) -> None:
        if unit.name in self.gathered and self.memory is not None:
            self.gathered.discard(unit.name)
            self.tracker.hold("gathered_parameters", -self.memory.gathered_bytes(unit))

    def _forward_start(self, unit: Unit, args: Any, kwargs: Any) -> None:
        self._gather(unit)
        if unit.trainable_numel == 0 and unit.name:
            # A frozen unit is released once the gradients of its inputs are made (F7).
            inputs = [
                t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if inputs and torch.is_grad_enabled():
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, lambda _grads, unit=unit: self._reduce(unit)
                )

    def _forward_done(self, unit: Unit, outputs: Any) -> None:
        if unit.reshard_after_forward and unit.name and not self.in_backward:
            self._release(unit)
        for tensor in tree_flatten(outputs)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, unit=unit: self._gather(unit))

    def _gradient(self, name: str, parameter: nn.Parameter) -> None:
        """A parameter's gradient of this backward has come (its AccumulateGrad ran)."""
        unit = next(u for u in self.units if u.name == name)
        if self.in_place:
            # Added in place to the whole gradient kept from the earlier micro-batches.
            parameter.grad = None
        elif parameter.grad is not None:
            size = parameter.grad.untyped_storage().nbytes()
            self.grads[name].append((parameter, size))
            self.tracker.excluded += size
        self.pending[name] -= 1
        if self.pending[name] == 0 and self.plan.fsdp_sharded:
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        """The unit's gradients joined into one and reduced to a shard; its gathered parameters freed."""
        memory, reduce_scatter = self.memory, self.reduce_scatter
        if unit.name in self.done or memory is None or reduce_scatter is None:
            return
        self.done.add(unit.name)
        if unit.trainable_numel == 0:
            self._release(unit)
            return
        pieces = self.grads[unit.name]
        joined = sum(size for _, size in pieces)
        if self.plan.accumulates_unsharded:
            self._release(unit)
            return
        if joined:
            joined = memory.reducing_bytes(unit, joined)
            self.tracker.hold(GATHERED_GRADIENTS, joined)
            reduce_scatter.gradient_joined(unit)
            self.tracker.hold(GATHERED_GRADIENTS, -joined)
        for parameter, size in pieces:
            self.tracker.excluded -= size
            parameter.grad = None
        self.grads[unit.name] = []
        self._release(unit)
        reduce_scatter.gradient_reduced(unit)


def measure_activations(
    plan: Plan,
    model_config: Dict[str, Any],
    wrap_plan: Optional[WrapPlan],
    options: EngineOptions,
    engine_fsdp: FSDPConfig,
    unit_fsdp: FSDPConfig,
) -> Activations:
    """The step's peak with the config's activation checkpointing and with the other setting."""
    checkpointed = set(wrap_plan.checkpointed) if wrap_plan else set()
    batch = plan.batch
    if batch is None:
        return Activations(configured=None, checkpointing=bool(checkpointed), note=plan.batch_note)
    # What activation_checkpointing: true would checkpoint: the outermost wrapped modules.
    selected = wrap_plan.selected if wrap_plan else ()
    outermost = {n for n in selected if not any(n.startswith(o + ".") for o in selected)}
    dtypes: Dict[str, torch.dtype] = {}
    on_cpu = plan.device == "cpu"
    if plan.sharded:
        if engine_fsdp.mixed_precision:
            dtypes[""] = engine_fsdp.resolved_compute_dtype(on_cpu)
        if unit_fsdp.mixed_precision:
            dtypes.update({unit.name: unit_fsdp.resolved_compute_dtype(on_cpu) for unit in plan.units[1:]})
    # The engine's amp: its forward under autocast, in the dtype the engine picks.
    autocast = autocast_dtype(on_cpu, options.amp_use_bfloat16) if options.amp else None

    def measure(names: Set[str]) -> Tuple[Optional[StepPeak], str]:
        try:
            return measure_step(plan, model_config, batch, names, dtypes, autocast), ""
        except ConfigurationError:
            raise
        except Exception as error:  # noqa: BLE001 - the model's forward on fake tensors: reported, not guessed
            return None, f"not measured: the forward and backward on fake tensors raised {one_line(error)}"

    configured, note = measure(checkpointed)
    other: Optional[StepPeak] = None
    if configured is not None and (checkpointed or outermost):
        other, _ = measure(set() if checkpointed else outermost)
    return Activations(configured=configured, alternative=other, checkpointing=bool(checkpointed), note=note)


def _cast_floats(dtype: torch.dtype) -> Callable[..., Any]:
    """A forward pre-hook casting floating-point inputs to ``dtype``, as a mixed-precision FSDP unit does."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
        return tree_map_only(torch.Tensor, cast, args), tree_map_only(torch.Tensor, cast, kwargs)

    return hook


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint

    def run(*args: Any, **kwargs: Any) -> Any:
        # Fake tensors have no random state to keep; the recomputation's memory is the same.
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return run


def measure_step(
    plan: Plan,
    model_config: Dict[str, Any],
    batch: BatchSpec,
    checkpointed: Iterable[str] = (),
    dtypes: Optional[Mapping[str, torch.dtype]] = None,
    amp_dtype: Optional[torch.dtype] = None,
) -> StepPeak:
    """
    The peak of one micro-batch's forward and backward on fake tensors (no memory is used, at any
    size), with what FSDP holds at each moment (:class:`_FsdpTimeline`). ``checkpointed``
    modules recompute their activations in backward (PyTorch's non-reentrant checkpoint, which
    keeps what FairScale's keeps: the module's inputs); ``dtypes`` casts each named module
    (``""``: the whole model) and its floating-point inputs, as a mixed-precision unit computes;
    ``amp_dtype`` runs the forward under CPU autocast, as the engine's ``amp`` does.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, _ = build_model(model_config, plan.init_on_meta)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    casts = dtypes or {}
    # Cast on meta (a model built on the CPU gives its memory back first), then made fake.
    if any(not t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device="meta")
    for name in sorted(casts, key=lambda n: (n != "", n.count("."))):
        module = model.get_submodule(name) if name else model
        module.to(casts[name])
        module.register_forward_pre_hook(_cast_floats(casts[name]), with_kwargs=True)
    with fake:
        model.to_empty(device="cpu")
        inputs: Dict[str, Any] = {
            key: torch.zeros(shape, dtype=dtype) for key, (shape, dtype) in batch.tensors.items()
        }
    inputs.update(batch.others)
    name_causal_lm_loss(model)  # as the engine does: the loss is the same, without its warning
    names = list(checkpointed)
    if names:
        disable_hf_kv_cache(model)
    for name in names:
        module = model.get_submodule(name)
        module.forward = _checkpointed(module.forward)  # type: ignore[method-assign]
    known = [
        *model.parameters(),
        *model.buffers(),
        *(v for v in inputs.values() if isinstance(v, torch.Tensor)),
    ]
    tracker = LiveTensorBytes(known)
    timeline = _FsdpTimeline(plan, model, tracker)
    model.train()
    with fake, tracker:
        timeline.start()
        with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            outputs = model(**inputs)
            loss = outputs["loss"] / batch.grad_accum
        timeline.in_backward = True
        loss.backward()
        timeline.finish()
    at_peak = tracker.at_peak
    # Parameters' gradients not yet reduced: a unit's whole gradient in the making, or (unsharded)
    # the gradients themselves.
    pieces = at_peak.get("excluded", 0)
    sharded = plan.fsdp_sharded
    return StepPeak(
        activations=at_peak.get("tensors", 0) - pieces + batch.input_bytes,
        gathered_parameters=at_peak.get("gathered_parameters", 0),
        gathered_gradients=at_peak.get("gathered_gradients", 0) + (pieces if sharded else 0),
        gradients=at_peak.get("gradients", 0) + (0 if sharded else pieces),
        activations_alone=tracker.peak_alone + batch.input_bytes,
    )
