"""
The wrap plan of a ``torch::train`` step, without training: which submodules become FSDP
units, how big each is, which are checkpointed, the model state each worker will hold compared
with DDP, and the peak memory of one worker in a training step, judged against a device's
memory. Used by ``python -m tango_fairscale plan``; ``docs/plan.md`` says how each part is
estimated and how the estimate compares with measured peaks.

The peak is measured, not guessed: one forward and backward pass of the model on a batch of the
config's shape runs on fake tensors (shapes and dtypes, no storage: PyTorch's
``FakeTensorMode``), under :class:`LiveTensorBytes`, a dispatch mode that adds up the bytes of
the tensors alive after each operation. Hooks on the FSDP units add what FSDP holds besides
(:class:`_FsdpTimeline`): each unit's gathered parameters while it runs, its whole gradient until
it is reduced to a shard, the reduce-scatter bucket. The most of all of it at once, plus the
shards and the optimizer state, is the step's peak. It costs no memory at any size.
"""

import copy
import functools
import inspect
import math
import re
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch
import torch.nn as nn
from tango.common import Lazy, Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import (
    ConcatTensorDictsCollator,
    DataCollator,
    Model,
    Optimizer,
    TrainingEngine,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from ..backends.fairscale_fsdp.bucketing import sufficient_bucket_cap_mb
from ..config import FSDPConfig
from ..engine import FairScaleTrainingEngine, name_causal_lm_loss
from ..finetune.pretrained import shapes_only
from ..materialize import check_initialisable, parameters_on_meta
from ..wrapping import WRAPPER_TYPE, WrapPlan, disable_hf_kv_cache

#: The data step whose ``block_size`` is the sequence length of every training example.
TOKENIZE_TEXT = "fairscale::tokenize_text"
#: ``tokenize_text``'s own default ``block_size``.
TOKENIZE_TEXT_BLOCK_SIZE = 128

#: Where the plan built its model, and what that means, one sentence each.
BUILT_ON = {
    "meta": (
        "the meta device",
        "every tensor has its shape and dtype but no storage, so this command allocated no memory "
        "for the model and read no weights",
    ),
    "meta_parameters": (
        "the meta device (its parameters; its buffers on the CPU)",
        "as the workers build it under init_on_meta, its parameters took no memory here",
    ),
    "cpu": (
        "the CPU",
        "the model could not be built on the meta device, so this command built it for real, its "
        "whole size in this process's memory, and used only its shapes",
    ),
}

#: How much a CPU worker's resident memory grew beyond the tensors' peak in docs/plan.md's 2-worker
#: runs (the engine's 16 MiB mmap threshold: freed memory stays in glibc's heap, partly unused).
CPU_RESIDENT_FACTORS = (1.3, 1.9)

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
        return _shard(self.trainable_numel, world_size), _shard(self.numel - self.trainable_numel, world_size)


@dataclass
class BatchSpec:
    """One worker's micro-batch: the shape and dtype of each tensor the model's forward gets."""

    tensors: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]
    batch_size: int
    """``train_dataloader.batch_size``: examples per worker and micro-batch."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    sequence_length: Optional[int]
    """Tokens per example, where the batch has ``input_ids``."""
    source: str
    """Where the shape came from, for people."""
    others: Dict[str, Any] = field(default_factory=dict)
    """What the batch holds besides tensors (from a sample of the data), passed to forward as it is."""

    def with_batch_size(self, batch_size: int) -> "BatchSpec":
        """The same batch with ``batch_size`` examples (each tensor's first dimension)."""
        tensors = {
            key: ((batch_size, *shape[1:]) if shape and shape[0] == self.batch_size else shape, dtype)
            for key, (shape, dtype) in self.tensors.items()
        }
        return replace(self, tensors=tensors, batch_size=batch_size)

    @property
    def input_bytes(self) -> int:
        return sum(math.prod(shape) * _element_size(dtype) for shape, dtype in self.tensors.values())

    def describe(self) -> str:
        if self.sequence_length:
            shape = f"{self.batch_size} x {self.sequence_length} tokens"
        else:
            shape = f"{self.batch_size} examples"
        accum = f", grad_accum {self.grad_accum}" if self.grad_accum > 1 else ""
        return f"{shape} per worker and micro-batch{accum} ({self.source})"

    def as_dict(self) -> Dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "sequence_length": self.sequence_length,
            "source": self.source,
            "tensors": {
                key: {"shape": list(shape), "dtype": str(dtype).replace("torch.", "")}
                for key, (shape, dtype) in self.tensors.items()
            },
        }


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
    #: The step's training engine; with one that does not shard (Tango's DDP ``"torch"``), every
    #: worker holds every unit whole.
    engine: str = "fairscale"
    sharded: bool = True
    backend: str = "fairscale"
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
    flat: bool = True
    """Whether each unit's parameters are one flat parameter (FairScale's ``flatten_parameters``)."""
    largest_parameter_numel: int = 0
    """The largest trainable parameter's elements."""
    fp32_reduce_scatter: bool = False
    bucket_cap_mb: int = 25
    """FairScale's reduce-scatter bucket (the root's ``fsdp_config``)."""
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

    def gradient_element_size(self, unit: Unit) -> int:
        """Bytes per element of ``unit``'s whole gradient as it is reduced."""
        return self.element_size if self.fp32_reduce_scatter else unit.compute_element_size

    def bucketed(self, unit: Unit) -> bool:
        """Whether FairScale reduces ``unit``'s gradient through its bucket (it fits in ``bucket_cap_mb``)."""
        size = unit.trainable_numel * self.gradient_element_size(unit)
        return self.backend == "fairscale" and 0 < size <= self.bucket_cap_mb << 20

    def gradient_bytes(self, world_size: Optional[int] = None) -> int:
        """
        The gradients a worker holds after backward. Sharded, a shard of each trainable parameter;
        but FairScale hands out a bucketed gradient's shard as a view of the bucket's output, whose
        whole ``bucket_cap_mb / world size`` stays with it (in the gradient's dtype it stays as it
        is; a mixed-precision gradient is copied to float32 instead).
        """
        world_size = world_size or self.world_size
        if not self.sharded or world_size == 1:
            return self.trainable_numel * self.element_size
        shards = 0
        bucket = 0
        for unit in self.units:
            shard = _shard(unit.trainable_numel, world_size)
            if self.bucketed(unit) and self.gradient_element_size(unit) == self.element_size:
                bucket += shard * self.element_size
            else:
                shards += shard * self.element_size
        output = (self.bucket_cap_mb << 20) // world_size
        return shards + (math.ceil(bucket / output) * output if bucket else 0)

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
        elif self.flat and self.sharded:
            at_once = max((unit.shards(ways)[0] for unit in self.units), default=0)
        else:
            at_once = _shard(self.largest_parameter_numel, ways)
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
        totals = {name: _total(parts) for name, parts in phases.items()}
        if any(total is None for total in totals.values()):
            name = "backward"
        else:
            name = max(totals, key=lambda key: totals[key] or 0)
        parts = {key: phases[name].get(key, 0) for key in PEAK_PARTS}
        return name, parts

    def peak(self, **changes: Any) -> Optional[int]:
        """The estimated peak of one worker (:meth:`peak_components`); ``None`` where a part is unknown."""
        return _total(self.peak_components(**changes)[1])

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
                each = _human(self.peak(world_size=workers) or 0)
                found.append(f"{workers} workers or more (device_count, or hosts): {each} each")
        acts = self.activations
        if acts is not None and not acts.checkpointing and acts.alternative is not None:
            with_ckpt = self.peak(checkpointing=True) or 0
            verdict = "fits" if with_ckpt <= memory else "still over"
            found.append(
                f"activation_checkpointing: true on the wrapped modules: {_human(with_ckpt)} ({verdict})"
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
                    f"step: {_human(self.peak(batch_size=size) or 0)} (activations grow with the batch)"
                )
        if not found:
            found.append(
                "none of more workers, activation checkpointing or a smaller batch is enough on its own"
            )
        return found

    def as_dict(self) -> Dict[str, Any]:
        fsdp, ddp = self.bytes_per_worker(), self.ddp_bytes_per_worker()
        phase, parts = self.peak_components()
        peak = _total(parts)
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
            "bytes_per_worker": {**fsdp, "total": _total(fsdp)},
            "ddp_bytes_per_worker": {**ddp, "total": _total(ddp)},
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


