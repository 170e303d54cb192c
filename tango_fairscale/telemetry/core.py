"""
The step telemetry's core: :class:`WorkerTelemetry`, one per worker and training run, which
measures each training step once, makes one :class:`~.record.StepRecord` of it, and sends it on
the one route to the workers that write: each host's first worker (the metrics log
``fairscale::metrics`` and the memory table ``fairscale::memory`` write there) and global rank 0
(the loggers ``fairscale::wandb`` and ``fairscale::tensorboard``). There the callbacks read every
worker's records of a step, step after step, in the order the workers made them.

The route is the run's rendezvous store (:class:`~.route.StoreRoute`, the TCP store the process
group started from, on one host or across hosts), never a collective: each worker ``set``s its
record under a key of its own and goes on, and a writer reads the others'. A collective would
make every worker wait for the slowest at every logged step (the loggers' rows must never hold
training up), and a worker that died would stop the logging with it; through the store the
workers that only send never wait, and a worker that dies leaves the writers writing.

A writer gives its callbacks a step's records once every worker's are there. Where a callback
writes each step as it ends (:attr:`Reader.waits_each_step`: the metrics log, whose lines a
crashed run keeps) it waits for them, up to :data:`STEP_WAIT_S`; otherwise it lets up to
:data:`MAX_PENDING` steps wait and gives the oldest with the records that came. Before a
checkpoint and at the end of training it waits for every record made so far (up to the longest
of its readers' :attr:`Reader.final_wait_s`): a run killed after the checkpoint never redoes
those steps, so their lines and rows must be written before it is saved.
"""

import logging
import resource
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from ..cpu.timing import COLLECTIVES, CollectiveTotals
from .figures import Window, scalar
from .flops import FlopMeter
from .peaks import Peak, dtype_name, find_peak
from .record import MeterInfo, StepRecord, Sums, by_rank, output_sums
from .route import StoreRoute
from .tokens import BatchCount, count_batch, describe_tokens

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_PENDING",
    "STEP_WAIT_S",
    "RankWindows",
    "Reader",
    "WorkerTelemetry",
    "is_logged",
    "peak_memory_mib",
    "telemetry_for",
]

#: Steps whose records a writer lets wait for other workers' before it gives the oldest without them.
MAX_PENDING = 32
#: Seconds a writer waits for the other workers' records of a step where a reader writes each step
#: as it ends; after one such wait runs out, it stops waiting between steps for the rest of the run.
STEP_WAIT_S = 30.0


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


def is_logged(step: int, every: int, train_steps: Optional[int]) -> bool:
    """Whether Tango's step ``step`` (0-based) gets a line: the first, every ``every``-th and the last
    (the rule of Tango's ``log_every``)."""
    return step == 0 or (step + 1) % every == 0 or (train_steps is not None and step == train_steps - 1)


class Reader(Protocol):
    """A callback that reads the records on a writing worker (:meth:`WorkerTelemetry.subscribe`)."""

    #: Whether it writes each step as the step ends: the writer then waits for the step's records.
    waits_each_step: bool
    #: Seconds the writer may wait for the records made so far before a checkpoint and at the end.
    final_wait_s: float

    def receive(self, records: List[StepRecord]) -> None:
        """Every worker's record of one step (or validation, or end), by rank; one call per step, in order."""


class RankWindows:
    """Each worker's :class:`~.figures.Window` since a reader's previous line, from the records it read."""

    def __init__(self) -> None:
        self._windows: Dict[int, Window] = {}

    def add(self, records: Sequence[StepRecord]) -> None:
        for record in records:
            self._windows[record.rank] = self._windows.get(record.rank, Window()) + record.window

    def take(self) -> Dict[int, Window]:
        """Every worker's window, by rank; the next line's start now."""
        windows, self._windows = dict(sorted(self._windows.items())), {}
        return windows


@dataclass
class _Step:
    """The training step under way on this worker, until its record is made."""

    index: int  # Tango's 0-based step index
    epoch: int
    batch: BatchCount
    lr: Optional[float]
    loss: Optional[float] = None
    mean_loss: Optional[float] = None
    outputs: Sums = field(default_factory=dict)
    backward_done: bool = False


