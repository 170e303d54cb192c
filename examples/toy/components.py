"""
A small regression model and a synthetic data set, for the quick demo and the tests.

Nothing is downloaded: the data is generated from a seed by a Tango step.
"""

from typing import Dict

import torch
import torch.nn as nn
from tango import Step
from tango.common.dataset_dict import DatasetDict
from tango.integrations.torch import Model


class FeedForward(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.activation = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.activation(self.linear(x))


@Model.register("toy::regressor")
class ToyRegressor(Model):
    """``num_blocks`` residual feed-forward blocks and a linear head, trained with MSE."""

    def __init__(self, in_features: int = 16, width: int = 64, num_blocks: int = 4) -> None:
        super().__init__()
        self.input = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*[FeedForward(width) for _ in range(num_blocks)])
        self.head = nn.Linear(width, 1)
        self.loss = nn.MSELoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        prediction = self.head(self.blocks(self.input(x))).squeeze(-1)
        return {"loss": self.loss(prediction, y)}


@Step.register("toy::regression_data")
class RegressionData(Step):
    """A smooth non-linear regression problem with a little noise: ``train`` and ``validation`` splits."""

    DETERMINISTIC = True
    CACHEABLE = True

    def run(  # type: ignore[override]
        self, in_features: int = 16, train_size: int = 512, validation_size: int = 128, seed: int = 0
    ) -> DatasetDict:
        generator = torch.Generator().manual_seed(seed)
        projection = torch.randn(in_features, generator=generator)

        def make(size: int) -> list:
            x = torch.randn(size, in_features, generator=generator)
            y = torch.tanh(x @ projection / in_features**0.5) + 0.05 * torch.randn(size, generator=generator)
            return [{"x": x[i], "y": y[i]} for i in range(size)]

        return DatasetDict(splits={"train": make(train_size), "validation": make(validation_size)})