def _shard(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size) if numel else 0


def _total(parts: Mapping[str, Optional[int]]) -> Optional[int]:
    return None if any(value is None for value in parts.values()) else sum(v or 0 for v in parts.values())


def _candidate_world_sizes(current: int) -> Iterable[int]:
    """World sizes above ``current``: each up to 16, then powers of two up to 65,536."""
    yield from range(current + 1, 17)
    yield from (1 << power for power in range(5, 17) if 1 << power > current)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{size} B"


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_memory(text: str) -> int:
    """
    A memory size: ``80GiB``, ``80G`` and ``81920MiB`` are binary (2**30 and 2**20 bytes), ``80GB``
    decimal (10**9), a bare number bytes. Raises ``ValueError`` naming the forms.
    """
    match = _SIZE.match(text)
    if not match or (match.group(3) and not match.group(2)):
        raise ValueError(f"{text!r} is not a memory size: write e.g. 80GiB (or 80G), 80GB or 24000MiB")
    number, prefix, binary, byte = match.groups()
    power = "kmgt".find(prefix.lower()) + 1 if prefix else 0
    base = 1000 if (byte and not binary) else 1024
    return int(float(number) * base**power)


# --- rendering -----------------------------------------------------------------------------------


def render(plan: Plan) -> str:
    """The plan as a text tree and tables, for people."""
    states = plan.states_per_parameter
    state_text = "unknown state" if states is None else f"{states:g} state tensor(s) per parameter"
    where, meaning = BUILT_ON[plan.built_on]
    workers = "on meta too, allocating one unit at a time" if plan.init_on_meta else "whole on their devices"
    lines = [
        f'Wrap plan of step "{plan.step}": {plan.model_class}, {plan.total_numel:,} parameters, '
        f"world size {plan.world_size}, optimizer {plan.optimizer} ({state_text}); built on {where}",
        f"Built on {where}: {meaning}. The workers build it {workers} (init_on_meta: "
        f"{'true' if plan.init_on_meta else 'false'}).",
    ]
    for directory in plan.from_config_only:
        lines.append(
            f"Planned from {directory}/config.json alone (it holds no model.safetensors): the shapes are "
            "the model's, no weight was read. Training reads the weights from there: put the model's "
            "save_pretrained files beside its config.json before `tango run`."
        )
    if plan.trainable_numel != plan.total_numel:
        lines.append(
            f"{plan.trainable_numel:,} of the parameters train; the frozen ones get no gradient "
            "and no optimizer state."
        )
    if not plan.sharded:
        lines.append(
            f'The training engine "{plan.engine}" does not shard: every worker holds the whole model '
            '(use the "fairscale" engine to shard it).'
        )
    lines += ["", f"{'FSDP unit':<52} {'parameters':>14} {'per worker':>14}  checkpointed"]

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
        lines.append(_state_row(key.replace("_", " "), fsdp[key], ddp[key]))
    lines.append(_state_row("total", _total(fsdp), _total(ddp)))
    largest = plan.largest_unit
    lines.append(
        f"plus, while a unit runs, its full parameters: largest is {largest.name or '<root>'} "
        f"({_human(largest.numel * plan.compute_element_size)})"
    )
    if plan.optimizer_note:
        lines.append(f"optimizer state: {plan.optimizer_note}")
    return "\n".join(lines + [""] + _render_peak(plan))


