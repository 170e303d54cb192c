"""
:class:`RankZeroLogger`: what the ``fairscale::wandb`` and ``fairscale::tensorboard`` callbacks
share. Every worker measures its own figures (:class:`~tango_fairscale.throughput.WorkerMeter`,
as the metrics log does); global rank 0 alone writes, one row per logged step, with every
worker's figures in it.

The other workers' figures reach rank 0 through the run's rendezvous store (the TCP store that
the process group started from, on one host or across hosts), never through a collective: each
worker ``set``s its record of a step under a key of its own, and rank 0 looks for them without
waiting (``check``, then one ``multi_get``). A row is written once every worker's record of its
step is there; a row that waits longer than :data:`MAX_PENDING` logged steps, or is still waiting
when training ends (after up to ``final_wait_s``), is written with the records that arrived.
So no worker ever waits for another because of a logger, and a worker that dies leaves rank 0
logging on.

A logging service may hold back what it was given (W&B's service process writes its rows a moment
later, and a killed run loses them). For such a service rank 0 also appends each row to a journal
(a JSON-lines file, flushed per row) that a rerun uses to write again the rows the service lost,
up to the checkpoint the rerun resumes from: those steps are not trained again, so no other copy
of their rows exists.
"""

import json
import logging
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from tango.integrations.torch import TrainCallback

from ..callbacks import peak_memory_mib
from ..throughput import StepWindow, Window, combine, meter_for, worker_figures

logger = logging.getLogger(__name__)

__all__ = ["MAX_PENDING", "RankZeroLogger"]

#: Rows that may wait for other workers' records before the oldest is written without them.
MAX_PENDING = 32
#: Store slots per worker: records go round them, so the store holds at most this many per worker.
#: More than MAX_PENDING, so that rank 0 reads every record before its slot is reused.
SLOTS = 2 * MAX_PENDING


