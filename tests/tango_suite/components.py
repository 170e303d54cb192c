"""
Components for ``tests/test_tango_suite.py``: a three-block regressor on four features and its
data, the shapes of the scenario that ai2-tango's own FairScale integration test trains.

This module deliberately does not import ``tango_fairscale``: the workers import it (through
``-i tests.tango_suite.components``), and an import here would hide whether the plugin reaches
the workers on its own when the user only imported it in the main process.
"""

import json
from typing import Any, Dict

import torch
import torch.nn as nn
from tango import Step
from tango.common.dataset_dict import DatasetDict
from tango.integrations.torch import Model, TrainCallback

FEATURES = 4
BLOCKS = 3
TRAIN_SIZE = 32
DEV_SIZE = 16


class Block(nn.Module):
    """One wrappable unit: a square linear layer and a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)
        self.activation = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x))


@Model.register("tango_suite::regressor")
class SuiteRegressor(Model):
    """``blocks.0`` to ``blocks.2`` then a one-output ``head``, trained with mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(FEATURES, 1)
        self.loss = nn.MSELoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        prediction = self.head(self.blocks(x))
        return {"loss": self.loss(prediction.float(), y)}


def make_split(size: int, generator: torch.Generator) -> list:
    """Four standard-normal features; the target is an offset plus a small linear term, so an
    untrained model starts with a loss near 9 and a few optimizer steps visibly lower it."""
    x = torch.randn(size, FEATURES, generator=generator)
    y = 3.0 + 0.2 * x.sum(dim=1, keepdim=True)
    return [{"x": x[i], "y": y[i]} for i in range(size)]


def make_data(seed: int = 317) -> DatasetDict:
    generator = torch.Generator().manual_seed(seed)
    return DatasetDict(
        splits={"train": make_split(TRAIN_SIZE, generator), "dev": make_split(DEV_SIZE, generator)}
    )


@Step.register("tango_suite::data")
class SuiteData(Step):
    """``train`` (32 examples) and ``dev`` (16) splits, generated from ``seed``."""

    DETERMINISTIC = True
    CACHEABLE = False

    def run(self, seed: int = 317) -> DatasetDict:  # type: ignore[override]
        return make_data(seed)


@TrainCallback.register("tango_suite::record_losses")
class RecordLosses(TrainCallback):
    """
    Worker 0 writes ``suite_losses.json`` to the step's work directory: the step's name and the
    batch loss (averaged over the workers) of every logged step, so a test can find each step's
    work directory among several trained in one run.
    """

    def log_batch(self, step: int, epoch: int, batch_loss: float, batch_outputs: Any) -> None:
        if not self.is_local_main_process:
            return
        path = self.train_config.work_dir / "suite_losses.json"
        record = (
            json.loads(path.read_text())
            if path.exists()
            else {"step_name": self.train_config.step_name, "losses": {}}
        )
        record["losses"][str(step)] = batch_loss
        path.write_text(json.dumps(record))