def _size(value: Optional[int]) -> str:
    return "unknown" if value is None else _human(value)


def _state_row(label: str, ours: Optional[int], ddp: Optional[int]) -> str:
    ratio = f"{ours / ddp:>8.3f}" if ours is not None and ddp else f"{'':>8}"
    return f"{label:<24} {_size(ours):>14} {_size(ddp):>14} {ratio}"


def _render_peak(plan: Plan) -> List[str]:
    phase, parts = plan.peak_components()
    peak = _total(parts)
    acts = plan.activations
    batch = plan.batch.describe() if plan.batch else f"unknown ({plan.batch_note})"
    lines = [
        f"Peak of one worker in a training step (estimated; it comes in the {phase}):",
        f"  batch: {batch}",
    ]
    labels = dict(PEAK_PARTS)
    if plan.fsdp_sharded:
        labels.update(parameters="parameters (shards)", gradients="gradients (shards)")
        if plan.backend == "fairscale":
            # With few trainable parameters (LoRA) FairScale's bucket is most of it.
            labels.update(gathered_gradients="units' whole gradients, bucket")
    else:
        labels.update(
            parameters="parameters (whole)", gradients="gradients (whole)", gathered_gradients="DDP's buckets"
        )
    for key, value in parts.items():
        if value or key in ("parameters", "optimizer_state", "activations"):
            why = ""
            if value is None and key == "activations":
                why = f"  ({acts.note})" if acts and acts.note and plan.batch else "  (the batch is unknown)"
            elif value is None and key == "optimizer_state":
                why = "  (see above)"
            lines.append(f"  {labels[key]:<30} {_size(value):>12}{why}")
    lines.append(f"  {'total':<30} {_size(peak):>12}")
    if acts is not None and acts.configured is not None:
        measured = [
            f"{_human(found.activations_alone)} {label}"
            for label, found in (
                ("with activation checkpointing", acts.with_checkpointing),
                ("without", acts.without_checkpointing),
            )
            if found is not None
        ]
        lines.append(f"  the activations' own peak, measured: {'; '.join(measured)}")
        if acts.alternative is not None:
            other = "without" if acts.checkpointing else "with"
            total = _size(plan.peak(checkpointing=not acts.checkpointing))
            lines.append(f"  the step's peak {other} activation checkpointing: {total}")
    if plan.device_memory is not None:
        memory = plan.device_memory
        if peak is None:
            lines.append(f"Against {_human(memory)} per device: cannot say, part of the estimate is unknown.")
        elif peak <= memory:
            headroom = memory - peak
            lines.append(
                f"Against {_human(memory)} per device: fits, {_human(headroom)} "
                f"({headroom / memory:.0%}) to spare."
            )
        else:
            lines.append(f"Against {_human(memory)} per device: does not fit, {_human(peak - memory)} over.")
            lines.append("To fit, any of:")
            lines += [f"  - {suggestion}" for suggestion in plan.suggestions()]
    lines.append(
        "Tensors only, as the allocator counts them (CUDA's max_memory_allocated): the process's runtime and "
        "what the allocator keeps besides come on top (docs/plan.md)."
    )
    if plan.device == "cpu" and peak is not None:
        # docs/plan.md: the resident growth of 2-worker CPU runs against this estimate.
        low, high = (round(peak * factor) for factor in CPU_RESIDENT_FACTORS)
        least, most = CPU_RESIDENT_FACTORS
        lines.append(
            f"On CPU workers the resident memory grew {least:g} to {most:g} times the tensors in "
            f"docs/plan.md's runs ({_human(low)} to {_human(high)} here; glibc's heap keeps what is "
            "freed), besides about 300 MiB of runtime per worker."
        )
    return lines


