"""
The arithmetic of the step telemetry: one worker's figures over some steps (:class:`Window`), the
workers' figures combined into a step's throughput (:func:`combine`), one worker's own
(:func:`worker_figures`), MFU (:func:`mfu`), and the numbers a line or a row may hold
(:func:`scalar`, :func:`finite`).
"""

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Sequence

import torch

__all__ = ["Window", "combine", "finite", "mfu", "scalar", "worker_figures"]


def scalar(value: Any) -> Optional[float]:
    """``value`` as a float if it is a single number (a one-element tensor, an int or a float), else None."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item()) if value.numel() == 1 else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer beyond float's range (a hostile or corrupt line)
            return None
    return None


def finite(value: Any) -> Optional[float]:
    """
    ``value`` as a float if it is a finite number, else None: JSON has no NaN or infinity, and a
    logging service shows no point for a figure that is not known.
    """
    number = scalar(value)
    return number if number is not None and math.isfinite(number) else None


def mfu(flops_per_second: Optional[float], peak_flops_per_second: Optional[float]) -> Optional[float]:
    """Achieved model FLOP/s over the peak; None where either is unknown or the peak is not positive."""
    if flops_per_second is None or peak_flops_per_second is None or not peak_flops_per_second > 0:
        return None
    return flops_per_second / peak_flops_per_second


def _total(values: Sequence[Optional[float]]) -> Optional[float]:
    """The sum, or None if any is None (a total that leaves out a worker or a step would mislead)."""
    if not values or any(value is None for value in values):
        return None
    return float(sum(value for value in values if value is not None))


def _slowest(values: Sequence[Optional[float]]) -> Optional[float]:
    """The largest, or None if any is None."""
    if not values or any(value is None for value in values):
        return None
    return max(value for value in values if value is not None)


@dataclass
class Window:
    """
    One worker's figures over consecutive training steps (one step in a step record; the steps
    since a log's previous line; every step of a training run in the memory table).
    """

    steps: int = 0
    """Training steps."""

    samples: int = 0
    """Samples of this worker's batches."""

    tokens: Optional[int] = None
    """Tokens of those batches; None when they have none (see :func:`~.tokens.count_tokens`)."""

    seconds: float = 0.0
    """Wall time of the steps: from the start of each to the start of the next (validation left out)."""

    flops: Optional[float] = None
    """Model FLOPs of the steps (forward and backward), None until they are counted."""

    peak_flops_per_second: Optional[float] = None
    """The worker's peak FLOP/s, None where it is not known."""

    collective_seconds: Optional[float] = None
    """Seconds in FSDP's all-gathers and reduce-scatters, None where they are not timed."""

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def per_second(self, value: Optional[float]) -> Optional[float]:
        """``value`` over the window's seconds; None without a value or a measured time."""
        return value / self.seconds if value is not None and self.seconds > 0 else None

    def per_step(self, value: Optional[float]) -> Optional[float]:
        """``value`` over the window's steps; None without a value or a step."""
        return value / self.steps if value is not None and self.steps else None

    def __add__(self, later: "Window") -> "Window":
        """These steps followed by ``later``'s: counts added, a figure unknown in either unknown."""
        if not self.steps:
            return later
        if not later.steps:
            return self
        tokens = _total([self.tokens, later.tokens])
        return Window(
            steps=self.steps + later.steps,
            samples=self.samples + later.samples,
            tokens=None if tokens is None else int(tokens),
            seconds=self.seconds + later.seconds,
            flops=_total([self.flops, later.flops]),
            peak_flops_per_second=later.peak_flops_per_second,
            collective_seconds=_total([self.collective_seconds, later.collective_seconds]),
        )


def combine(windows: Sequence[Window]) -> Dict[str, Optional[float]]:
    """
    The throughput of every worker's ``windows`` (one per worker, over the same steps):

    - ``samples_per_second``: the sum over workers of their samples over their own seconds;
    - ``step_time_s``: seconds per step of the slowest worker, which sets the pace;
    - ``tokens_per_step``: the tokens of one step, all workers together (None without tokens),
      and ``tokens_per_second`` = ``tokens_per_step / step_time_s``;
    - ``model_flops_per_step``: every worker's model FLOPs of one step, and
      ``model_flops_per_second`` = ``model_flops_per_step / step_time_s``;
    - ``mfu``: ``model_flops_per_second`` over the sum of the workers' peaks (None where a peak
      is unknown);
    - ``collective_time_s``: seconds per step in collectives, slowest worker (None where not timed).
    """
    steps = max((w.steps for w in windows), default=0)
    step_time = max((w.per_step(w.seconds) or 0.0 for w in windows), default=0.0)
    per_step = Window(steps=steps).per_step
    per_second = Window(seconds=step_time).per_second
    tokens = per_step(_total([w.tokens for w in windows]))
    flops = per_step(_total([w.flops for w in windows]))
    collective = [w.per_step(w.collective_seconds) for w in windows]
    return {
        "samples_per_second": sum(w.samples / w.seconds for w in windows if w.seconds > 0),
        "step_time_s": step_time if step_time > 0 else None,
        "tokens_per_step": tokens,
        "tokens_per_second": per_second(tokens),
        "model_flops_per_step": flops,
        "model_flops_per_second": per_second(flops),
        "mfu": mfu(per_second(flops), _total([w.peak_flops_per_second for w in windows])),
        "collective_time_s": _slowest(collective),
    }


def worker_figures(window: Window) -> Dict[str, Optional[float]]:
    """One worker's own samples/s, tokens/s, MFU and seconds per step in collectives."""
    return {
        "samples_per_second": window.per_second(float(window.samples)),
        "tokens_per_second": window.per_second(None if window.tokens is None else float(window.tokens)),
        "mfu": mfu(window.per_second(window.flops), window.peak_flops_per_second),
        "collective_time_s": window.per_step(window.collective_seconds),
    }
