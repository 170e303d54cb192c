"""Tango components used only by the tests (imported by the workers with ``-i tests.components``)."""

import json
from typing import Any, Dict

import torch
from tango.integrations.torch import TrainCallback


@TrainCallback.register("test::record_state_sizes")
class RecordStateSizes(TrainCallback):
    """
    Writes, per worker, how many parameter and optimizer-state elements that worker holds
    after training, to ``state_sizes_worker{N}.json`` in the step's work directory.
    """

    def post_train_loop(self, step: int, epoch: int) -> None:
        model = self.training_engine.model
        optimizer = self.training_engine.optimizer
        optimizer_numel = sum(
            value.numel()
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        )
        sizes: Dict[str, Any] = {
            "worker": self.train_config.worker_id,
            "param_numel": sum(p.numel() for p in model.parameters()),
            "optimizer_numel": optimizer_numel,
        }
        path = self.train_config.work_dir / f"state_sizes_worker{self.train_config.worker_id}.json"
        path.write_text(json.dumps(sizes))