# --- the model ------------------------------------------------------------------------------------


def _one_line(error: BaseException, limit: int = 200) -> str:
    """An exception as one line of about ``limit`` characters at most (Tango's lists every name)."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    if len(line) > limit:
        line = line[:limit].rstrip() + " ..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def _build(model_params: Dict[str, Any], init_on_meta: bool = False) -> "tuple[nn.Module, str]":
    """The model, and where it was built (a key of :data:`BUILT_ON`)."""
    # Each attempt gets its own copy: from_params pops what it reads, nested dicts included.
    try:
        # As init_on_meta builds: a pretrained model (fairscale::from_pretrained, or transformers'
        # from_pretrained, which refuses a meta device otherwise) from its config, no tensor read.
        with torch.device("meta"), parameters_on_meta():
            return Model.from_params(Params(copy.deepcopy(model_params))), "meta"
    except ConfigurationError:
        raise
    except Exception:  # noqa: BLE001 - some models cannot be built on meta; CPU always works
        pass
    if init_on_meta:
        # What the workers do under init_on_meta: only the parameters on meta.
        try:
            with parameters_on_meta():
                return Model.from_params(Params(copy.deepcopy(model_params))), "meta_parameters"
        except ConfigurationError:
            raise
        except Exception:  # noqa: BLE001 - the CPU build below reports the constructor's own error
            pass
    try:
        return Model.from_params(Params(copy.deepcopy(model_params))), "cpu"
    except ConfigurationError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's constructor: its error, on one line
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        name = model_params.get("type", "the model")
        raise ConfigurationError(f"model: building {name!r} raised {type(error).__name__}: {first}") from None


def _inner_model_config(step: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The model's config and the wrapper's (``{}`` without ``with_wrapped_modules``)."""
    model_config = dict(step["model"])
    if model_config.get("type") == WRAPPER_TYPE:
        return dict(model_config["model"]), model_config
    return model_config, {}


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
    model_config, wrapper = _inner_model_config(step)
    engine = dict(step.get("training_engine", {}))
    init_on_meta = bool(engine.get("init_on_meta"))
    model, built_on = _build(model_config, init_on_meta)
    if init_on_meta:
        with parameters_on_meta():
            check_initialisable(Model.from_params(Params(copy.deepcopy(model_config))))

    wrap_plan = _wrap_plan(model, wrapper)
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
    engine_type = str(engine.get("type", "torch"))
    sharded = _shards(engine_type)
    engine_fsdp = FSDPConfig.from_params(Params(dict(engine.get("fsdp_config") or {})))
    unit_fsdp = FSDPConfig.from_params(Params(dict(wrapper.get("fsdp_config") or {})))
    parameters = list(model.parameters())
    element_size = parameters[0].element_size() if parameters else 4

    def compute_size(config: FSDPConfig) -> int:
        if not sharded or not config.mixed_precision:
            return element_size
        return _element_size(config.resolved_compute_dtype(on_cpu=device == "cpu"))

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

    backend = str(engine.get("backend", "fairscale"))
    optimizer = dict(engine.get("optimizer", {}))
    flat = sharded and backend == "fairscale" and engine_fsdp.flatten_parameters
    footprint = optimizer_footprint(optimizer, flat)
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
        sharded=sharded,
        backend=backend,
        init_on_meta=init_on_meta,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        flat=flat,
        largest_parameter_numel=max((p.numel() for p in parameters if p.requires_grad), default=0),
        fp32_reduce_scatter=engine_fsdp.fp32_reduce_scatter,
        bucket_cap_mb=engine_fsdp.bucket_cap_mb if backend == "fairscale" else 0,
        accumulates_unsharded=sharded and bool(engine.get("accumulate_grads_locally")) and grad_accum > 1,
        device=device,
        device_memory=device_memory,
    )
    # The bucket the backend makes: no larger than the gradients that go into it.
    plan.bucket_cap_mb = sufficient_bucket_cap_mb(
        plan.bucket_cap_mb,
        ((unit.trainable_numel, plan.gradient_element_size(unit), world_size) for unit in plan.units),
    )
    plan.batch, plan.batch_note = batch_spec(step, steps or {}, model, sequence_length, sample_data)
    if measure:
        plan.activations = _measure(plan, model_config, wrap_plan, engine, engine_fsdp, unit_fsdp)
    return plan