def _finite(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class _Mailbox:
    """Records from every worker to global rank 0 through the rendezvous store."""

    def __init__(self, address: str, port: int, prefix: str, world_size: int, rank: int) -> None:
        # A client of the store the process group started from: Tango's main process serves it on
        # one host, host 0 across hosts (tango_fairscale.launch). Its own connection, so that a
        # slow read here never delays the process group's use of the store.
        store = dist.TCPStore(
            address, port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False
        )
        self.store = dist.PrefixStore(prefix, store)
        self.world_size = world_size
        self.rank = rank
        self.sent = 0

    def send(self, record: Dict[str, Any]) -> None:
        index = self.sent
        self.sent += 1
        self.store.set(f"{self.rank}/{index % SLOTS}", json.dumps({**record, "index": index}))

    def receive(self, index: int, ranks: Sequence[int]) -> Dict[int, Dict[str, Any]]:
        """The records number ``index`` of ``ranks`` that have arrived (all of them or fewer)."""
        keys = [f"{rank}/{index % SLOTS}" for rank in ranks]
        if not keys:
            return {}
        if self.store.check(keys):
            values = self.store.multi_get(keys)  # all there: one round trip
        else:
            values = [self.store.get(key) for key in keys if self.store.check([key])]
        received: Dict[int, Dict[str, Any]] = {}
        for value in values:
            record = json.loads(value)
            if record.get("index") == index:  # an older record in the slot: this one is not there yet
                received[int(record["rank"])] = record
        return received


class RankZeroLogger(TrainCallback):
    """
    A callback whose global rank 0 writes one row per logged step to a logging service (see the
    module docstring for how the other workers' figures get there). Subclasses implement
    :meth:`open`, :meth:`write` and :meth:`close`, which run on global rank 0 only.

    A row holds, under ``train/``: ``loss`` (averaged over the workers), ``lr``,
    ``samples_per_second``, ``step_time_s``, ``tokens_per_step``, ``tokens_per_second``,
    ``model_flops_per_step``, ``model_flops_per_second``, ``mfu``, ``collective_time_s`` and
    ``peak_memory_mib``, as in the metrics log (:class:`~tango_fairscale.metrics.MetricsLog`);
    under ``worker<N>/`` each worker's ``peak_memory_mib``, ``samples_per_second``,
    ``tokens_per_second``, ``mfu`` and ``collective_time_s``; after a validation, under ``val/``,
    Tango's validation metric and the best so far. Figures that are not known (MFU on a GPU the
    table lacks, tokens of batches without any) are left out of the row.
    """

    #: The registered name, for messages and the store's keys.
    NAME = "fairscale::logger"

    def __init__(
        self,
        *args: Any,
        every: Optional[int] = None,
        peak_tflops: Optional[float] = None,
        final_wait_s: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if every is not None and every < 1:
            raise ValueError(f"{self.NAME}: every must be >= 1, got {every}")
        if peak_tflops is not None and not peak_tflops > 0:
            raise ValueError(f"{self.NAME}: peak_tflops must be positive, got {peak_tflops}")
        if not final_wait_s >= 0:
            raise ValueError(f"{self.NAME}: final_wait_s must be >= 0, got {final_wait_s}")
        self.every = every if every is not None else max(1, self.train_config.log_every)
        self.final_wait_s = final_wait_s
        self.meter = meter_for(self.train_config, self.training_engine)
        self.meter.set_peak(None if peak_tflops is None else peak_tflops * 1e12)
        self.rank = self.train_config.worker_id if self.train_config.is_distributed else 0
        self.world_size = self.train_config.world_size if self.train_config.is_distributed else 1
        self._mailbox: Optional[_Mailbox] = None
        self._first_step: Optional[int] = None
        self._write_from = 0  # rows of earlier steps are already written (by an earlier run)
        self._opened = False
        self._window = StepWindow(self.meter)  # this worker's figures since its previous record
        self._pending_step: Optional[int] = None
        self._pending_loss = 0.0
        self._lr: Optional[float] = None
        # Rank 0: rows waiting for the other workers' records, by record index.
        self._rows: Dict[int, Dict[str, Any]] = {}
        self._row_steps: Dict[int, int] = {}
        self._own: Dict[int, Dict[str, Any]] = {}
        self._next_index = 0
        self._val: Dict[int, Dict[str, float]] = {}
        self._late_warned = False

    @property
    def is_writer(self) -> bool:
        """Whether this worker writes the rows: global rank 0."""
        return self.rank == 0

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

    def pre_train_loop(self) -> None:
        self.meter.peak()
        if self.world_size > 1:
            config = self.train_config
            try:
                self._mailbox = _Mailbox(
                    config.distributed_address,
                    config.distributed_port,
                    f"tango_fairscale/{self.NAME}/",
                    self.world_size,
                    self.rank,
                )
            except Exception as error:  # noqa: BLE001 - a logger must not end the training
                logger.warning(
                    "%s: worker %d cannot reach the rendezvous store at %s:%s (%s); rank 0 logs "
                    "without this worker's figures",
                    self.NAME,
                    self.rank,
                    config.distributed_address,
                    config.distributed_port,
                    error,
                )

    def pre_batch(self, step: int, epoch: int, batch: List[Dict[str, Any]]) -> None:
        if self._first_step is None:
            self._first_step = step
            if self.is_writer:
                held = self.open(step)
                self._opened = True
                self._replay(held, step)
                self._write_from = max(held, step) + 1
        self._finish_window()
        self._window.start_step(step, batch)
        self._lr = self._current_lr()

    def post_batch(
        self, step: int, epoch: int, batch_loss: float, batch_outputs: List[Dict[str, Any]]
    ) -> None:
        self._window.end_forward_backward(step)
        self._pending_step = step
        self._pending_loss = batch_loss

    def pre_val_batch(self, step: int, val_step: int, epoch: int, val_batch: Dict[str, Any]) -> None:
        self._finish_window()
        self._window.pause()

    def post_val_loop(self, step: int, epoch: int, val_metric: float, best_val_metric: float) -> None:
        self._finish_window()
        self._window.pause()
        if self.is_writer:
            name = self.train_config.val_metric_name
            self._val[step + 1] = {f"val/{name}": val_metric, f"val/best_{name}": best_val_metric}
            self._drain(final=False)

    def post_train_loop(self, step: int, epoch: int) -> None:
        self._finish_window()
        if self.is_writer and self._opened:
            self._drain(final=True)
            self.close()

    def state_dict(self) -> Dict[str, Any]:
        """
        Sends this step's record, and on global rank 0 writes (and journals) every row up to it.
        Tango asks every callback for its state on every worker just before it saves a
        checkpoint: a run killed after that checkpoint resumes after this step and never redoes
        it, so its row must be written before the save (the other workers send theirs at the
        same point, so the wait is short).
        """
        self._finish_window()
        if self.is_writer and self._opened:
            self._drain(final=True)
        return super().state_dict()

    # --- every worker: its records -----------------------------------------------------------------

    def _should_log(self, step: int) -> bool:
        last = self.train_config.train_steps
        return step == 0 or (step + 1) % self.every == 0 or (last is not None and step == last - 1)

    def _finish_window(self) -> None:
        """After a step's optimizer step: its record (on log steps), sent or kept for the row."""
        step, self._pending_step = self._pending_step, None
        if step is None or not self._should_log(step):
            return
        window = self._window.close()
        record = {
            "rank": self.rank,
            "step": step + 1,
            "loss": self._pending_loss,
            "window": window.as_dict(),
            "peak_memory_mib": peak_memory_mib(self.train_config.worker_local_default_device),
        }
        if not self.is_writer:
            self._send(record)
            return
        index = self._next_index
        self._next_index += 1
        self._own[index] = record
        self._row_steps[index] = step + 1
        self._rows[index] = {"train/lr": self._lr} if self._lr is not None else {}
        self._drain(final=False)

    def _send(self, record: Dict[str, Any]) -> None:
        if self._mailbox is None:
            return
        try:
            self._mailbox.send(record)
        except Exception as error:  # noqa: BLE001 - a logger must not end the training
            logger.warning(
                "%s: worker %d cannot send its figures to worker 0 (%s)", self.NAME, self.rank, error
            )
            self._mailbox = None

    def _current_lr(self) -> Optional[float]:
        optimizer = getattr(self.training_engine, "optimizer", None)
        groups = getattr(optimizer, "param_groups", None)
        if not groups:
            return None
        value = groups[0].get("lr")
        if isinstance(value, torch.Tensor):
            return float(value.item())
        return _finite(value)

    # --- global rank 0: the rows --------------------------------------------------------------------

    def _drain(self, final: bool) -> None:
        """Write every row, oldest first, whose records are all there (or waited long enough)."""
        others = [rank for rank in range(self.world_size) if rank != 0]
        deadline = time.monotonic() + self.final_wait_s
        while self._rows:
            index = min(self._rows)
            received = self._receive(index, others)
            complete = len(received) == len(others)
            if not complete:
                if final and time.monotonic() < deadline and self._mailbox is not None:
                    time.sleep(0.05)
                    continue
                if not final and len(self._rows) <= MAX_PENDING:
                    return
                if not self._late_warned:
                    self._late_warned = True
                    missing = sorted(set(others) - set(received))
                    logger.warning(
                        "%s: step %d is written without the figures of worker(s) %s, which did not arrive",
                        self.NAME,
                        self._row_steps[index],
                        missing,
                    )
            self._write_row(index, [self._own.pop(index), *received.values()])
        # Validations of steps whose rows are written, or that have none (log steps apart).
        first_pending = min(self._row_steps.values(), default=None)
        for val_step in sorted(self._val):
            if first_pending is not None and val_step >= first_pending:
                break
            values = self._val.pop(val_step)
            if val_step >= self._write_from:
                self._emit(val_step, values)

    def _receive(self, index: int, others: List[int]) -> Dict[int, Dict[str, Any]]:
        if not others or self._mailbox is None:
            return {}
        try:
            return self._mailbox.receive(index, others)
        except Exception as error:  # noqa: BLE001 - a logger must not end the training
            logger.warning("%s: cannot read the other workers' figures (%s)", self.NAME, error)
            self._mailbox = None
            return {}

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

    def _write_row(self, index: int, records: List[Dict[str, Any]]) -> None:
        row = self._rows.pop(index)
        step = self._row_steps.pop(index)
        for val_step in sorted(s for s in self._val if s <= step):
            values = self._val.pop(val_step)
            if val_step == step:
                row.update(values)
            elif val_step >= self._write_from:
                # A validation after a step without a row (every > 1): its own, earlier row.
                self._emit(val_step, values)
        records.sort(key=lambda record: record["rank"])
        windows = [Window(**record["window"]) for record in records]
        # As Tango averages the loss: a float32 sum over the workers, divided by their number.
        losses = torch.tensor([record["loss"] for record in records], dtype=torch.float32)
        row["train/loss"] = losses.sum().item() / len(records)
        row["train/samples_per_second"] = sum(w.samples / w.seconds for w in windows if w.seconds > 0)
        for key, value in combine(windows).items():
            row[f"train/{key}"] = value
        row["train/peak_memory_mib"] = max(record["peak_memory_mib"] for record in records)
        for record, window in zip(records, windows):
            prefix = f"worker{record['rank']}/"
            row[prefix + "peak_memory_mib"] = record["peak_memory_mib"]
            for key, value in worker_figures(window).items():
                row[prefix + key] = value
        clean = {key: number for key, value in row.items() if (number := _finite(value)) is not None}
        if step >= self._write_from:
            self._emit(step, clean)
