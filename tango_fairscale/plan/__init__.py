"""
The wrap plan of a ``torch::train`` step, without training: which submodules become FSDP
units, how big each is, which are checkpointed, the model state each worker will hold compared
with DDP, and the peak memory of one worker in a training step, judged against a device's
memory. Used by ``python -m tango_fairscale plan``; ``docs/plan.md`` says how each part is
estimated and how the estimate compares with measured peaks.

The peak is measured, not guessed: one forward and backward pass of the model on a batch of the
config's shape runs on fake tensors (:mod:`.measure`), under :class:`LiveTensorBytes`, with what
FSDP holds besides as the engine's backend holds it (its
:class:`~tango_fairscale.backends.base.MemoryModel`). The rooms: :mod:`.build` (:func:`make_plan`,
reading the config), :mod:`.model` (the model on meta), :mod:`.batch`, :mod:`.optimizer`,
:mod:`.measure`, :mod:`.estimate` (:class:`Plan` and its arithmetic), :mod:`.render`, :mod:`.text`.
"""

from .batch import TOKENIZE_TEXT, TOKENIZE_TEXT_BLOCK_SIZE, BatchSpec, batch_spec
from .build import make_plan
from .estimate import PEAK_PARTS, Activations, Plan, StepPeak, Unit
from .live_bytes import LiveTensorBytes
from .measure import measure_step
from .model import BUILT_ON
from .optimizer import OptimizerFootprint, optimizer_footprint
from .render import CPU_RESIDENT_FACTORS, render
from .text import parse_memory

__all__ = [
    "BUILT_ON",
    "CPU_RESIDENT_FACTORS",
    "PEAK_PARTS",
    "TOKENIZE_TEXT",
    "TOKENIZE_TEXT_BLOCK_SIZE",
    "Activations",
    "BatchSpec",
    "LiveTensorBytes",
    "OptimizerFootprint",
    "Plan",
    "StepPeak",
    "Unit",
    "batch_spec",
    "make_plan",
    "measure_step",
    "optimizer_footprint",
    "parse_memory",
    "render",
]
