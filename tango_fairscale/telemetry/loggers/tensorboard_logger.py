"""
``fairscale::tensorboard``: a training run's metrics as TensorBoard event files, written by global
rank 0 with every worker's figures (:class:`~.base.RankZeroLogger`), through
:class:`torch.utils.tensorboard.SummaryWriter` (``pip install 'tango-fairscale[loggers]'``).
"""

from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from tango.integrations.torch import TrainCallback

from .base import RankZeroLogger
from .wandb_logger import check_writable_directory

__all__ = ["TensorBoardLogger"]


@TrainCallback.register("fairscale::tensorboard")
class TensorBoardLogger(RankZeroLogger):
    """
    Writes the training step's metrics as TensorBoard scalars from global rank 0: the same rows as
    ``fairscale::wandb`` (``train/loss``, ``train/lr``, ``train/tokens_per_second``, ``train/mfu``,
    ``train/collective_time_s``, ``train/peak_memory_mib``..., ``worker<N>/...``, ``val/...``; see
    :class:`~tango_fairscale.telemetry.loggers.base.RankZeroLogger`), one event per scalar and step, flushed
    after every row, so a killed run keeps every row it wrote.

    .. tip::
        Registered as a :class:`~tango.integrations.torch.TrainCallback` under the name
        "fairscale::tensorboard". Add it with ``callbacks: [{type: "fairscale::tensorboard"}]`` and
        watch it with ``tensorboard --logdir WORK_DIR/tensorboard``; needs
        ``pip install 'tango-fairscale[loggers]'``.

    **Reruns.** A resumed run writes a new event file in the same directory, opened with
    ``purge_step`` at its first step: TensorBoard then hides what the interrupted run wrote for the
    steps that are redone, so each step shows once.

    :param log_dir: The directory of the event files. Default: ``tensorboard`` in the step's work
        directory.

    ``every`` (default: the step's ``log_every``), ``peak_tflops`` and ``final_wait_s``: see
    :class:`~tango_fairscale.telemetry.loggers.base.RankZeroLogger`.
    """

    NAME = "fairscale::tensorboard"

    def __init__(
        self,
        *args: Any,
        log_dir: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.check_options({"log_dir": log_dir})
        self.log_dir = (
            Path(log_dir) if log_dir is not None else Path(self.train_config.work_dir) / "tensorboard"
        )
        self.writer: Any = None

    @classmethod
    def check_options(cls, options: Mapping[str, Any], train_steps: Optional[int] = None) -> None:
        super().check_options(options, train_steps)
        check_writable_directory(cls.NAME, "log_dir", options.get("log_dir"))

    #: torch's SummaryWriter needs it.
    REQUIRES = "tensorboard"

    def open(self, first_step: int) -> int:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir.mkdir(parents=True, exist_ok=True)
        # purge_step: TensorBoard drops the earlier events of the steps from here on.
        self.writer = SummaryWriter(
            log_dir=str(self.log_dir), purge_step=first_step + 1 if first_step else None
        )
        # Every row is flushed as it is written: the event files hold every step up to the
        # checkpoint this run resumes from, and the purge hides the later ones.
        return first_step

    def write(self, step: int, row: Dict[str, float]) -> None:
        if self.writer is None:
            return
        for key, value in row.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