def _wrap_plan(model: nn.Module, wrapper: Dict[str, Any]) -> Optional[WrapPlan]:
    if not wrapper:
        return None
    return WrapPlan.build(
        model,
        wrapper.get("modules_to_wrap"),
        wrap_module_classes=wrapper.get("wrap_module_classes"),
        min_num_params=wrapper.get("min_num_params"),
        activation_checkpointing=bool(wrapper.get("activation_checkpointing")),
        fsdp=wrapper.get("fsdp_config") is not None,
    )


def _shards(engine_type: str) -> bool:
    """Whether the engine registered as ``engine_type`` shards the model (this package's engine does)."""
    try:
        engine_class = TrainingEngine.resolve_class_name(engine_type)[0]
    except Exception:  # noqa: BLE001 - an unknown name is Tango's error to report when the step runs
        return True
    return isinstance(engine_class, type) and issubclass(engine_class, FairScaleTrainingEngine)


# --- the optimizer ----------------------------------------------------------------------------------


@dataclass
class OptimizerFootprint:
    """What an optimizer holds per element of the tensors it updates (:func:`optimizer_footprint`)."""

    state_bytes: Optional[float]
    """Bytes of state kept per element (8.0 for AdamW in float32); ``None``: unknown."""
    step_bytes: float = 0.0
    """The most bytes a step allocates for a while per element of the tensor it is updating."""
    all_at_once: bool = False
    """Whether the config asks for an implementation that updates all tensors at once (``foreach: true``)."""
    foreach_default: bool = False
    """Whether the optimizer has a ``foreach`` implementation that PyTorch picks by default on GPUs."""
    note: str = ""
    """Why :attr:`state_bytes` is unknown."""


def optimizer_footprint(optimizer: Dict[str, Any], flat: bool) -> OptimizerFootprint:
    """
    The optimizer's state and its step's temporaries per parameter element, measured: the
    config's optimizer is built on one float32 test parameter (1-D, as FairScale's flat shards are,
    when ``flat``) and takes two steps, and the state it then holds is counted (scalars such as
    the step count left out), and what the second step allocated for a while. So AdamW counts 8
    bytes of state, SGD with momentum 4, SGD without 0, and an optimizer this code never heard of
    its own. One that cannot be built or stepped this way is reported, never assumed.
    """
    name = optimizer.get("type")
    if not name:
        return OptimizerFootprint(None, note="the engine's config names no optimizer")
    parameter = nn.Parameter(torch.zeros(4096) if flat else torch.zeros(64, 64))
    try:
        built = Lazy(Optimizer, Params(copy.deepcopy(optimizer))).construct(params=[parameter])
        parameter.grad = torch.full_like(parameter, 1e-3)
        built.step()
        state = built.state.get(parameter, {})
        tensors = [value for value in state.values() if isinstance(value, torch.Tensor) and value.numel() > 1]
        tracker = LiveTensorBytes([parameter, parameter.grad, *tensors])
        with tracker:
            built.step()
    except Exception as error:  # noqa: BLE001 - any optimizer's constructor or step: reported, not assumed
        return OptimizerFootprint(
            None,
            note=f"unknown for optimizer {name!r}: building it on a test parameter and stepping it raised "
            f"{_one_line(error)}; give --optimizer-states N (state tensors per parameter, e.g. 2 for AdamW)",
        )
    numel = parameter.numel()
    defaults = getattr(built, "defaults", {})
    return OptimizerFootprint(
        state_bytes=sum(t.numel() * t.element_size() for t in tensors) / numel,
        step_bytes=tracker.peak / numel,
        all_at_once=bool(defaults.get("foreach")),
        foreach_default="foreach" in defaults
        and defaults.get("foreach") is None
        and not defaults.get("fused"),
    )


# --- the batch -------------------------------------------------------------------------------------


def _data_step(
    step: Dict[str, Any], steps: Mapping[str, Any]
) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """The data step the training step reads (its name, ``None`` for one written inline) and its config."""
    reference = step.get("dataset_dict")
    if isinstance(reference, dict) and reference.get("type") == "ref":
        name = reference.get("ref")
        found = steps.get(name) if isinstance(name, str) else None
        return name, dict(found) if isinstance(found, dict) else None
    if isinstance(reference, dict) and "type" in reference:
        return None, dict(reference)
    return None, None


def _forward_parameters(model: nn.Module) -> Optional[Set[str]]:
    """The names ``model.forward`` takes; ``None`` when it takes any keyword (``**kwargs``)."""
    signature = inspect.signature(model.forward)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return set(signature.parameters)


