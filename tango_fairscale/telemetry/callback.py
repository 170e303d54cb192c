"""
:class:`TelemetryCallback`: what the callbacks that show a run's figures share (the metrics log,
the memory table, the loggers): Tango's hooks drive the worker's
:class:`~tango_fairscale.telemetry.core.WorkerTelemetry`, and on the workers that write, the
callback reads every step's records of all workers.
"""

from typing import Any, Dict, List

from tango.integrations.torch import TrainCallback

from .core import WorkerTelemetry, telemetry_for
from .progress import attach_progress_lines
from .record import StepRecord

__all__ = ["TelemetryCallback"]


class TelemetryCallback(TrainCallback):
    """
    A ``torch::train`` callback that reads the step telemetry. Each of its hooks calls the
    worker's :class:`~tango_fairscale.telemetry.core.WorkerTelemetry` (shared by every such
    callback of the run; the first call for a step does the work); a subclass that overrides a
    hook calls this one too. On a worker where :attr:`writes`, :meth:`receive` gets every step's
    records of all workers, in order. A subclass checks its options and gives the telemetry its
    ``peak_tflops`` (:meth:`~tango_fairscale.telemetry.core.WorkerTelemetry.set_peak_tflops`).
    """

    #: The registered name, for messages.
    NAME = "fairscale::telemetry"
    #: Whether this callback writes each step as the step ends (the writer then waits for its records).
    waits_each_step = False
    #: Seconds the writer may wait for the records made so far before a checkpoint and at the end.
    final_wait_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.telemetry: WorkerTelemetry = telemetry_for(self.train_config, self.training_engine)
        if self.writes:
            self.telemetry.subscribe(self)
            # Progress as lines where standard error is no terminal (a log file), not Tango's bar.
            attach_progress_lines(self.telemetry)

    @property
    def writes(self) -> bool:
        """Whether this worker writes what the callback shows: each host's first worker."""
        return self.telemetry.writes

    def receive(self, records: List[StepRecord]) -> None:
        """Every worker's record of one step, validation or end, by rank (see the class docstring)."""

    def own(self, records: List[StepRecord]) -> StepRecord:
        """This worker's record among ``records``."""
        return next(record for record in records if record.rank == self.telemetry.rank)

    # --- Tango's hooks ----------------------------------------------------------------------------

    def pre_train_loop(self) -> None:
        self.telemetry.pre_train_loop()

    def pre_batch(self, step: int, epoch: int, batch: List[Dict[str, Any]]) -> None:
        self.telemetry.pre_batch(step, epoch, batch)

    def post_batch(
        self, step: int, epoch: int, batch_loss: float, batch_outputs: List[Dict[str, Any]]
    ) -> None:
        self.telemetry.post_batch(step, batch_loss, batch_outputs)

    def log_batch(
        self, step: int, epoch: int, batch_loss: float, batch_outputs: List[Dict[str, Any]]
    ) -> None:
        self.telemetry.log_batch(step, batch_loss)

    def pre_val_batch(self, step: int, val_step: int, epoch: int, val_batch: Any) -> None:
        self.telemetry.pre_val_batch(step, val_step)

    def post_val_batch(self, step: int, val_step: int, epoch: int, val_batch_outputs: Dict[str, Any]) -> None:
        self.telemetry.post_val_batch(step, val_step, val_batch_outputs)

    def post_val_loop(self, step: int, epoch: int, val_metric: float, best_val_metric: float) -> None:
        self.telemetry.post_val_loop(step, epoch, val_metric, best_val_metric)

    def post_train_loop(self, step: int, epoch: int) -> None:
        self.telemetry.post_train_loop(step, epoch)

    def state_dict(self) -> Dict[str, Any]:
        """
        Tango asks every callback for its state on every worker just before it saves a
        checkpoint: a run killed after that checkpoint resumes after this step and never redoes
        it, so the step's lines and rows are written now (the telemetry's ``checkpoint``).
        """
        self.telemetry.checkpoint()
        return super().state_dict()
