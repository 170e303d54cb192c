"""
:class:`MemoryCallback`: peak memory and throughput of every training worker, registered as
the ``torch::train`` callback ``"fairscale::memory"``.
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

from .checkpointing import random_state

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

    @property
    def samples_per_second(self) -> float:
        """``samples / train_seconds``, or 0.0 before any step has finished."""
        return self.samples / self.train_seconds if self.train_seconds > 0 else 0.0

    def as_dict(self) -> Dict[str, Any]:
        """The fields, and ``samples_per_second``, as a JSON-friendly dict."""
        return {**asdict(self), "samples_per_second": self.samples_per_second}


def format_summary(stats: Sequence[WorkerStats]) -> str:
    """
    A plain-text table with one row per worker (peak memory in MiB, samples/s, steps) and,
    for more than one worker, a total row: the highest peak memory, and the summed samples/s,
    which is the throughput of the whole run.
    """
    header = ("worker", "device", "peak memory (MiB)", "samples/s", "steps")
    rows = [
        (str(s.worker), s.device, f"{s.peak_memory_mib:.1f}", f"{s.samples_per_second:.1f}", str(s.steps))
        for s in sorted(stats, key=lambda s: s.worker)
    ]
    if len(rows) > 1:
        rows.append(
            (
                "all",
                "",
                f"{max(s.peak_memory_mib for s in stats):.1f}",
                f"{sum(s.samples_per_second for s in stats):.1f}",
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
    steps, validation loops left out; the first step's one-off setup is included.

    Add it to a ``torch::train`` step with ``callbacks: [{type: "fairscale::memory"}]``.
    The periodic lines are logged at INFO level (``tango --log-level info run ...``); the final
    table is printed whatever the log level.

    :param log_every:
        Log this worker's numbers every this many training steps. Default: the step's
        ``log_every``. ``0`` logs nothing until the summary.
    """

    def __init__(self, *args: Any, log_every: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if log_every is not None and log_every < 0:
            raise ValueError(f"fairscale::memory: log_every must be >= 0, got {log_every}")
        self.log_every = self.train_config.log_every if log_every is None else log_every
        self.samples = 0
        self.steps = 0
        self.train_seconds = 0.0
        self._step_started: Optional[float] = None
        self._step_samples = 0

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
        )

    def _finish_step(self) -> None:
        # A step ends where the next one starts, so the optimizer step and the loading of the
        # next batch count; a validation loop or the end of training also ends it.
        if self._step_started is None:
            return
        self.train_seconds += time.perf_counter() - self._step_started
        self.samples += self._step_samples
        self.steps += 1
        self._step_started = None

    def pre_batch(self, step: int, epoch: int, batch: List[Dict[str, Any]]) -> None:
        """Starts timing the step and counts the samples of its micro-batches."""
        self._finish_step()
        self._step_samples = sum(_batch_size(micro_batch) for micro_batch in batch)
        self._step_started = time.perf_counter()

    def post_batch(
        self, step: int, epoch: int, batch_loss: float, batch_outputs: List[Dict[str, Any]]
    ) -> None:
        """Logs this worker's numbers every ``log_every`` steps."""
        if self.log_every and (step + 1) % self.log_every == 0:
            stats = self.stats()
            # Throughput up to the previous step: this one's optimizer step has not run yet.
            self.logger.info(
                "worker %d (%s), step %d: peak memory %.1f MiB, %.1f samples/s",
                stats.worker,
                stats.device,
                step + 1,
                stats.peak_memory_mib,
                stats.samples_per_second,
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
        """The counters, so that a resumed run's samples/s covers the steps before the restart too."""
        return {"samples": self.samples, "steps": self.steps, "train_seconds": self.train_seconds}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores the counters saved by :meth:`state_dict`."""
        self.samples = state_dict.get("samples", 0)
        self.steps = state_dict.get("steps", 0)
        self.train_seconds = state_dict.get("train_seconds", 0.0)


def _batch_size(micro_batch: Any) -> int:
    """The number of samples in a collated micro-batch: the first dimension of its first tensor."""
    if isinstance(micro_batch, torch.Tensor):
        return micro_batch.size(0) if micro_batch.dim() else 1
    if isinstance(micro_batch, dict):
        values = micro_batch.values()
    elif isinstance(micro_batch, (list, tuple)):
        values = micro_batch  # type: ignore[assignment]
    else:
        return 0
    for value in values:
        size = _batch_size(value)
        if size:
            return size
    return 0


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