def batch_spec(
    step: Dict[str, Any],
    steps: Mapping[str, Any],
    model: nn.Module,
    sequence_length: Optional[int],
    sample_data: bool,
) -> Tuple[Optional[BatchSpec], str]:
    """
    One worker's micro-batch: ``train_dataloader.batch_size`` examples, each of the shape that a
    sample of the data has (``sample_data``), or ``sequence_length`` tokens, or
    ``fairscale::tokenize_text``'s ``block_size``. ``(None, why)`` where it cannot be told.
    """
    loader = dict(step.get("train_dataloader") or {})
    grad_accum = int(step.get("grad_accum", 1))
    if "batch_sampler" in loader:
        return None, "train_dataloader has a batch_sampler, whose batch size the plan cannot read"
    batch_size = int(loader.get("batch_size", 1))
    data_name, data = _data_step(step, steps)
    if sample_data:
        return _sampled_batch(step, steps, loader, batch_size, grad_accum, data_name, data), ""
    block_size: Optional[int] = None
    source = ""
    if sequence_length is not None:
        if sequence_length < 1:
            raise ConfigurationError(f"--sequence-length must be at least 1, got {sequence_length}")
        block_size, source = sequence_length, "--sequence-length"
    elif data is not None and data.get("type") == TOKENIZE_TEXT:
        block_size = int(data.get("block_size", TOKENIZE_TEXT_BLOCK_SIZE))
        source = f"{TOKENIZE_TEXT}'s block_size"
    if block_size is None:
        return None, (
            "the shape of an example is unknown: give --sequence-length N (a language model's tokens per "
            "example) or --sample-data (run the data step for one batch)"
        )
    takes = _forward_parameters(model)
    if takes is not None and "input_ids" not in takes:
        return None, (
            f"{type(model).__name__}.forward takes no input_ids, so a sequence length does not say what a "
            "batch holds: give --sample-data (run the data step for one batch)"
        )
    shape = (batch_size, block_size)
    tensors: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {"input_ids": (shape, torch.long)}
    if takes is None or "labels" in takes:
        tensors["labels"] = (shape, torch.long)
    if data is not None and data.get("type") == TOKENIZE_TEXT and data.get("pack") is False:
        tensors["attention_mask"] = (shape, torch.long)
    return (
        BatchSpec(
            tensors=tensors,
            batch_size=batch_size,
            grad_accum=grad_accum,
            sequence_length=block_size,
            source=f"batch_size from train_dataloader, sequence length from {source}",
        ),
        "",
    )


def _sampled_batch(
    step: Dict[str, Any],
    steps: Mapping[str, Any],
    loader: Dict[str, Any],
    batch_size: int,
    grad_accum: int,
    data_name: Optional[str],
    data: Optional[Dict[str, Any]],
) -> BatchSpec:
    """The first batch of the training split, from the data step run here (with the steps it refers to)."""
    from tango.step_graph import StepGraph

    if data is None:
        raise ConfigurationError(
            "--sample-data: the step's dataset_dict is neither a ref to a step of the config nor a step "
            "config; give --sequence-length instead"
        )
    name = data_name or "dataset_dict"
    configs = _with_dependencies(name, data, steps)
    try:
        graph = StepGraph.from_params(configs)
        result = _run_step(graph[name], {})
    except ConfigurationError:
        raise
    except Exception as error:  # noqa: BLE001 - the data step's own failure, on one line
        raise ConfigurationError(
            f"--sample-data: running the data step {name!r} raised {_one_line(error)}"
        ) from None
    split_name = str(step.get("train_split", "train"))
    try:
        split = result[split_name]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"--sample-data: the data step {name!r} has no split {split_name!r}"
        ) from None
    examples = [split[index] for index in range(min(batch_size, len(split)))]
    collate_config = loader.get("collate_fn")
    # Tango's DataLoader default, unless the config names another.
    collate: DataCollator = (
        DataCollator.from_params(Params(copy.deepcopy(collate_config)))
        if collate_config
        else ConcatTensorDictsCollator()
    )
    batch = collate(examples)
    # The last batch of a small split may be short: the shape is that of a full one.
    tensors = {
        key: ((batch_size, *value.shape[1:]) if value.dim() else (), value.dtype)
        for key, value in batch.items()
        if isinstance(value, torch.Tensor)
    }
    others = {key: value for key, value in batch.items() if not isinstance(value, torch.Tensor)}
    ids = tensors.get("input_ids")
    return BatchSpec(
        tensors=tensors,
        batch_size=batch_size,
        grad_accum=grad_accum,
        sequence_length=ids[0][1] if ids and len(ids[0]) >= 2 else None,
        source=f"a batch of the data step {name!r}, run here",
        others=others,
    )


def _with_dependencies(name: str, config: Dict[str, Any], steps: Mapping[str, Any]) -> Dict[str, Any]:
    """``config`` under ``name``, with every step it refers to, directly or not."""
    found: Dict[str, Any] = {name: copy.deepcopy(config)}
    pending = [config]
    while pending:
        for value in _values(pending.pop()):
            if isinstance(value, dict) and value.get("type") == "ref" and value.get("ref") not in found:
                reference = value.get("ref")
                if not isinstance(reference, str) or not isinstance(steps.get(reference), dict):
                    raise ConfigurationError(
                        f"--sample-data: the data step refers to {reference!r}, not a step of the config"
                    )
                found[reference] = copy.deepcopy(steps[reference])
                pending.append(steps[reference])
    return found


