"""
:class:`MemoryCallback`: peak memory and throughput (samples/s, tokens/s, MFU, time in
collectives) of every training worker, registered as the ``torch::train`` callback
``"fairscale::memory"``.
"""

import json
import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from tango.integrations.torch import TrainCallback

from . import throughput
from .checkpointing import random_state
from .cpu.timing import CollectiveTotals

__all__ = ["MemoryCallback", "WorkerStats", "format_summary", "peak_memory_mib"]

#: The file, in the training step's work directory, that the summary is also written to.
SUMMARY_FILE_NAME = "memory_summary.json"


def peak_memory_mib(device: torch.device) -> float:
    """
    The peak memory of this process so far, in MiB.

    On a CUDA device, the most memory that tensors have occupied on it
    (:func:`torch.cuda.max_memory_allocated`). Otherwise the peak resident set size of the
    process: the whole process (interpreter, libraries, data), not only tensors.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux but in bytes on macOS.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


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
    """Tokens of those samples (see :func:`~tango_fairscale.throughput.count_tokens`); None for
    batches without ``input_ids`` or ``attention_mask``."""

    flops: Optional[float] = None
    """Model FLOPs of those steps (see :class:`~tango_fairscale.throughput.WorkerMeter`)."""

    peak_flops_per_second: Optional[float] = None
    """The worker's peak FLOP/s (table of GPUs, or measured on CPU workers); None where unknown."""

    collective_seconds: Optional[float] = None
    """Seconds of those steps in FSDP's all-gathers and reduce-scatters; None where not timed."""

    @property
    def samples_per_second(self) -> float:
        """``samples / train_seconds``, or 0.0 before any step has finished."""
        return self.samples / self.train_seconds if self.train_seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> Optional[float]:
        """``tokens / train_seconds``; None without tokens or before any step has finished."""
        return (
            self.tokens / self.train_seconds if self.tokens is not None and self.train_seconds > 0 else None
        )

    @property
    def flops_per_second(self) -> Optional[float]:
        """``flops / train_seconds``; None before the FLOPs are counted."""
        return self.flops / self.train_seconds if self.flops is not None and self.train_seconds > 0 else None

    @property
    def mfu(self) -> Optional[float]:
        """Model FLOPs utilisation, ``flops_per_second / peak_flops_per_second``; None if one is unknown."""
        return throughput.mfu(self.flops_per_second, self.peak_flops_per_second)

    @property
    def collective_seconds_per_step(self) -> Optional[float]:
        return (
            self.collective_seconds / self.steps
            if self.collective_seconds is not None and self.steps
            else None
        )

    def as_dict(self) -> Dict[str, Any]:
        """The fields and the rates derived from them, as a JSON-friendly dict."""
        return {
            **asdict(self),
            "samples_per_second": self.samples_per_second,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "collective_seconds_per_step": self.collective_seconds_per_step,
        }


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
                    throughput.mfu(
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
class MemoryCallback(TrainCallback):
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
    (:class:`~tango_fairscale.metrics.MetricsLog`) for this worker, over the same time: tokens
    of batches with ``input_ids`` or an ``attention_mask``, model FLOPs counted on the run's first
    step, the peak from the table of GPUs or measured on CPU workers
    (:class:`~tango_fairscale.throughput.WorkerMeter`).

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

    def __init__(
        self, *args: Any, log_every: Optional[int] = None, peak_tflops: Optional[float] = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if log_every is not None and log_every < 0:
            raise ValueError(f"fairscale::memory: log_every must be >= 0, got {log_every}")
        if peak_tflops is not None and not peak_tflops > 0:
            raise ValueError(f"fairscale::memory: peak_tflops must be positive, got {peak_tflops}")
        self.log_every = self.train_config.log_every if log_every is None else log_every
        self.meter = throughput.meter_for(self.train_config, self.training_engine)
        self.meter.set_peak(None if peak_tflops is None else peak_tflops * 1e12)
        self.samples = 0
        self.steps = 0
        self.train_seconds = 0.0
        self.tokens: Optional[int] = 0
        self.flops: Optional[float] = 0.0
        self.collective_seconds = 0.0
        self._step_started: Optional[float] = None
        self._step_samples = 0
        self._step_tokens: Optional[int] = None
        self._step_flops: Optional[float] = None
        self._step_collectives: Optional[CollectiveTotals] = None

    @property
    def device(self) -> torch.device:
        """This worker's device."""
        return self.train_config.worker_local_default_device

    def stats(self) -> WorkerStats:
        """This worker's numbers so far."""
        return WorkerStats(
            worker=self.train_config.worker_id,
            device=str(self.device),
            peak_memory_mib=peak_memory_mib(self.device),
            samples=self.samples,
            steps=self.steps,
            train_seconds=self.train_seconds,
            tokens=self.tokens if self.steps else None,
            flops=self.flops if self.steps else None,
            peak_flops_per_second=self.meter.peak().flops_per_second,
            collective_seconds=self.collective_seconds if self.meter.collectives_timed() else None,
        )

    def _finish_step(self) -> None:
        # A step ends where the next one starts, so the optimizer step and the loading of the
        # next batch count; a validation loop or the end of training also ends it.
        if self._step_started is None:
            return
        self.train_seconds += time.perf_counter() - self._step_started
        self.samples += self._step_samples
        self.tokens = (
            None if self.tokens is None or self._step_tokens is None else self.tokens + self._step_tokens
        )
        self.flops = None if self.flops is None or self._step_flops is None else self.flops + self._step_flops
        if self._step_collectives is not None:
            self.collective_seconds += self.meter.collectives().since(self._step_collectives).total_seconds
        self.steps += 1
        self._step_started = None

    def pre_train_loop(self) -> None:
        """Finds this worker's peak FLOP/s: on CPU workers, all workers measure at once, as they train."""
        self.meter.peak()

    def pre_batch(self, step: int, epoch: int, batch: List[Dict[str, Any]]) -> None:
        """Starts timing the step and counts the samples and tokens of its micro-batches."""
        self._finish_step()
        self.meter.start_step(step, batch)
        self._step_samples = self.meter.step_samples()
        self._step_tokens = self.meter.step_tokens()
        self._step_flops = None
        self._step_collectives = self.meter.collectives()
        self._step_started = time.perf_counter()

    def post_batch(
        self, step: int, epoch: int, batch_loss: float, batch_outputs: List[Dict[str, Any]]
    ) -> None:
        """Logs this worker's numbers every ``log_every`` steps."""
        self.meter.end_forward_backward(step)
        self._step_flops = self.meter.step_flops()
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

    def pre_val_batch(self, step: int, val_step: int, epoch: int, val_batch: Dict[str, Any]) -> None:
        """Stops the clock for the validation loop."""
        self._finish_step()

    def post_train_loop(self, step: int, epoch: int) -> None:
        """
        Gathers every worker's numbers on the main process, which prints the table and writes
        ``memory_summary.json``. Every worker must get here: the gathering is a collective.
        """
        self._finish_step()
        local = self.stats()
        gathered: List[Optional[WorkerStats]]
        if self.train_config.is_distributed and dist.is_available() and dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        if not self.is_local_main_process:
            return
        stats = [s for s in gathered if s is not None]
        table = format_summary(stats)
        # print, not the logger: Tango logs only warnings unless --log-level is given, and this
        # table is what the callback is for.
        print(f"\nPer-worker memory and throughput (fairscale::memory):\n{table}\n", flush=True)
        summary = {"workers": [s.as_dict() for s in stats]}
        with open(self.work_dir / SUMMARY_FILE_NAME, "w") as handle:
            json.dump(summary, handle, indent=2)

    def state_dict(self) -> Dict[str, Any]:
        """The counters, so that a resumed run's rates cover the steps before the restart too."""
        return {
            "samples": self.samples,
            "steps": self.steps,
            "train_seconds": self.train_seconds,
            "tokens": self.tokens,
            "flops": self.flops,
            "collective_seconds": self.collective_seconds,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores the counters saved by :meth:`state_dict` (a checkpoint from before tokens were
        counted restores no tokens, FLOPs or collective time: those figures then stay unknown)."""
        self.samples = state_dict.get("samples", 0)
        self.steps = state_dict.get("steps", 0)
        self.train_seconds = state_dict.get("train_seconds", 0.0)
        self.tokens = state_dict.get("tokens")
        self.flops = state_dict.get("flops")
        self.collective_seconds = state_dict.get("collective_seconds", 0.0)


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
