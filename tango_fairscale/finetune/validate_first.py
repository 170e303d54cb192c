"""
:class:`ValidateFirst`, the ``torch::train`` callback ``"fairscale::validate_first"``: Tango's
validation pass once more, before the first training step, so that the model's loss before any
training (a pretrained model's: the baseline a fine-tuning run is measured against) is in the
metrics log at step 0 and in the log.
"""

import logging
from itertools import islice
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from tango.common.exceptions import ConfigurationError
from tango.common.tqdm import Tqdm
from tango.integrations.torch import TrainCallback

from ..checkpointing import random_state
from ..telemetry.core import telemetry_for
from ..telemetry.record import Sums, output_sums

__all__ = ["ValidateFirst"]

logger = logging.getLogger(__name__)


@TrainCallback.register("fairscale::validate_first")
class ValidateFirst(TrainCallback):
    """
    Runs the step's validation before the first training step, as Tango's ``torch::train`` runs it
    after a step: the same batches (``validation_dataloader``, ``validation_steps`` of them) through
    the engine's ``forward_eval``, the model in eval mode, ``val_metric_name`` averaged over each
    worker's batches and then over the workers (``auto_aggregate_val_metric``, Tango's default; the
    last batch's value otherwise). For the same weights the value is the one Tango's validation
    would compute.

    .. tip::
        Registered as a :class:`~tango.integrations.torch.TrainCallback` under the name
        "fairscale::validate_first". Add it with ``callbacks: [{type: "fairscale::validate_first"}]``
        to a step with a ``validation_split``; it works with any training engine.

    Where the value goes:

    - the metrics log (``metrics.jsonl``, :class:`~tango_fairscale.telemetry.metrics.MetricsLog`): a
      validation line of ``step`` 0 with ``"baseline": true``, ``val_<val_metric_name>`` and
      ``val_<name>`` for every scalar the model returned, averaged over all batches of all workers
      (through the step telemetry, :meth:`~tango_fairscale.telemetry.core.WorkerTelemetry.baseline`);
    - the log: one INFO line on each host's first worker (``tango --log-level info run ...``);
    - :attr:`val_metric`, on every worker.

    It is Tango's validation, not part of Tango's bookkeeping: Tango's best validation metric
    (which picks ``checkpoint_state_best`` and ``weights.pt``) counts the validations after steps
    only, as step 0 has no checkpoint, and other callbacks' ``pre_val_batch``, ``post_val_batch``
    and ``post_val_loop`` are not called for it (a callback cannot reach the others).

    Only a run that starts from step 0 validates first: one that resumes (Tango found
    ``checkpoint_state_latest``, its own or the engine's ``resume_from_checkpoint``) continues a
    run whose baseline, if any, is logged already. The random generators are restored after the
    validation (a data loader's iterator draws its seed from torch's), so the training that
    follows draws exactly what it draws without this callback.
    """

    NAME = "fairscale::validate_first"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.validation_dataloader is None:
            raise ConfigurationError(
                f"callbacks: {self.NAME} needs the step's validation_split (and, if the split needs "
                "other batches, validation_dataloader); set it, or remove the callback."
            )
        # Tango's own rule (its _train, which constructs the callbacks right after it): a run that
        # finds the latest checkpoint's link resumes from it, and is not at step 0.
        self.resumed = self.train_config.state_path.exists()
        #: The validation metric before the first step, once measured (on every worker).
        self.val_metric: Optional[float] = None

    def pre_train_loop(self) -> None:
        if self.resumed:
            return
        state = random_state.capture()
        try:
            val_metric, outputs = self.validate()
        finally:
            random_state.restore(state)
        self.val_metric = val_metric
        config = self.train_config
        if config.is_local_main_process:
            logger.info(
                "Validation before the first step (%s): val_%s %.6g",
                self.NAME,
                config.val_metric_name,
                val_metric,
            )
        telemetry_for(config, self.training_engine).baseline(val_metric, outputs)

    def validate(self) -> Tuple[float, Sums]:
        """
        Tango's validation loop (``tango.integrations.torch.train._train``), with its collectives:
        the metric and this worker's sums of the model's scalar outputs.
        """
        config = self.train_config
        engine = self.training_engine
        assert self.validation_dataloader is not None and config.validation_steps is not None
        device = config.worker_local_default_device
        val_metric: Optional[float] = None
        running_metric = 0.0
        outputs_sums: Sums = {}
        engine.model.eval()
        with Tqdm.tqdm(
            islice(self.validation_dataloader, config.validation_steps),
            desc="Validating before the first step",
            total=config.validation_steps,
            leave=False,
            disable=not config.is_local_main_process,
        ) as batches:
            for val_step, batch in enumerate(batches):
                outputs = engine.forward_eval(batch)
                outputs_sums = output_sums([outputs], outputs_sums)
                metric = outputs[config.val_metric_name]
                value = metric if isinstance(metric, float) else metric.item()
                if config.auto_aggregate_val_metric:
                    running_metric += value
                    val_metric = running_metric / (val_step + 1)
                else:
                    val_metric = value
                # Where Tango averages over the workers: the same collectives, in the same places.
                if (
                    config.is_distributed
                    and config.should_log_this_val_step(val_step)
                    and config.auto_aggregate_val_metric
                ):
                    tensor = torch.tensor(val_metric, device=device)
                    dist.all_reduce(tensor)
                    val_metric = tensor.item() / config.world_size
                del batch, outputs, metric
        engine.model.train()
        if val_metric is None:
            raise ConfigurationError(
                f"callbacks: {self.NAME}: the validation split gave no batch to validate on (is it "
                "smaller than one batch per worker, with drop_last?)."
            )
        return val_metric, outputs_sums
