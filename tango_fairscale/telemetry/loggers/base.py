"""
:class:`RankZeroLogger`: what the ``fairscale::wandb`` and ``fairscale::tensorboard`` callbacks
share. Every worker measures its own figures and sends them to global rank 0 through the step
telemetry (:mod:`tango_fairscale.telemetry`: one record per step per worker, through the run's
rendezvous store, never a collective, so no worker ever waits for another because of a logger and
a worker that dies leaves rank 0 logging on); global rank 0 alone writes, one row per logged step,
with every worker's figures in it.

A logging service may hold back what it was given (W&B's service process writes its rows a moment
later, and a killed run loses them). For such a service rank 0 also appends each row to a journal
(a JSON-lines file, flushed per row) that a rerun uses to write again the rows the service lost,
up to the checkpoint the rerun resumes from: those steps are not trained again, so no other copy
of their rows exists.
"""

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from tango.common.exceptions import ConfigurationError

from ..callback import TelemetryCallback
from ..callbacks import check_peak_tflops, check_whole_number
from ..core import RankWindows, is_logged
from ..figures import finite, worker_figures
from ..record import StepRecord, mean_loss, train_figures

__all__ = ["RankZeroLogger"]


def require(package: str, name: str) -> None:
    """The optional ``package`` that logger ``name`` writes with, or a one-line error: how to install it."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ConfigurationError(
            f"{name} needs the {package} package, which is not installed: "
            "pip install 'tango-fairscale[loggers]'"
        )


class RankZeroLogger(TelemetryCallback):
    """
    A callback whose global rank 0 writes one row per logged step to a logging service (see the
    module docstring for how the other workers' figures get there). Subclasses implement
    :meth:`open`, :meth:`write` and :meth:`close`, which run on global rank 0 only, and name the
    package they write with in :attr:`REQUIRES`.

    A row holds, under ``train/``: ``loss`` (averaged over the workers), ``lr``,
    ``samples_per_second``, ``step_time_s``, ``tokens_per_step``, ``tokens_per_second``,
    ``model_flops_per_step``, ``model_flops_per_second``, ``mfu``, ``collective_time_s`` and
    ``peak_memory_mib``, as in the metrics log (:class:`~tango_fairscale.telemetry.metrics.MetricsLog`);
    under ``worker<N>/`` each worker's ``peak_memory_mib``, ``samples_per_second``,
    ``tokens_per_second``, ``mfu`` and ``collective_time_s``; after a validation, under ``val/``,
    Tango's validation metric and the best so far. Figures that are not known (MFU on a GPU the
    table lacks, tokens of batches without any) are left out of the row.

    :param every: Write a row every this many steps, and for the first and the last step.
        Default: the step's ``log_every``.
    :param peak_tflops: Each worker's peak in TFLOP/s for MFU, instead of the table of GPUs or
        the measurement on CPU workers.
    :param final_wait_s: At the end of training (and before each checkpoint), seconds rank 0 waits
        for the other workers' figures before it writes the rows without them.
    """

    #: The registered name, for messages.
    NAME = "fairscale::logger"
    #: The optional package global rank 0 writes with (checked when the callback is built there).
    REQUIRES: Optional[str] = None

    @classmethod
    def check_options(cls, options: Mapping[str, Any], train_steps: Optional[int] = None) -> None:
        """
        The rules on the constructor's options, by name (an absent one: its default), applied by the
        constructor and by pre-flight (:func:`tango_fairscale.preflight.check_callbacks`) before any
        worker starts. Subclasses add their own options' rules.
        """
        check_whole_number(cls.NAME, "every", options.get("every"), 1)
        check_peak_tflops(cls.NAME, options.get("peak_tflops"))
        wait = options.get("final_wait_s")
        seconds = isinstance(wait, (int, float)) and not isinstance(wait, bool)
        if wait is not None and not (seconds and wait >= 0):  # NaN is not >= 0 either
            raise ConfigurationError(f"{cls.NAME}: final_wait_s must be seconds, 0 or more, got {wait!r}.")

    def __init__(
        self,
        *args: Any,
        every: Optional[int] = None,
        peak_tflops: Optional[float] = None,
        final_wait_s: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.check_options({"every": every, "peak_tflops": peak_tflops, "final_wait_s": final_wait_s})
        if self.writes and self.REQUIRES is not None:
            require(self.REQUIRES, self.NAME)
        self.every = every if every is not None else max(1, self.train_config.log_every)
        self.final_wait_s = final_wait_s
        self.telemetry.set_peak_tflops(peak_tflops)
        self.rank = self.telemetry.rank
        self.world_size = self.telemetry.world_size
        self._opened = False
        self._write_from = 0  # rows of earlier steps are already written (by an earlier run)
        self._windows = RankWindows()  # each worker's figures since the previous row
        # A step's row, kept while its validation's record waits to be read (its values join it).
        self._held: Optional[Tuple[int, Dict[str, Any]]] = None

    @property
    def writes(self) -> bool:
        """Whether this worker writes the rows: global rank 0."""
        return self.telemetry.rank == 0

    # --- for subclasses -------------------------------------------------------------------------

    def open(self, first_step: int) -> int:
        """
        Start writing (global rank 0), before the run's first step, which continues after
        ``first_step`` steps done. Returns the last step (1-based) whose rows the service holds
        already (0 for none): earlier runs wrote them. Rows up to it are not written again; rows
        after it up to ``first_step`` are written from the journal, if there is one.
        """
        raise NotImplementedError

    def journal_path(self) -> Optional[Path]:
        """The journal of written rows (see the module docstring), or None for a service that
        keeps every row it was given when the process is killed."""
        return None

    def write(self, step: int, row: Dict[str, float]) -> None:
        """Write ``row`` as step ``step`` (1-based; called in increasing order of steps)."""
        raise NotImplementedError

    def close(self) -> None:
        """Finish writing (end of training)."""
        raise NotImplementedError

    # --- Tango's hooks ----------------------------------------------------------------------------

    def pre_batch(self, step: int, epoch: int, batch: List[Dict[str, Any]]) -> None:
        if self.writes and not self._opened:
            held = self.open(step)
            self._opened = True
            self._replay(held, step)
            self._write_from = max(held, step) + 1
        super().pre_batch(step, epoch, batch)

    def post_train_loop(self, step: int, epoch: int) -> None:
        super().post_train_loop(step, epoch)
        if self._opened:
            self._release()
            self.close()
            self._opened = False

    def state_dict(self) -> Dict[str, Any]:
        """Every row up to this step is written (and journaled) before Tango saves the checkpoint."""
        state = super().state_dict()
        self._release()
        return state

    # --- global rank 0: the rows --------------------------------------------------------------------

    def receive(self, records: List[StepRecord]) -> None:
        """A logged step's row, a validation's values (in the step's row where it waits), in step order."""
        own = self.own(records)
        if own.kind == "train":
            self._release()
            self._windows.add(records)
            if is_logged(own.step - 1, self.every, self.train_config.train_steps):
                self._held = (own.step, self._row(records, own))
                if not self.telemetry.has_queued("validation", own.step):
                    self._release()
        elif own.kind == "validation":
            name = self.train_config.val_metric_name
            values = {f"val/{name}": own.val_metric, f"val/best_{name}": own.best_val_metric}
            if self._held is not None and self._held[0] == own.step:
                self._held[1].update(values)
            else:
                self._release()
                self._held = (own.step, values)
            self._release()
        else:
            self._release()

    def _row(self, records: List[StepRecord], own: StepRecord) -> Dict[str, Any]:
        windows = self._windows.take()
        row: Dict[str, Any] = {"train/lr": own.lr, "train/loss": mean_loss(records, own)}
        for key, value in train_figures(records, list(windows.values())).items():
            row[f"train/{key}"] = value
        for record in records:
            prefix = f"worker{record.rank}/"
            row[prefix + "peak_memory_mib"] = record.peak_memory_mib
            for key, value in worker_figures(windows[record.rank]).items():
                row[prefix + key] = value
        return row

    def _release(self) -> None:
        """Write the row kept for its validation, if any, leaving out the figures that are not known."""
        held, self._held = self._held, None
        if held is None or held[0] < self._write_from:
            return
        step, row = held
        self._emit(step, {key: number for key, value in row.items() if (number := finite(value)) is not None})

    def _replay(self, held: int, steps_done: int) -> None:
        """
        Write the journal's rows of steps ``held + 1`` to ``steps_done`` (which the service lost
        and this run does not redo), then keep only the journal's rows up to ``steps_done``.
        """
        path = self.journal_path()
        if path is None or not path.exists():
            return
        kept = []
        for text in path.read_text().splitlines():
            try:
                entry = json.loads(text)
                step, row = int(entry["step"]), entry["row"]
            except (ValueError, KeyError, TypeError):
                continue  # the torn end of a killed run
            if step > steps_done:
                continue  # redone by this run
            kept.append(text + "\n")
            if step > held:
                self.write(step, row)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text("".join(kept))
        os.replace(temporary, path)

    def _emit(self, step: int, row: Dict[str, float]) -> None:
        """Write a row, and append it to the journal first (if any)."""
        path = self.journal_path()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as handle:
                handle.write(json.dumps({"step": step, "row": row}) + "\n")
                handle.flush()
        self.write(step, row)
