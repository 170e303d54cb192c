"""
:class:`StepRecord`: one worker's figures of one training step (and of a validation loop, and of
the end of training), the one thing every worker sends to the workers that write; and what a
step's records of all workers add up to (:func:`mean_loss`, :func:`mean_outputs`,
:func:`train_figures`).
"""

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from .figures import Window, combine, scalar

__all__ = ["MeterInfo", "StepRecord", "mean_loss", "mean_outputs", "output_sums", "train_figures"]

#: Per name of a model output: the sum of its scalar values and how many there were.
Sums = Dict[str, Tuple[float, int]]


@dataclass
class MeterInfo:
    """How a worker's figures are made, once per run: the metrics log's ``run`` line says it."""

    device: str
    """The worker's device, e.g. ``"cpu"``."""

    compute_dtype: str
    """The dtype its matmuls run in: AMP's, else FSDP's mixed precision, else the parameters'."""

    peak_flops_per_second: Optional[float]
    """Its peak FLOP/s (:mod:`~.peaks`), None where it is not known."""

    peak: str
    """Where the peak comes from, or why it is not known."""

    flops: str
    """How the FLOPs are counted (:meth:`~.flops.FlopMeter.describe`)."""

    tokens: str
    """What counts as a token (:func:`~.tokens.describe_tokens`)."""

    collectives: str
    """What is timed as collectives."""

    counted: Dict[str, Any] = field(default_factory=dict)
    """The counted step (1-based), its FLOPs and samples (:meth:`~.flops.FlopMeter.counted`)."""


@dataclass
class StepRecord:
    """One worker's figures of one training step (``kind`` ``"train"``), one validation loop
    (``"validation"``), the validation before the first step (``"baseline"``) or a whole training
    run at its end (``"end"``)."""

    rank: int
    """The worker's global rank."""

    kind: str
    """``"train"``, ``"validation"``, ``"baseline"`` or ``"end"``."""

    step: int
    """Optimizer steps done, counting this one (Tango's 0-based step index + 1)."""

    epoch: int
    """Tango's 0-based epoch."""

    device: str
    """The worker's device, e.g. ``"cuda:0"``."""

    peak_memory_mib: float
    """The worker's peak memory so far (:func:`~.core.peak_memory_mib`)."""

    window: Window = field(default_factory=Window)
    """``"train"``: the step's figures; ``"end"``: every training step's, a resumed run's earlier
    steps included where a callback restored them; ``"validation"``: none."""

    loss: Optional[float] = None
    """The worker's loss of the step (Tango's ``batch_loss`` in ``post_batch``)."""

    mean_loss: Optional[float] = None
    """Tango's loss averaged over the workers, on steps where its ``log_batch`` gave it."""

    lr: Optional[float] = None
    """The learning rate of the optimizer's first parameter group for the step."""

    outputs: Sums = field(default_factory=dict)
    """The scalar outputs of the model's ``forward``: of the step's micro-batches, or of the
    validation's batches (:func:`output_sums`)."""

    val_metric: Optional[float] = None
    """``"validation"`` and ``"baseline"``: Tango's validation metric."""

    best_val_metric: Optional[float] = None
    """``"validation"``: the best so far."""

    info: Optional[MeterInfo] = None
    """How the worker's figures are made: in the first ``"train"`` record of each run."""

    @property
    def key(self) -> str:
        """The record's name among the worker's records of a run."""
        return f"{self.kind}/{self.step}"

    def to_json(self) -> str:
        # JSON, not pickle: the store is read over the network, and a record is only numbers
        # and text. NaN and infinity travel as JSON's extensions, which json reads back.
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "StepRecord":
        values = json.loads(text)
        values["window"] = Window(**values["window"])
        values["outputs"] = {
            key: (float(total), int(count)) for key, (total, count) in values["outputs"].items()
        }
        if values.get("info") is not None:
            values["info"] = MeterInfo(**values["info"])
        return cls(**values)


def output_sums(outputs: Iterable[Mapping[str, Any]], sums: Optional[Sums] = None) -> Sums:
    """Per key of ``outputs``' scalars (:func:`~.figures.scalar`): their sum and count, added to ``sums``."""
    sums = dict(sums or {})
    for output in outputs:
        for key, value in output.items():
            number = scalar(value)
            if number is not None:
                total, count = sums.get(key, (0.0, 0))
                sums[key] = (total + number, count + 1)
    return sums


def mean_outputs(records: Sequence[StepRecord]) -> Dict[str, float]:
    """The mean of each model output over every value of every worker, keys in first-seen order."""
    merged: Sums = {}
    for record in records:
        for key, (total, count) in record.outputs.items():
            old_total, old_count = merged.get(key, (0.0, 0))
            merged[key] = (old_total + total, old_count + count)
    return {key: total / count for key, (total, count) in merged.items() if count}


def mean_loss(records: Sequence[StepRecord], own: StepRecord) -> Optional[float]:
    """
    The step's loss averaged over the workers: Tango's own (``own.mean_loss``) where it gave it,
    else computed as Tango computes it, a float32 sum over the workers divided by their number.
    """
    if own.mean_loss is not None:
        return own.mean_loss
    losses = [record.loss for record in records if record.loss is not None]
    if len(losses) <= 1:
        return own.loss
    return torch.tensor(losses, dtype=torch.float32).sum().item() / len(losses)


def train_figures(records: Sequence[StepRecord], windows: Sequence[Window]) -> Dict[str, Optional[float]]:
    """
    The throughput of every worker's ``windows`` (:func:`~.figures.combine`: samples/s, step
    time, tokens, model FLOPs, MFU, time in collectives) and the highest peak memory of the
    step's ``records``.
    """
    return {**combine(windows), "peak_memory_mib": max(record.peak_memory_mib for record in records)}


def by_rank(records: Sequence[StepRecord]) -> List[StepRecord]:
    """``records`` in the order of the workers' ranks."""
    return sorted(records, key=lambda record: record.rank)