@dataclass
class _Validation:
    """The validation loop under way on this worker: its batches' outputs so far."""

    step: int  # the Tango step index it follows
    epoch: int  # that step's epoch
    outputs: Sums = field(default_factory=dict)
    last_batch: int = -1


class WorkerTelemetry:
    """
    This worker's step telemetry for one training run, shared by the callbacks that read it
    (:func:`telemetry_for`). Every such callback calls the hook of the same name from each of its
    Tango hooks (:class:`~.callback.TelemetryCallback`); the first call for a step does the work.

    - Figures: samples and tokens of the step's batch (:func:`~.tokens.count_batch`), model FLOPs
      (:class:`~.flops.FlopMeter`), the peak (:func:`~.peaks.find_peak`, once, in the worker's
      compute dtype, unless a callback gives it), the wall time from the start of a step to the
      start of the next (a validation loop stops the clock), and the time in collectives
      (:data:`~tango_fairscale.cpu.timing.COLLECTIVES`, on CPU workers of the ``"fairscale"`` engine).
    - A step's record is made when its optimizer step is done: when the next step, a validation
      loop, a checkpoint or the end of training begins.
    """

    def __init__(self, train_config: Any, training_engine: Any) -> None:
        self.train_config = train_config
        self.training_engine = training_engine
        distributed = bool(train_config.is_distributed)
        self.rank: int = train_config.worker_id if distributed else 0
        self.world_size: int = train_config.world_size if distributed else 1
        #: Whether this worker gets every worker's records: each host's first worker.
        self.writes = bool(train_config.is_local_main_process)
        self.device = torch.device(train_config.worker_local_default_device)
        self.flops = FlopMeter()
        #: This worker's figures over every training step, those of earlier runs where restored.
        self.totals = Window()
        #: Tango's step index of the run's first step, once it began.
        self.first_step: Optional[int] = None
        self._given_peak: Optional[float] = None
        self._peak: Optional[Peak] = None
        self._token_source: Optional[str] = None
        self._step: Optional[_Step] = None
        self._clock: Optional[float] = None  # perf_counter() when the running step's time began
        self._mark: Optional[CollectiveTotals] = None  # the collectives' totals then
        self._described = False  # whether a record carried the run's MeterInfo
        self._validation: Optional[_Validation] = None
        self._validated: Optional[int] = None  # the step of the last validation record
        self._epoch = 0  # the epoch of the last step begun
        self._ended = False
        self._route: Optional[StoreRoute] = None
        self._route_tried = False
        # On the writing workers.
        self._readers: List[Reader] = []
        self._queue: Deque[StepRecord] = deque()  # own records whose step the readers have not read
        self._arrived: Dict[int, StepRecord] = {}  # the other workers' records of the queue's first
        self._gave_up_waiting = False
        self._late_warned = False
        # Told of each checkpoint before it is saved, by an engine that can (this package's).
        listeners = getattr(training_engine, "before_checkpoint", None)
        if isinstance(listeners, list):
            listeners.append(self.before_checkpoint)

    # --- set-up by the callbacks ------------------------------------------------------------------

    def set_peak_tflops(self, peak_tflops: Optional[float]) -> None:
        """A callback's ``peak_tflops``: the peak, instead of the table of GPUs or a measurement."""
        if peak_tflops is not None:
            self._given_peak = peak_tflops * 1e12

    def subscribe(self, reader: Reader) -> None:
        """On a writing worker: ``reader`` gets every step's records of all workers."""
        if reader not in self._readers:
            self._readers.append(reader)

    def restore_totals(self, totals: Window) -> None:
        """The figures of the steps of earlier runs (a callback's checkpointed state), before this run's."""
        self.totals = totals

    # --- Tango's hooks, from every reading callback -------------------------------------------------

    def pre_train_loop(self) -> None:
        """Finds the peak (on CPU workers, one per host, measured at once) and opens the route."""
        self.peak()
        self._open_route()

    def pre_batch(self, step: int, epoch: int, batch: Sequence[Any]) -> None:
        if self._step is not None and self._step.index == step:
            return
        self._finish()
        if self.first_step is None:
            self.first_step = step
            self._open_route()
        if self._clock is None:
            self._clock, self._mark = time.perf_counter(), COLLECTIVES.totals()
        self._epoch = epoch
        count = count_batch(batch)
        if count.tokens is not None:
            self._token_source = count.tokens.source
        self.flops.start(step, count)
        # Read before the optimizer step: the engine steps the LR scheduler right after it.
        self._step = _Step(step, epoch, count, lr=self._current_lr())
        self._deliver(final=False)

    def post_batch(self, step: int, batch_loss: float, batch_outputs: Sequence[Mapping[str, Any]]) -> None:
        current = self._step
        if current is None or current.index != step or current.backward_done:
            return
        self.flops.stop(step)
        current.loss, current.outputs, current.backward_done = batch_loss, output_sums(batch_outputs), True

    def log_batch(self, step: int, batch_loss: float) -> None:
        """Tango's loss averaged over the workers (this hook runs on Tango's log steps only)."""
        if self._step is not None and self._step.index == step:
            self._step.mean_loss = batch_loss

    def pre_val_batch(self, step: int, val_step: int) -> None:
        self._finish(stop_clock=True)
        if self._validation is None or self._validation.step != step:
            self._validation = _Validation(step, self._epoch)
        self._deliver(final=False)

    def post_val_batch(self, step: int, val_step: int, outputs: Mapping[str, Any]) -> None:
        validation = self._validation
        if validation is None or validation.step != step or validation.last_batch >= val_step:
            return
        validation.outputs = output_sums([outputs], validation.outputs)
        validation.last_batch = val_step

    def post_val_loop(self, step: int, epoch: int, val_metric: float, best_val_metric: float) -> None:
        self._finish(stop_clock=True)
        if self._validated == step:
            return
        self._validated = step
        outputs = self._validation.outputs if self._validation and self._validation.step == step else {}
        self._validation = None
        self._post(
            self._record(
                "validation",
                step + 1,
                epoch,
                outputs=outputs,
                val_metric=val_metric,
                best_val_metric=best_val_metric,
            )
        )
        self._deliver(final=False)

    def before_checkpoint(self, trainer_state: Mapping[str, Any]) -> None:
        """
        Tango saves the checkpoint of a step it validated before it calls ``post_val_loop``: a run
        killed in between resumed after that step, and its validation record was never made. When
        the step was validated, its record is made and read now, from the values Tango saves
        (``trainer_state``, the checkpoint's; an engine with a ``before_checkpoint`` list calls
        this before saving); ``post_val_loop`` then finds it made.
        """
        steps, validation = trainer_state.get("training_steps"), self._validation
        if not isinstance(steps, int) or validation is None or validation.step != steps - 1:
            return
        name = self.train_config.val_metric_name
        val_metric = trainer_state.get(f"val_{name}")
        if self._validated == validation.step or val_metric is None:
            return
        best = trainer_state.get(f"best_{name}", val_metric)  # set by Tango whenever it validates
        self.post_val_loop(validation.step, validation.epoch, val_metric, best)
        self._deliver(final=True)

    def baseline(self, val_metric: float, outputs: Sums) -> None:
        """
        The validation before the first step (``fairscale::validate_first``, from
        ``pre_train_loop``): a ``"baseline"`` record of step 0, of a kind of its own so that the
        readers that know Tango's validations only (the loggers, which open at the first step)
        pass it by. Opens the route: the callbacks that open it may come after in the list.
        """
        self._open_route()
        self._post(self._record("baseline", 0, 0, outputs=outputs, val_metric=val_metric))
        self._deliver(final=False)

    def checkpoint(self) -> None:
        """Tango saves a checkpoint: every record up to now is read before it (see the module docstring)."""
        self._finish()
        self._deliver(final=True)

    def post_train_loop(self, step: int, epoch: int) -> None:
        """The end of training: the last step's record, then the end record with :attr:`totals`."""
        if self._ended:
            return
        self._ended = True
        self._finish(stop_clock=True)
        self._post(self._record("end", step + 1, epoch, window=self.totals))
        self._deliver(final=True)

    # --- this worker's figures ----------------------------------------------------------------------

    def compute_dtype(self) -> torch.dtype:
        """The dtype the worker's matmuls run in: AMP's, else FSDP's mixed precision, else the parameters'."""
        engine = self.training_engine
        if getattr(engine, "amp", False) and isinstance(getattr(engine, "amp_dtype", None), torch.dtype):
            return engine.amp_dtype
        fsdp_config = getattr(engine, "fsdp_config", None)
        if fsdp_config is not None and getattr(fsdp_config, "mixed_precision", False):
            return fsdp_config.resolved_compute_dtype(self.device.type == "cpu")
        model = getattr(engine, "model", None)
        if isinstance(model, torch.nn.Module):
            for parameter in model.parameters():
                if parameter.is_floating_point():
                    return parameter.dtype
        return torch.float32

    def peak(self) -> Peak:
        """
        This worker's peak FLOP/s (measured on the first call on a CPU worker, ``pre_train_loop``
        on every worker: in a process group the host's workers measure together and share one).
        """
        if self._peak is None:
            hosts = getattr(self.train_config, "local_world_size", self.world_size)
            self._peak = find_peak(self.device, self.compute_dtype(), self._given_peak, hosts)
        return self._peak

    def collectives_timed(self) -> bool:
        """
        Whether this worker's FSDP collectives go through the timed rings: CPU workers of the
        ``"fairscale"`` engine, either backend (not DDP's all-reduces, not NCCL on GPUs).
        """
        from ..engine import FairScaleTrainingEngine

        return self.device.type == "cpu" and isinstance(self.training_engine, FairScaleTrainingEngine)

    def info(self) -> MeterInfo:
        """How this worker's figures are made (the metrics log's run line)."""
        peak = self.peak()
        if self.collectives_timed():
            collectives = (
                "wall time in FSDP's all-gathers and reduce-scatters (gloo rings), waiting for the "
                "other workers included"
            )
        elif self.device.type == "cuda":
            collectives = (
                "not measured on GPUs: NCCL runs them asynchronously on its own streams "
                "(see fairscale::profile for their kernels)"
            )
        else:
            collectives = "not measured: this engine's collectives do not go through the timed rings"
        return MeterInfo(
            device=str(self.device),
            compute_dtype=dtype_name(self.compute_dtype()),
            peak_flops_per_second=peak.flops_per_second,
            peak=peak.source,
            flops=self.flops.describe(),
            tokens=describe_tokens(self._token_source),
            collectives=collectives,
            counted=self.flops.counted(),
        )

    def has_queued(self, kind: str, step: int) -> bool:
        """Whether this worker's record ``kind`` of ``step`` (1-based) is made and not read yet."""
        return any(record.kind == kind and record.step == step for record in self._queue)

    def _current_lr(self) -> Optional[float]:
        optimizer = getattr(self.training_engine, "optimizer", None)
        groups = getattr(optimizer, "param_groups", None)
        return scalar(groups[0].get("lr")) if groups else None

    # --- records ------------------------------------------------------------------------------------

    def _record(self, kind: str, step: int, epoch: int, **values: Any) -> StepRecord:
        return StepRecord(
            rank=self.rank,
            kind=kind,
            step=step,
            epoch=epoch,
            device=str(self.device),
            peak_memory_mib=peak_memory_mib(self.device),
            **values,
        )

    def _finish(self, stop_clock: bool = False) -> None:
        """The running step's record, once its optimizer step is done (``stop_clock``: validation)."""
        current, self._step = self._step, None
        if current is None:
            if stop_clock:
                self._clock = self._mark = None
            return
        now, collectives = time.perf_counter(), COLLECTIVES.totals()
        seconds = now - self._clock if self._clock is not None else 0.0
        in_collectives = collectives.since(self._mark).total_seconds if self._mark is not None else 0.0
        self._clock, self._mark = (None, None) if stop_clock else (now, collectives)
        window = Window(
            steps=1,
            samples=current.batch.samples,
            tokens=current.batch.tokens.tokens if current.batch.tokens is not None else None,
            seconds=seconds,
            flops=self.flops.flops(current.index, current.batch) if current.backward_done else None,
            peak_flops_per_second=self.peak().flops_per_second,
            collective_seconds=in_collectives if self.collectives_timed() else None,
        )
        self.totals = self.totals + window
        info = None if self._described else self.info()
        self._described = True
        self._post(
            self._record(
                "train",
                current.index + 1,
                current.epoch,
                window=window,
                loss=current.loss,
                mean_loss=current.mean_loss,
                lr=current.lr,
                outputs=current.outputs,
                info=info,
            )
        )

    # --- the route ------------------------------------------------------------------------------------

    def _open_route(self) -> None:
        if self._route_tried or self.world_size == 1:
            return
        self._route_tried = True
        config = self.train_config
        try:
            self._route = StoreRoute(
                config.distributed_address,
                config.distributed_port,
                f"tango_fairscale/telemetry/{config.step_id}/",
                self.rank,
            )
        except Exception as error:  # noqa: BLE001 - telemetry must not end the training
            logger.warning(
                "step telemetry: worker %d cannot reach the rendezvous store at %s:%s (%s); its "
                "figures reach no other worker",
                self.rank,
                config.distributed_address,
                config.distributed_port,
                error,
            )

    def _lost_route(self, doing: str, error: Exception) -> None:
        logger.warning("step telemetry: worker %d cannot %s (%s)", self.rank, doing, error)
        self._route = None

    def _post(self, record: StepRecord) -> None:
        """Send ``record`` to the writing workers (and keep it for the readers here, on one)."""
        if self._route is not None:
            try:
                self._route.send(record.key, record.to_json())
            except Exception as error:  # noqa: BLE001 - telemetry must not end the training
                self._lost_route("send its figures to the writing workers", error)
        if self.writes and self._readers:
            self._queue.append(record)

    def _missing(self) -> List[int]:
        """The other workers whose record of the queue's first step has not arrived."""
        return [rank for rank in range(self.world_size) if rank != self.rank and rank not in self._arrived]

    def _collect(self, key: str, wait_s: float) -> None:
        """The other workers' records ``key`` that arrived, after waiting up to ``wait_s`` for them."""
        missing = self._missing()
        if not missing or self._route is None:
            return
        try:
            if wait_s > 0:
                self._route.wait(key, missing, wait_s)
            for rank, text in self._route.arrived(key, missing).items():
                self._arrived[rank] = StepRecord.from_json(text)
        except Exception as error:  # noqa: BLE001 - telemetry must not end the training
            self._lost_route("read the other workers' figures", error)

    def _deliver(self, final: bool) -> None:
        """Give the readers every queued step whose records are all there (or waited long enough)."""
        waits = final or (not self._gave_up_waiting and any(r.waits_each_step for r in self._readers))
        wait_s = max((r.final_wait_s for r in self._readers), default=0.0) if final else STEP_WAIT_S
        deadline = time.monotonic() + wait_s
        while self._queue:
            own = self._queue[0]
            self._collect(own.key, max(0.0, deadline - time.monotonic()) if waits else 0.0)
            missing = self._missing()
            if missing and self._route is not None:
                if not waits and len(self._queue) <= MAX_PENDING:
                    return
                self._gave_up_waiting = self._gave_up_waiting or (waits and not final)
                if not self._late_warned:
                    self._late_warned = True
                    logger.warning(
                        "step telemetry: %s %d is written without the figures of worker(s) %s, "
                        "which did not arrive in time",
                        own.kind,
                        own.step,
                        missing,
                    )
            self._queue.popleft()
            records = by_rank([own, *self._arrived.values()])
            self._arrived = {}
            for reader in self._readers:
                reader.receive(records)


#: id(train_config) -> (a weak reference to it, its telemetry). TrainConfig is an unhashable
#: dataclass, so it cannot key a WeakKeyDictionary; the weak reference tells a reused id apart.
_telemetry: Dict[int, Tuple["weakref.ref[Any]", WorkerTelemetry]] = {}
_telemetry_lock = threading.Lock()


def telemetry_for(train_config: Any, training_engine: Any) -> WorkerTelemetry:
    """
    The :class:`WorkerTelemetry` of this training run in this worker, one per ``train_config``
    (Tango gives every callback of a run the same one), so that the callbacks share one
    measurement, one FLOP count, one peak and one route.
    """
    with _telemetry_lock:
        for key in [key for key, (ref, _) in _telemetry.items() if ref() is None]:
            del _telemetry[key]
        entry = _telemetry.get(id(train_config))
        if entry is not None and entry[0]() is train_config and entry[1].training_engine is training_engine:
            return entry[1]
        telemetry = WorkerTelemetry(train_config, training_engine)
        _telemetry[id(train_config)] = (weakref.ref(train_config), telemetry)
        return telemetry
