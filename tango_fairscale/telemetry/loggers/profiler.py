"""
``fairscale::profile``: chosen training steps recorded with :mod:`torch.profiler`, one Chrome
trace per worker.
"""

import logging
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import TrainCallback

logger = logging.getLogger(__name__)

__all__ = ["ProfileCallback"]


@TrainCallback.register("fairscale::profile")
class ProfileCallback(TrainCallback):
    """
    Records the chosen training steps with :mod:`torch.profiler` on every worker and writes one
    Chrome trace per worker, ``worker<N>.json`` in ``output_dir`` (open it in Perfetto or
    ``chrome://tracing``). The recording spans each step from its start to the start of the next
    one, so it holds the forward and backward passes, the optimizer step and the data loading of
    the next step, each step marked by a ``train step <N>`` range.

    The collectives are visible: on CPU workers FSDP's all-gathers and reduce-scatters (either
    backend) appear as ``tango_fairscale::all_gather`` and ``tango_fairscale::reduce_scatter``
    ranges over the gloo sends and receives of their rings; on GPUs NCCL's kernels are recorded
    (CUDA activity is on for GPU workers).

    .. tip::
        Registered as a :class:`~tango.integrations.torch.TrainCallback` under the name
        "fairscale::profile". Add it with ``callbacks: [{type: "fairscale::profile", steps: [3, 4]}]``.

    :param steps: The steps to record, 1-based (step ``N`` is the ``N``-th optimizer step, as in
        the metrics log), consecutive. Default: ``[2]`` (the first step has one-off set-up).
    :param output_dir: Where the traces go. Default: ``profile`` in the step's work directory.
    :param record_shapes: Record the shapes of the operators' inputs.
    :param with_stack: Record the Python stack of each operator (large traces).
    :param profile_memory: Record tensor allocations.
    """

    NAME = "fairscale::profile"

    def __init__(
        self,
        *args: Any,
        steps: Optional[List[int]] = None,
        output_dir: Optional[str] = None,
        record_shapes: bool = False,
        with_stack: bool = False,
        profile_memory: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        steps = [2] if steps is None else list(steps)
        self.check_options({"steps": steps}, self.train_config.train_steps)
        self.first = min(steps)
        self.last = max(steps)
        self.output_dir = (
            Path(output_dir) if output_dir is not None else Path(self.train_config.work_dir) / "profile"
        )
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        self.profile_memory = profile_memory
        self._profiler: Optional[torch.profiler.profile] = None
        self._step_range: Any = None
        self.trace_path: Optional[Path] = None

    @classmethod
    def check_options(cls, options: Mapping[str, Any], train_steps: Optional[int] = None) -> None:
        """
        The rules on the constructor's options, by name (an absent one: its default), applied by the
        constructor and by pre-flight (:func:`tango_fairscale.preflight.check_callbacks`) before any
        worker starts, with the run's ``train_steps`` where known.
        """
        given = options.get("steps")
        steps = [2] if given is None else given
        if (
            not isinstance(steps, (list, tuple))
            or not steps
            or any(isinstance(step, bool) or not isinstance(step, int) or step < 1 for step in steps)
        ):
            raise ConfigurationError(
                f"{cls.NAME}: steps must be a list of 1-based step numbers, got {steps!r}; e.g. [2, 3]."
            )
        if sorted(steps) != list(range(min(steps), max(steps) + 1)):
            raise ConfigurationError(
                f"{cls.NAME}: steps must be consecutive (one recording), got {list(steps)}; "
                f"e.g. {list(range(min(steps), max(steps) + 1))}"
            )
        if train_steps is not None and max(steps) > train_steps:
            # Steps after the last are never recorded; if none is before it, no trace is written at all.
            outcome = "no trace would be written" if min(steps) > train_steps else "the trace would lack them"
            raise ConfigurationError(
                f"{cls.NAME}: steps {list(steps)} go past the run's last step (train_steps {train_steps}), "
                f"so {outcome}: choose steps from 1 to {train_steps}"
                f"{' (the default is [2])' if given is None else ''}."
            )

    @property
    def _worker(self) -> int:
        return self.train_config.worker_id if self.train_config.is_distributed else 0

    def pre_batch(self, step: int, epoch: int, batch: List[Dict[str, Any]]) -> None:
        number = step + 1
        self._end_step_range()
        if number > self.last:
            self._stop()
            return
        if number >= self.first and self._profiler is None and self.trace_path is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.train_config.worker_local_default_device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities,
                record_shapes=self.record_shapes,
                with_stack=self.with_stack,
                profile_memory=self.profile_memory,
            )
            self._profiler.__enter__()
        if self._profiler is not None:
            self._step_range = torch.profiler.record_function(f"train step {number}")
            self._step_range.__enter__()

    def pre_val_batch(self, step: int, val_step: int, epoch: int, val_batch: Dict[str, Any]) -> None:
        # A validation is not a training step: the recording ends with the last chosen step.
        self._end_step_range()
        if step + 1 >= self.last:
            self._stop()

    def post_train_loop(self, step: int, epoch: int) -> None:
        self._end_step_range()
        self._stop()

    def _end_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        profiler.__exit__(None, None, None)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.trace_path = self.output_dir / f"worker{self._worker}.json"
        profiler.export_chrome_trace(str(self.trace_path))
        logger.info(
            "fairscale::profile: steps %d-%d of worker %d recorded in %s",
            self.first,
            self.last,
            self._worker,
            self.trace_path,
        )
