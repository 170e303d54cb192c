"""
Progress as lines where the output is no terminal (a log file, a scheduler's output, a pipe):
Tango's progress bars redraw themselves with carriage returns, which a file keeps as one run of
overwritten bars; instead, the writing worker prints one line per ``log_every`` steps (Tango's rule
of logged steps) with the loss and throughput of all workers, and one per validation, and Tango's
bars are turned off in that worker (patch T9). A terminal keeps Tango's bar.
"""

import sys
import time
import weakref
from typing import IO, Any, List, Optional

from .core import RankWindows, WorkerTelemetry, is_logged
from .figures import combine
from .record import StepRecord, mean_loss

__all__ = ["ProgressLines", "attach_progress_lines", "progress_as_lines"]

#: The readers attached, by telemetry: one per worker's training run.
_attached: "weakref.WeakKeyDictionary[WorkerTelemetry, ProgressLines]" = weakref.WeakKeyDictionary()


def progress_as_lines(stream: Optional[IO[str]] = None) -> bool:
    """Whether progress goes out as lines: the standard error (``stream``) is no terminal."""
    stream = sys.stderr if stream is None else stream
    if stream is None:
        return False
    try:
        return not stream.isatty()
    except (AttributeError, ValueError):  # closed, or no file at all
        return False


class ProgressLines:
    """
    A reader of every worker's records (on a writing worker) that prints a line to ``stream`` on
    each step Tango logs (``log_every``): ``Training step 40/500 (8%): loss 0.1930, 1,234 tokens/s,
    31.2 samples/s, MFU 30.1 %, 0:00:12 elapsed``, the figures over the steps since the previous
    line (tokens/s only for batches with tokens, MFU where the peak is known); and one per validation.
    """

    waits_each_step = False
    final_wait_s = 30.0

    def __init__(self, train_config: Any, stream: Optional[IO[str]] = None) -> None:
        self.log_every = max(1, int(getattr(train_config, "log_every", 1) or 1))
        self.train_steps: Optional[int] = getattr(train_config, "train_steps", None)
        self.val_metric_name = getattr(train_config, "val_metric_name", "loss")
        self.stream = stream
        self._windows = RankWindows()
        self._start = time.monotonic()

    def receive(self, records: List[StepRecord]) -> None:
        """Every worker's record of one step, validation or end (see :class:`~.core.Reader`)."""
        own = min(records, key=lambda record: record.rank)
        if own.kind == "train":
            self._windows.add(records)
            if is_logged(own.step - 1, self.log_every, self.train_steps):
                self._write(self._train_line(records, own))
        elif own.kind == "validation" and own.val_metric is not None:
            best = f" (best {own.best_val_metric:.4g})" if own.best_val_metric is not None else ""
            self._write(
                f"Validation after step {own.step}: val_{self.val_metric_name} {own.val_metric:.4g}{best}"
            )

    def _train_line(self, records: List[StepRecord], own: StepRecord) -> str:
        figures = combine(list(self._windows.take().values()))
        of = f"/{self.train_steps} ({100 * own.step / self.train_steps:.0f}%)" if self.train_steps else ""
        parts = []
        loss = mean_loss(records, own)
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if figures["tokens_per_second"] is not None:
            parts.append(f"{figures['tokens_per_second']:,.0f} tokens/s")
        parts.append(f"{figures['samples_per_second'] or 0.0:,.1f} samples/s")
        if figures["mfu"] is not None:
            parts.append(f"MFU {100 * figures['mfu']:.3g} %")
        elapsed = int(time.monotonic() - self._start)
        parts.append(f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d} elapsed")
        return f"Training step {own.step}{of}: {', '.join(parts)}"

    def _write(self, line: str) -> None:
        stream = sys.stderr if self.stream is None else self.stream
        stream.write(line + "\n")
        stream.flush()


def attach_progress_lines(telemetry: WorkerTelemetry, stream: Optional[IO[str]] = None) -> None:
    """
    On a writing worker whose standard error (``stream``) is no terminal: print progress as lines
    (:class:`ProgressLines`, once per run) and turn Tango's progress bars off in this process (T9).
    """
    if not telemetry.writes or telemetry in _attached or not progress_as_lines(stream):
        return
    from .. import compat  # when called: the integration boundary is not the telemetry's to import early

    compat.progress_bars_off()
    _attached[telemetry] = reader = ProgressLines(telemetry.train_config, stream)
    telemetry.subscribe(reader)
    # Said at once, where the bar would appear: the first step's line comes only once it ends.
    steps = f"{reader.train_steps} steps" if reader.train_steps else "training"
    reader._write(
        f"Training: {steps} on {telemetry.world_size} worker(s), a line every {reader.log_every} "
        "step(s) (standard error is no terminal: lines, not a progress bar)"
    )