def _values(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _values(item)
    elif isinstance(value, list):
        for item in value:
            yield from _values(item)


def _run_step(step: Any, done: Dict[str, Any]) -> Any:
    """Run a step of a :class:`~tango.step_graph.StepGraph`, the steps it reads first (no workspace)."""
    from tango import Step

    if step.name in done:
        return done[step.name]

    def resolve(value: Any) -> Any:
        if isinstance(value, Step):
            return _run_step(value, done)
        if isinstance(value, dict):
            return {key: resolve(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(resolve(item) for item in value)
        return value

    done[step.name] = step.run(**resolve(step.kwargs))
    return done[step.name]


# --- activations ------------------------------------------------------------------------------------


# --- the step's peak ------------------------------------------------------------------------------


class LiveTensorBytes(TorchDispatchMode):
    """
    The bytes of the tensors that the operations run inside it made and that are still alive, and
    the most there were at once (:attr:`peak`), with what :meth:`hold` adds for memory the
    operations do not show (FSDP's gathered parameters). A tensor is counted once per storage (a
    view adds nothing) from the operation that made it until its storage is freed (a weak
    reference's callback): saved for backward, it stays counted until backward releases it.
    Storages alive before (``known``: parameters, buffers, inputs) are not counted. Works on real,
    fake and ``meta`` tensors alike: a fake tensor's storage has a size but no memory.

    What it cannot see: memory a kernel allocates for itself without returning it as a tensor
    (workspaces, scratch buffers), and what an allocator keeps beyond live tensors.
    """

    def __init__(self, known: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = 0
        """Bytes of the tracked tensors alive now."""
        self.peak = 0
        self.held: Dict[str, int] = {}
        """Bytes added by :meth:`hold`, by kind."""
        self.at_peak: Dict[str, int] = {}
        """:attr:`held` and ``"tensors"`` (:attr:`live`) at the peak."""
        self.excluded = 0
        """Of :attr:`live`, bytes that :attr:`peak_alone` leaves out (parameters' gradients)."""
        self.peak_alone = 0
        """The most bytes of tracked tensors at once, :attr:`excluded` left out."""
        self._tracked: Dict[int, Any] = {}
        self._known = {tensor.untyped_storage()._cdata for tensor in known}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._known or key in self._tracked:
            return
        size = storage.nbytes()
        self._tracked[key] = weakref.ref(storage, functools.partial(self._release, key, size))
        self.live += size
        self.peak_alone = max(self.peak_alone, self.live - self.excluded)
        self._update()

    def _release(self, key: int, size: int, _storage: Any = None) -> None:
        if self._tracked.pop(key, None) is not None:
            self.live -= size

    def hold(self, kind: str, size: int) -> None:
        """Count ``size`` more bytes (less, if negative) of ``kind``, which no operation here made."""
        self.held[kind] = self.held.get(kind, 0) + size
        self._update()

    def _update(self) -> None:
        total = self.live + sum(self.held.values())
        if total > self.peak:
            self.peak = total
            self.at_peak = {"tensors": self.live, "excluded": self.excluded, **self.held}


class _FsdpTimeline:
    """
    What FSDP holds during a micro-batch besides the step's own tensors, added to a
    :class:`LiveTensorBytes` by hooks on the model's FSDP units, at the moments FairScale's FSDP
    holds it:

    - a unit's gathered parameters (in its compute dtype), from its forward's start to its end
      (to the end of backward for the root, and for a unit that does not reshard after forward),
      and again from its backward's start (a gradient reaching its outputs) to its end;
    - its parameters' gradients, kept until every one of the unit's has come (they become one
      whole gradient of the unit's flat parameter then), when the whole gradient exists twice
      for a moment (joined, then copied for the reduce-scatter), before it is reduced to a shard
      that stays;
    - FairScale's reduce-scatter bucket, from the first gradient that fits in it to the end of
      backward.

    Unsharded (DDP, one worker) the gradients stay whole, and DDP's buckets hold a copy of them.
    """

    def __init__(self, plan: Plan, model: nn.Module, tracker: LiveTensorBytes) -> None:
        self.plan = plan
        self.tracker = tracker
        self.units = plan.units
        self.gathered: Set[str] = set()
        self.done: Set[str] = set()
        self.in_backward = False
        self.bucket_open = False
        self.bucket_offset = 0
        self.bucket_units: List[Unit] = []
        # Later micro-batches add their gradients into the shards the first one made.
        self.accumulating = plan.batch is not None and plan.batch.grad_accum > 1
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
                    "gradients", sum(u.trainable_numel * u.compute_element_size for u in self.units)
                )
            else:
                self.tracker.hold("gradients", plan.gradient_bytes())
        if not plan.fsdp_sharded and plan.world_size > 1:
            # DDP copies each gradient into its buckets, allocated with the model.
            self.tracker.hold("gathered_gradients", plan.trainable_numel * plan.element_size)

    def finish(self) -> None:
        """The end of backward: every unit's gradients reduced, the bucket and the gathered units freed."""
        for unit in self.units:
            if unit.name not in self.done:
                self._reduce(unit)
        if self.bucket_open:
            self._flush()
            # FairScale's teardown: the bucket and its (new, empty) output freed.
            self.tracker.hold("gathered_gradients", -self._bucket_bytes())
            self.bucket_open = False
        for unit in self.units:
            if unit.name in self.gathered:
                self._release(unit)

    def _gathered_bytes(self, unit: Unit) -> int:
        # Under mixed precision FairScale also casts the shard to the compute dtype before gathering.
        shard = (
            sum(unit.shards(self.plan.world_size))
            if unit.compute_element_size != self.plan.element_size
            else 0
        )
        return (unit.numel + shard) * unit.compute_element_size

    def _gather(self, unit: Unit) -> None:
        if unit.name not in self.gathered and unit.name not in self.done:
            self.gathered.add(unit.name)
            self.tracker.hold("gathered_parameters", self._gathered_bytes(unit))

    def _release(self, unit: Unit) -> None:
        if unit.name in self.gathered:
            self.gathered.discard(unit.name)
            self.tracker.hold("gathered_parameters", -self._gathered_bytes(unit))

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
        if unit.name in self.done or not self.plan.fsdp_sharded:
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
        plan = self.plan
        shard = unit.shards(plan.world_size)[0] * plan.gradient_element_size(unit)
        if joined:
            if plan.fp32_reduce_scatter and unit.compute_element_size < plan.element_size:
                joined += unit.trainable_numel * plan.element_size
            # Joined into one flat gradient (then copied for the reduce-scatter): twice, for a moment.
            self.tracker.hold("gathered_gradients", joined)
            if plan.bucketed(unit):
                self._into_bucket(unit, shard)
            self.tracker.hold("gathered_gradients", -joined)
        for parameter, size in pieces:
            self.tracker.excluded -= size
            parameter.grad = None
        self.grads[unit.name] = []
        self._release(unit)
        if not plan.bucketed(unit) and not self.accumulating:
            self.tracker.hold("gradients", unit.shards(plan.world_size)[0] * plan.element_size)

    def _bucket_bytes(self) -> int:
        """FairScale's bucket: its input (``bucket_cap_mb``) and its output (a shard of it)."""
        return self._output_bytes() * (self.plan.world_size + 1)

    def _output_bytes(self) -> int:
        return (self.plan.bucket_cap_mb << 20) // self.plan.world_size

    def _into_bucket(self, unit: Unit, shard: int) -> None:
        """A gradient copied into the bucket (set up for this backward first; flushed first if full)."""
        if not self.bucket_open:
            self.bucket_open = True
            self.tracker.hold("gathered_gradients", self._bucket_bytes())
        if shard > self._output_bytes() - self.bucket_offset:
            self._flush()
        self.bucket_offset += shard
        self.bucket_units.append(unit)

    def _flush(self) -> None:
        """
        The bucket reduced: its units' shards taken from its output (a view that keeps the whole
        output, or a float32 copy under mixed precision; added in place to earlier micro-batches'),
        and a new output allocated.
        """
        if not self.bucket_offset:
            return
        plan = self.plan
        output = self._output_bytes()
        if not self.accumulating:
            if all(plan.gradient_element_size(u) == plan.element_size for u in self.bucket_units):
                kept = output
            else:
                kept = sum(u.shards(plan.world_size)[0] for u in self.bucket_units) * plan.element_size
            self.tracker.hold("gradients", kept)
        # The old output kept by the shards (counted above) or freed; a new one allocated.
        self.tracker.hold("gathered_gradients", -output)
        self.tracker.hold("gathered_gradients", output)
        self.bucket_offset = 0
        self.bucket_units = []


def _measure(
    plan: Plan,
    model_config: Dict[str, Any],
    wrap_plan: Optional[WrapPlan],
    engine: Dict[str, Any],
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
    amp_dtype = None
    if engine.get("amp"):
        amp_dtype = torch.bfloat16 if engine.get("amp_use_bfloat16", on_cpu) else torch.float16

    def measure(names: Set[str]) -> Tuple[Optional[StepPeak], str]:
        try:
            return measure_step(plan, model_config, batch, names, dtypes, amp_dtype), ""
        except ConfigurationError:
            raise
        except Exception as error:  # noqa: BLE001 - the model's forward on fake tensors: reported, not guessed
            return None, f"not measured: the forward and backward on fake tensors raised {_one_line(error)}"

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

    model, _ = _build(model_config, plan.init_on_meta)
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
