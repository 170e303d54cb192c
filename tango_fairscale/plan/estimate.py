"""
The plan's estimates: the FSDP units (:class:`Unit`), the model state each worker holds beside
DDP's, and the peak of one worker in a training step (:meth:`Plan.peak_components`), from the
measured peak of a micro-batch (:class:`StepPeak`) and what the backend holds
(:class:`~tango_fairscale.backends.base.MemoryModel`).
"""

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from ..backends.base import MemoryModel
from ..backends.lookup import DEFAULT_BACKEND
from .batch import BatchSpec
from .model import BUILT_ON
from .text import human

#: The parts of a worker's peak, in the order they are shown, with their labels.
PEAK_PARTS = {
    "parameters": "parameters",
    "buffers": "buffers (whole)",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "optimizer_step": "optimizer step's temporaries",
    "gathered_parameters": "gathered units",
    "gathered_gradients": "units' whole gradients",
    "activations": "activations",
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
    """Elements of this unit's flat parameters on each worker (each padded to the world size)."""
    checkpointed: bool
    children: List["Unit"] = field(default_factory=list)
    trainable_numel: int = 0
    """Of :attr:`numel`, the parameters that train: only they get gradients and optimizer state."""
    compute_element_size: int = 4
    """Bytes per element of this unit's gathered parameters (its compute dtype)."""
    reshard_after_forward: bool = True
    """Whether its gathered parameters are freed after its forward (and gathered again for backward)."""

    def shards(self, world_size: int) -> Tuple[int, int]:
        """Elements of its trainable and of its frozen flat parameter on each of ``world_size`` workers."""
        return shard_of(self.trainable_numel, world_size), shard_of(
            self.numel - self.trainable_numel, world_size
        )


@dataclass
class StepPeak:
    """
    What one worker holds at the most memory-hungry moment of a micro-batch's forward and backward,
    besides its parameter shards, buffers and optimizer state (measured on fake tensors).
    """

    activations: int
    """Tensors the step made (activations, their gradients, the loss, the batch) alive at that moment."""
    gathered_parameters: int
    """Units' gathered parameters at that moment."""
    gathered_gradients: int
    """Units' whole gradients not yet reduced to shards, and the reduce-scatter bucket, at that moment."""
    gradients: int
    """Gradient shards (or, unsharded, whole gradients) made by then, or kept from earlier micro-batches."""
    activations_alone: int
    """The most the step's own tensors took at any moment (the activation memory people quote)."""

    @property
    def total(self) -> int:
        return self.activations + self.gathered_parameters + self.gathered_gradients + self.gradients


@dataclass
class Activations:
    """The measured peaks of a micro-batch, with the config's activation checkpointing and with the other."""

    configured: Optional[StepPeak]
    """With the config's own checkpointing (``None``: not measured, see :attr:`note`)."""
    alternative: Optional[StepPeak] = None
    """With checkpointing of the outermost wrapped modules when the config has none, without it when it
    has; ``None`` where there is no other setting or it could not be measured."""
    checkpointing: bool = False
    """Whether the config checkpoints activations."""
    note: str = ""
    """Why :attr:`configured` is missing."""

    @property
    def with_checkpointing(self) -> Optional[StepPeak]:
        return self.configured if self.checkpointing else self.alternative

    @property
    def without_checkpointing(self) -> Optional[StepPeak]:
        return self.alternative if self.checkpointing else self.configured


@dataclass
class Plan:
    """The whole plan and its per-worker byte estimates."""

    step: str
    model_class: str
    world_size: int
    optimizer: str
    optimizer_state_bytes: Optional[float]
    """Bytes of optimizer state per trainable parameter (8.0 for AdamW in float32); ``None``: unknown."""
    root: Unit
    element_size: int
    compute_element_size: int
    built_on: str
    """A key of :data:`BUILT_ON`."""
    engine: str
    """The step's training engine (its registered type)."""
    memory: Optional[MemoryModel] = None
    """What the engine's backend holds of a step (its parameters flat or not, its reduce-scatter bucket,
    ...); ``None``: the engine does not shard (Tango's DDP engine), every worker holds every unit whole."""
    backend: str = DEFAULT_BACKEND
    """The engine's ``backend``, whose :attr:`memory` this is."""
    init_on_meta: bool = False
    optimizer_note: str = ""
    """Why :attr:`optimizer_state_bytes` is unknown."""
    optimizer_step_bytes: float = 0.0
    """Bytes the optimizer's step allocates for a while per element of the tensors it updates at once."""
    optimizer_step_all_at_once: bool = False
    """Whether the step updates every tensor at once (torch's foreach implementations, the default on GPUs)
    rather than one tensor after another (the default on CPUs)."""
    buffer_bytes: int = 0
    """The model's buffers, which every worker holds whole."""
    largest_parameter_numel: int = 0
    """The largest trainable parameter's elements."""
    accumulates_unsharded: bool = False
    """``accumulate_grads_locally`` with ``grad_accum`` > 1: whole gradients kept between micro-batches."""
    device: str = "cpu"
    """The workers' device type (``"cpu"`` or ``"cuda"``): which implementations of the optimizer run."""
    batch: Optional[BatchSpec] = None
    batch_note: str = ""
    """Why :attr:`batch` is unknown."""
    activations: Optional[Activations] = None
    device_memory: Optional[int] = None
    """The memory of one device (or, on CPU workers, one worker's share of the host) to judge against."""
    from_config_only: List[str] = field(default_factory=list)
    """Pretrained directories without weight files, planned from their ``config.json`` alone."""
    built_dtype: str = "float32"
    """The dtype the model's parameters are built (or loaded) in."""
    parameter_dtype: str = "float32"
    """What the workers hold and update them in (:mod:`tango_fairscale.precision`), :attr:`element_size`."""
    compute_dtype: str = "float32"
    """The dtype the root unit gathers and computes in: :attr:`compute_element_size`'s."""

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

    @property
    def trainable_numel(self) -> int:
        return sum(unit.trainable_numel for unit in self.units)

    @property
    def states_per_parameter(self) -> Optional[float]:
        """Optimizer state tensors per trainable parameter, in the parameters' dtype."""
        return None if self.optimizer_state_bytes is None else self.optimizer_state_bytes / self.element_size

    @property
    def sharded(self) -> bool:
        """Whether the engine shards the model state across the workers."""
        return self.memory is not None

    @property
    def flat(self) -> bool:
        """Whether each unit's parameters are one flat parameter (the optimizer updates one per unit)."""
        return self.memory is not None and self.memory.flat

    @property
    def bucket_cap_mb(self) -> int:
        """The backend's reduce-scatter bucket, in MiB, as it sizes it (``0``: none)."""
        return self.memory.bucket_cap_mb if self.memory is not None else 0

    @property
    def fsdp_sharded(self) -> bool:
        """Whether the workers gather and reduce units (a sharding engine on more than one worker)."""
        return self.sharded and self.world_size > 1

    def _state(self, parameters: int, trainable: int) -> Dict[str, Optional[int]]:
        states = self.optimizer_state_bytes
        return {
            "parameters": parameters * self.element_size,
            "gradients": trainable * self.element_size,
            "optimizer_state": None if states is None else round(trainable * states),
        }

    def _shard_numels(self, world_size: int) -> Tuple[int, int]:
        """Elements of all shards, and of the trainable ones, on each of ``world_size`` workers."""
        ways = world_size if self.sharded else 1
        shards = [unit.shards(ways) for unit in self.units]
        return sum(t + f for t, f in shards), sum(t for t, _ in shards)

    def bytes_per_worker(self) -> Dict[str, Optional[int]]:
        """What each worker holds between steps: shards, gradients (trainable only), optimizer states."""
        return self._state(*self._shard_numels(self.world_size))

    def ddp_bytes_per_worker(self) -> Dict[str, Optional[int]]:
        """The same under DDP: every worker holds it whole."""
        return self._state(self.total_numel, self.trainable_numel)

    @property
    def largest_unit(self) -> Unit:
        return max(self.units, key=lambda unit: unit.numel)

    def gradient_bytes(self, world_size: Optional[int] = None) -> int:
        """
        The gradients a worker holds after backward: unsharded, whole; sharded, as the backend
        holds them (:meth:`~tango_fairscale.backends.base.MemoryModel.gradient_bytes`).
        """
        world_size = world_size or self.world_size
        if self.memory is None or world_size == 1:
            return self.trainable_numel * self.element_size
        return self.memory.gradient_bytes(self.units, world_size)

    # --- the peak of a training step -----------------------------------------------------------

    def step_peak(self, checkpointing: Optional[bool] = None) -> Optional[StepPeak]:
        """The measured peak of a micro-batch, with the config's checkpointing or the one asked for."""
        acts = self.activations
        if acts is None:
            return None
        if checkpointing is None or checkpointing == acts.checkpointing:
            return acts.configured
        return acts.alternative

    def peak_components(
        self,
        world_size: Optional[int] = None,
        batch_size: Optional[int] = None,
        checkpointing: Optional[bool] = None,
    ) -> Tuple[str, Dict[str, Optional[int]]]:
        """
        The estimated peak of one worker in a training step, by part (bytes; ``None`` where
        unknown), and when it comes (``"backward"``: a micro-batch's forward and backward; or
        ``"optimizer step"``). ``world_size``, ``batch_size`` and ``checkpointing`` change the
        plan's own, to judge a change: shards and gradient shards scale with the workers,
        activations with the batch (measured at the config's).
        """
        world_size = world_size or self.world_size
        shard, trainable_shard = self._shard_numels(world_size)
        states = self.optimizer_state_bytes
        resident: Dict[str, Optional[int]] = {
            "parameters": shard * self.element_size,
            "buffers": self.buffer_bytes,
            "optimizer_state": None if states is None else round(trainable_shard * states),
        }
        # The optimizer step: every gradient shard, and what the step allocates for a while, for
        # one tensor at a time (torch's default on CPUs) or for all at once (its foreach, on GPUs).
        ways = world_size if self.sharded else 1
        if self.optimizer_step_all_at_once:
            at_once = trainable_shard
        elif self.flat:
            at_once = max((unit.shards(ways)[0] for unit in self.units), default=0)
        else:
            at_once = shard_of(self.largest_parameter_numel, ways)
        optimizer_phase: Dict[str, Optional[int]] = {
            **resident,
            "gradients": self.gradient_bytes(world_size),
            "optimizer_step": round(at_once * self.optimizer_step_bytes),
        }
        if not self.fsdp_sharded and world_size > 1:
            # DDP's buckets: a copy of every gradient, allocated with the model.
            optimizer_phase["gathered_gradients"] = trainable_shard * self.element_size
        measured = self.step_peak(checkpointing)
        backward: Dict[str, Optional[int]] = {**resident, "gradients": None, "activations": None}
        if measured is not None:
            scale_batch = batch_size / self.batch.batch_size if batch_size and self.batch else 1.0
            # Gradient shards shrink with more workers; what is gathered does not.
            scale_workers = self.world_size / world_size if self.sharded else 1.0
            backward.update(
                gradients=round(measured.gradients * scale_workers),
                gathered_parameters=measured.gathered_parameters,
                gathered_gradients=measured.gathered_gradients,
                activations=round(measured.activations * scale_batch),
            )
        else:
            backward.update(gradients=None)
        phases = {"backward": backward, "optimizer step": optimizer_phase}
        totals = {name: total_of(parts) for name, parts in phases.items()}
        if any(total is None for total in totals.values()):
            name = "backward"
        else:
            name = max(totals, key=lambda key: totals[key] or 0)
        parts = {key: phases[name].get(key, 0) for key in PEAK_PARTS}
        return name, parts

    def peak(self, **changes: Any) -> Optional[int]:
        """The estimated peak of one worker (:meth:`peak_components`); ``None`` where a part is unknown."""
        return total_of(self.peak_components(**changes)[1])

    def suggestions(self) -> List[str]:
        """What to change so that the step fits :attr:`device_memory`, each judged by the estimate."""
        memory = self.device_memory
        peak = self.peak()
        if memory is None or peak is None or peak <= memory:
            return []
        found: List[str] = []
        if not self.sharded:
            found.append('the "fairscale" training engine, which shards the model state across the workers')
        else:
            workers = next(
                (
                    w
                    for w in _candidate_world_sizes(self.world_size)
                    if (self.peak(world_size=w) or 0) <= memory
                ),
                None,
            )
            if workers is not None:
                each = human(self.peak(world_size=workers) or 0)
                found.append(f"{workers} workers or more (device_count, or hosts): {each} each")
        acts = self.activations
        if acts is not None and not acts.checkpointing and acts.alternative is not None:
            with_ckpt = self.peak(checkpointing=True) or 0
            verdict = "fits" if with_ckpt <= memory else "still over"
            found.append(
                f"activation_checkpointing: true on the wrapped modules: {human(with_ckpt)} ({verdict})"
            )
        elif acts is not None and not acts.checkpointing and not self.root.children:
            found.append(
                "the model's repeated blocks wrapped (with_wrapped_modules: modules_to_wrap or "
                "wrap_module_classes) with activation_checkpointing: true"
            )
        if self.batch is not None and self.batch.batch_size > 1 and self.step_peak() is not None:
            examples = self.batch.batch_size * self.batch.grad_accum
            # A size that divides the step's examples first, so that grad_accum keeps them exactly.
            sizes = sorted(range(1, self.batch.batch_size), key=lambda b: (examples % b != 0, -b))
            size = next((b for b in sizes if (self.peak(batch_size=b) or 0) <= memory), None)
            if size is not None:
                accum = math.ceil(examples / size)
                found.append(
                    f"train_dataloader.batch_size {size} with grad_accum {accum}, for as many examples per "
                    f"step: {human(self.peak(batch_size=size) or 0)} (activations grow with the batch)"
                )
        if not found:
            found.append(
                "none of more workers, activation checkpointing or a smaller batch is enough on its own"
            )
        return found

    def as_dict(self) -> Dict[str, Any]:
        fsdp, ddp = self.bytes_per_worker(), self.ddp_bytes_per_worker()
        phase, parts = self.peak_components()
        peak = total_of(parts)
        acts = self.activations

        def step_peak(measured: Optional[StepPeak]) -> Optional[Dict[str, int]]:
            return None if measured is None else {**measured.__dict__, "total": measured.total}

        return {
            "step": self.step,
            "model": self.model_class,
            "world_size": self.world_size,
            "optimizer": self.optimizer,
            "from_config_only": list(self.from_config_only),
            "optimizer_state_bytes_per_parameter": self.optimizer_state_bytes,
            "optimizer_note": self.optimizer_note or None,
            "parameters": self.total_numel,
            "trainable_parameters": self.trainable_numel,
            "dtypes": {
                "built": self.built_dtype,
                "parameters": self.parameter_dtype,
                "compute": self.compute_dtype,
            },
            "units": [
                {
                    "name": unit.name,
                    "class": unit.class_name,
                    "parameters": unit.numel,
                    "shard_parameters": unit.shard_numel,
                    "trainable_parameters": unit.trainable_numel,
                    "checkpointed": unit.checkpointed,
                }
                for unit in self.units
            ],
            "bytes_per_worker": {**fsdp, "total": total_of(fsdp)},
            "ddp_bytes_per_worker": {**ddp, "total": total_of(ddp)},
            "largest_unit_gathered_bytes": self.largest_unit.numel * self.compute_element_size,
            "built_on": self.built_on,
            "built_on_meaning": BUILT_ON[self.built_on][1],
            "batch": self.batch.as_dict() if self.batch else None,
            "batch_note": self.batch_note or None,
            "step_peak": None
            if acts is None
            else {
                "checkpointing": acts.checkpointing,
                "with_checkpointing": step_peak(acts.with_checkpointing),
                "without_checkpointing": step_peak(acts.without_checkpointing),
                "note": acts.note or None,
            },
            "peak_bytes_per_worker": {**parts, "total": peak, "phase": phase},
            "device_memory": None
            if self.device_memory is None
            else {
                "bytes": self.device_memory,
                "fits": None if peak is None else peak <= self.device_memory,
                "headroom": None if peak is None else self.device_memory - peak,
                "suggestions": self.suggestions(),
            },
        }


def shard_of(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size) if numel else 0


def total_of(parts: Mapping[str, Optional[int]]) -> Optional[int]:
    return None if any(value is None for value in parts.values()) else sum(v or 0 for v in parts.values())


def _candidate_world_sizes(current: int) -> Iterable[int]:
    """World sizes above ``current``: each up to 16, then powers of two up to 65,536."""
    yield from range(current + 1, 17)
    yield from (1 << power for power in range(5, 17) if 1 << power > current)
