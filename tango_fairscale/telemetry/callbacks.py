"""
:class:`MemoryCallback`: peak memory and throughput (samples/s, tokens/s, MFU, time in
collectives) of every training worker, registered as the ``torch::train`` callback
``"fairscale::memory"``.
"""

import json
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import TrainCallback

from ..checkpointing import random_state
from .callback import TelemetryCallback
from .core import peak_memory_mib
from .figures import Window, mfu, worker_figures
from .record import StepRecord

__all__ = ["MemoryCallback", "WorkerStats", "format_summary", "peak_memory_mib"]

#: The file, in the training step's work directory, that the summary is also written to.
SUMMARY_FILE_NAME = "memory_summary.json"


#: The largest ``peak_tflops`` a callback takes: 1 EFLOP/s per worker, far above any accelerator.
MAX_PEAK_TFLOPS = 1e6


def _number(value: object) -> str:
    """``value`` as a config gave it; a large number in short form (jsonnet makes 1e308 an integer)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}" if abs(value) >= 1e6 else repr(value)
    return repr(value)


def check_peak_tflops(owner: str, value: Any) -> None:
    """A callback's ``peak_tflops``: unset, or one worker's peak in TFLOP/s (a finite MFU's denominator)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_PEAK_TFLOPS:
        raise ConfigurationError(
            f"{owner}: peak_tflops must be one worker's peak in TFLOP/s, above 0 and at most "
            f"{MAX_PEAK_TFLOPS:g}, got {_number(value)}. Remove it to take the peak from the table of GPUs "
            "(or the measurement on CPU workers)."
        )


def check_whole_number(owner: str, name: str, value: Any, least: int) -> None:
    """A callback's whole-number option: unset, or an ``int`` of at least ``least``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
        raise ConfigurationError(f"{owner}: {name} must be a whole number, {least} or more, got {value!r}.")


@dataclass
class WorkerStats:
    """What :class:`MemoryCallback` measured on one worker."""

    worker: int
    """The worker's rank."""

    device: str
    """The worker's device, e.g. ``"cpu"`` or ``"cuda:0"``."""

    peak_memory_mib: float
    """See :func:`peak_memory_mib`."""

    samples: int
    """Training samples this worker processed (its share of each global batch)."""

    steps: int
    """Training steps this worker took."""

    train_seconds: float
    """Wall time of those training steps: data loading, forward, backward and optimizer step."""

    tokens: Optional[int] = None
    """Tokens of those samples (see :func:`~tango_fairscale.telemetry.tokens.count_tokens`); None for
    batches without ``input_ids`` or ``attention_mask``."""

    flops: Optional[float] = None
    """Model FLOPs of those steps (see :class:`~tango_fairscale.telemetry.flops.FlopMeter`)."""

    peak_flops_per_second: Optional[float] = None
    """The worker's peak FLOP/s (table of GPUs, or measured on CPU workers); None where unknown."""

    collective_seconds: Optional[float] = None
    """Seconds of those steps in FSDP's all-gathers and reduce-scatters; None where not timed."""

    @classmethod
    def of(cls, record: StepRecord) -> "WorkerStats":
        """A worker's figures from its ``"end"`` record: every training step of the run."""
        totals = {name: getattr(record.window, field) for name, field in _WINDOW_FIELDS.items()}
        return cls(worker=record.rank, device=record.device, peak_memory_mib=record.peak_memory_mib, **totals)

    def window(self) -> Window:
        """These figures as the telemetry's :class:`~tango_fairscale.telemetry.figures.Window`."""
        return Window(**{field: getattr(self, name) for name, field in _WINDOW_FIELDS.items()})

    @property
    def samples_per_second(self) -> float:
        """``samples / train_seconds``, or 0.0 before any step has finished."""
        return worker_figures(self.window())["samples_per_second"] or 0.0

    @property
    def tokens_per_second(self) -> Optional[float]:
        """``tokens / train_seconds``; None without tokens or before any step has finished."""
        return worker_figures(self.window())["tokens_per_second"]

    @property
    def flops_per_second(self) -> Optional[float]:
        """``flops / train_seconds``; None before the FLOPs are counted."""
        return self.window().per_second(self.flops)

    @property
    def mfu(self) -> Optional[float]:
        """Model FLOPs utilisation, ``flops_per_second / peak_flops_per_second``; None if one is unknown."""
        return worker_figures(self.window())["mfu"]

    @property
    def collective_seconds_per_step(self) -> Optional[float]:
        return worker_figures(self.window())["collective_time_s"]

    def as_dict(self) -> Dict[str, Any]:
        """The fields and the rates derived from them, as a JSON-friendly dict."""
        return {
            **asdict(self),
            "samples_per_second": self.samples_per_second,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "collective_seconds_per_step": self.collective_seconds_per_step,
        }


#: :class:`WorkerStats`' names of the fields of a :class:`~tango_fairscale.telemetry.figures.Window`.
_WINDOW_FIELDS = {
    "steps": "steps",
    "samples": "samples",
    "tokens": "tokens",
    "train_seconds": "seconds",
    "flops": "flops",
    "peak_flops_per_second": "peak_flops_per_second",
    "collective_seconds": "collective_seconds",
}
#: The counters :meth:`MemoryCallback.state_dict` saves (a checkpoint's format: kept as it was).
_STATE_FIELDS = ("samples", "steps", "train_seconds", "tokens", "flops", "collective_seconds")


def _optional(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _percent(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def format_summary(stats: Sequence[WorkerStats]) -> str:
    """
    A plain-text table with one row per worker (peak memory in MiB, samples/s, tokens/s, MFU,
    seconds per step in collectives, steps) and, for more than one worker, a total row: the
    highest peak memory, the summed samples/s and tokens/s, which are the throughput of the whole
    run, the MFU of all workers together (their FLOP/s over their peaks) and the slowest worker's
    time in collectives. ``-`` where a figure is not known.
    """
    header = (
        "worker",
        "device",
        "peak memory (MiB)",
        "samples/s",
        "tokens/s",
        "MFU",
        "collectives (s/step)",
        "steps",
    )
    rows = [
        (
            str(s.worker),
            s.device,
            f"{s.peak_memory_mib:.1f}",
            f"{s.samples_per_second:.1f}",
            _optional(s.tokens_per_second, ".1f"),
            _percent(s.mfu),
            _optional(s.collective_seconds_per_step, ".3f"),
            str(s.steps),
        )
        for s in sorted(stats, key=lambda s: s.worker)
    ]
    if len(rows) > 1:
        rates = [s.tokens_per_second for s in stats]
        flops = [s.flops_per_second for s in stats]
        peaks = [s.peak_flops_per_second for s in stats]
        collectives = [s.collective_seconds_per_step for s in stats]
        rows.append(
            (
                "all",
                "",
                f"{max(s.peak_memory_mib for s in stats):.1f}",
                f"{sum(s.samples_per_second for s in stats):.1f}",
                _optional(None if None in rates else sum(r for r in rates if r is not None), ".1f"),
                _percent(
                    mfu(
                        None if None in flops else sum(f for f in flops if f is not None),
                        None if None in peaks else sum(p for p in peaks if p is not None),
                    )
                ),
                _optional(
                    None if None in collectives else max(c for c in collectives if c is not None), ".3f"
                ),
                str(max(s.steps for s in stats)),
            )
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        # Text columns left-aligned, numbers right-aligned.
        return "  ".join(
            cell.ljust(width) if i == 1 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths))
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    body = [line(header), rule, *(line(row) for row in rows[: len(stats)])]
    if len(rows) > len(stats):
        body += [rule, line(rows[-1])]
    return "\n".join(body)


@TrainCallback.register("fairscale::memory", exist_ok=True)
class MemoryCallback(TelemetryCallback):
    """
    Measures each worker's peak memory and training throughput, logs them every ``log_every``
    steps, and at the end of training prints a table with one row per worker on the main
    process (and writes it as JSON to ``memory_summary.json`` in the step's work directory).

    .. tip::
        Registered as a :class:`~tango.integrations.torch.TrainCallback` under the name
        "fairscale::memory".

    Peak memory is :func:`torch.cuda.max_memory_allocated` on GPU workers, and the peak
    resident set size of the worker process on CPU workers (see :func:`peak_memory_mib`).
    Samples/s counts the samples of this worker's batches over the wall time of its training
    steps, validation loops left out; the first step's one-off setup is included. Tokens/s, MFU
    and the seconds per step in collectives are those of the metrics log
    (:class:`~tango_fairscale.telemetry.metrics.MetricsLog`) for this worker, over the same time: tokens
    of batches with ``input_ids`` or an ``attention_mask``, model FLOPs counted on the run's first
    step, the peak from the table of GPUs or measured on CPU workers: the step telemetry's
    figures (:mod:`tango_fairscale.telemetry`), whose route brings every worker's to the main
    process at the end.

    Add it to a ``torch::train`` step with ``callbacks: [{type: "fairscale::memory"}]``.
    The periodic lines are logged at INFO level (``tango --log-level info run ...``); the final
    table is printed whatever the log level.

    :param log_every:
        Log this worker's numbers every this many training steps. Default: the step's
        ``log_every``. ``0`` logs nothing until the summary.
    :param peak_tflops:
        This worker's peak in TFLOP/s for MFU, instead of the table of GPUs or the measurement
        on CPU workers. Default: none.
    """

    NAME = "fairscale::memory"

    def __init__(
        self, *args: Any, log_every: Optional[int] = None, peak_tflops: Optional[float] = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.check_options({"log_every": log_every, "peak_tflops": peak_tflops})
        self.log_every = self.train_config.log_every if log_every is None else log_every
        self.telemetry.set_peak_tflops(peak_tflops)

    @classmethod
    def check_options(cls, options: Mapping[str, Any], train_steps: Optional[int] = None) -> None:
        """
        The constructor's options by name (absent: the default), in a worker and in pre-flight
        (:func:`tango_fairscale.preflight.check_callbacks`); ``train_steps`` is not needed here.
        """
        check_whole_number(cls.NAME, "log_every", options.get("log_every"), 0)
        check_peak_tflops(cls.NAME, options.get("peak_tflops"))

    @property
    def device(self) -> torch.device:
        """This worker's device."""
        return self.train_config.worker_local_default_device

    # This worker's counters over every training step (a resumed run's earlier ones included).

    @property
    def samples(self) -> int:
        return self.telemetry.totals.samples

    @property
    def steps(self) -> int:
        return self.telemetry.totals.steps

    @property
    def train_seconds(self) -> float:
        return self.telemetry.totals.seconds

    @property
    def tokens(self) -> Optional[int]:
        return self.telemetry.totals.tokens

    @property
    def flops(self) -> Optional[float]:
        return self.telemetry.totals.flops

    def stats(self) -> WorkerStats:
        """This worker's numbers so far."""
        totals = {name: getattr(self.telemetry.totals, field) for name, field in _WINDOW_FIELDS.items()}
        return WorkerStats(
            worker=self.telemetry.rank,
            device=str(self.device),
            peak_memory_mib=peak_memory_mib(self.device),
            **{**totals, "peak_flops_per_second": self.telemetry.peak().flops_per_second},
        )

    def post_batch(
        self, step: int, epoch: int, batch_loss: float, batch_outputs: List[Dict[str, Any]]
    ) -> None:
        """Logs this worker's numbers every ``log_every`` steps."""
        super().post_batch(step, epoch, batch_loss, batch_outputs)
        if self.log_every and (step + 1) % self.log_every == 0:
            stats = self.stats()
            # Throughput up to the previous step: this one's optimizer step has not run yet.
            self.logger.info(
                "worker %d (%s), step %d: peak memory %.1f MiB, %.1f samples/s, %s tokens/s, MFU %s, "
                "%s s/step in collectives",
                stats.worker,
                stats.device,
                step + 1,
                stats.peak_memory_mib,
                stats.samples_per_second,
                _optional(stats.tokens_per_second, ".1f"),
                _percent(stats.mfu),
                _optional(stats.collective_seconds_per_step, ".3f"),
            )

    def receive(self, records: List[StepRecord]) -> None:
        """
        At the end of training, on the main process: every worker's end record (its figures over
        every step), printed as the table and written to ``memory_summary.json``.
        """
        if self.own(records).kind != "end":
            return
        stats = [WorkerStats.of(record) for record in records]
        table = format_summary(stats)
        # print, not the logger: Tango logs only warnings unless --log-level is given, and this
        # table is what the callback is for.
        print(f"\nPer-worker memory and throughput (fairscale::memory):\n{table}\n", flush=True)
        summary = {"workers": [s.as_dict() for s in stats]}
        with open(self.work_dir / SUMMARY_FILE_NAME, "w") as handle:
            json.dump(summary, handle, indent=2)

    def state_dict(self) -> Dict[str, Any]:
        """The counters, so that a resumed run's rates cover the steps before the restart too."""
        super().state_dict()
        totals = self.telemetry.totals
        return {name: getattr(totals, _WINDOW_FIELDS[name]) for name in _STATE_FIELDS}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores the counters saved by :meth:`state_dict` (a checkpoint from before tokens were
        counted restores no tokens, FLOPs or collective time: those figures then stay unknown)."""
        defaults: Dict[str, Any] = {"samples": 0, "steps": 0, "train_seconds": 0.0, "collective_seconds": 0.0}
        restored: Dict[str, Any] = {
            _WINDOW_FIELDS[name]: state_dict.get(name, defaults.get(name)) for name in _STATE_FIELDS
        }
        self.telemetry.restore_totals(Window(**restored))


@TrainCallback.register("fairscale::restore_random_state")
class RestoreRandomState(TrainCallback):
    """
    Sets each worker's random generators to the state its checkpoint saved, right before the
    training loop. Added by the ``"fairscale"`` engine's step patch to every step that uses it;
    not meant for configs.

    Why here and not when the engine loads the checkpoint: after loading, ``torch::train`` catches
    the data loader up to the resume step, and every data loader iterator it creates on the way
    draws a seed from torch's generator. The uninterrupted run made those draws before it saved
    the state, so the state is exact only once the catching up is done, which is the moment
    ``pre_train_loop`` runs.
    """

    def pre_train_loop(self) -> None:
        state = getattr(self.training_engine, "loaded_random_state", None)
        if state is not None:
            random_state.restore(state)
