"""
The ``"fairscale"`` engine from Python, without a config file: Tango steps built as objects,
among them two custom steps (``Step`` subclasses), and a result asked for.

    cd examples/python_api && python train.py [--workspace DIR] [--steps N] [--workers N]

It trains a small regressor with FSDP on 2 workers (CPU processes over gloo, or 2 GPUs where
there are), logs every step to ``metrics.jsonl`` in the training step's work directory with the
``fairscale::metrics`` callback, and evaluates the trained model in a custom step. A second run
with the same arguments finds every step's result in the workspace and trains nothing.

Run it as a script (the ``__main__`` guard below matters): the training workers are new
processes, which import this file to find ``TinyRegressor`` and ``MakeData``.
"""

import argparse
import json
from pathlib import Path
from typing import Dict

import torch
from tango import Step
from tango.common import Lazy, Params
from tango.common.dataset_dict import DatasetDict
from tango.common.logging import initialize_logging, teardown_logging
from tango.integrations.torch import DataLoader, Model, TorchTrainStep
from tango.workspaces import LocalWorkspace

# Registers the "fairscale" engine and the callbacks; the workers import it too.
from tango_fairscale import (
    FairScaleTrainingEngine,
    MetricsLog,
    read_checkpoint,
    read_weights,
    train_outputs,
)


class TinyRegressor(Model):
    """Two linear layers; ``forward`` returns the loss and one more metric, the mean absolute error."""

    def __init__(self, in_features: int = 8, width: int = 32) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(in_features, width)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        prediction = self.head(torch.nn.functional.gelu(self.hidden(x))).squeeze(-1)
        return {
            "loss": torch.nn.functional.mse_loss(prediction, y),
            "mae": (prediction - y).abs().mean().detach(),
        }


class MakeData(Step):
    """A custom step: a synthetic regression data set with ``train`` and ``validation`` splits."""

    DETERMINISTIC = True
    CACHEABLE = True

    def run(self, size: int = 512, in_features: int = 8) -> DatasetDict:  # type: ignore[override]
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(size, in_features, generator=generator)
        y = torch.sin(x.sum(-1) / in_features**0.5)
        examples = [{"x": x[i], "y": y[i]} for i in range(size)]
        split = size * 3 // 4
        return DatasetDict(splits={"train": examples[:split], "validation": examples[split:]})


class Evaluate(Step):
    """A custom step: the trained model's mean squared error on the validation split, in this process."""

    DETERMINISTIC = True
    CACHEABLE = False

    def run(self, model: Model, data: DatasetDict) -> float:  # type: ignore[override]
        validation = data["validation"]
        x = torch.stack([example["x"] for example in validation])
        y = torch.stack([example["y"] for example in validation])
        model.eval()
        with torch.no_grad():
            return float(model(x=x, y=y)["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # The repository's workspace/ (ignored by git), wherever the script is run from.
    default_workspace = Path(__file__).resolve().parents[2] / "workspace" / "python_api"
    parser.add_argument("--workspace", type=Path, default=default_workspace)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    data = MakeData(step_name="data")
    train = TorchTrainStep(
        step_name="train",
        # Lazy: each worker builds the model; the engine shards it (FSDP on the root module here;
        # "fairscale::with_wrapped_modules" makes chosen submodules their own units).
        model=Lazy(TinyRegressor, Params({"width": 32})),
        training_engine=Lazy(
            FairScaleTrainingEngine,
            Params(
                {
                    "optimizer": {"type": "torch::AdamW", "lr": 0.01},
                    "lr_scheduler": {"type": "torch::CosineAnnealingLR", "T_max": args.steps},
                    "fsdp_config": {"reshard_after_forward": True},
                }
            ),
        ),
        dataset_dict=data,
        train_dataloader=Lazy(
            DataLoader,
            Params(
                {
                    "batch_size": 16,
                    "sampler": {"type": "torch::DistributedSampler", "shuffle": True, "drop_last": True},
                }
            ),
        ),
        validation_split="validation",
        validation_dataloader=Lazy(
            DataLoader,
            Params(
                {
                    "batch_size": 32,
                    "sampler": {"type": "torch::DistributedSampler", "shuffle": False, "drop_last": True},
                }
            ),
        ),
        train_steps=args.steps,
        validate_every=args.steps // 2,
        checkpoint_every=args.steps // 2,
        device_count=args.workers,
        callbacks=[Lazy(MetricsLog)],
    )
    evaluate = Evaluate(step_name="evaluate", model=train, data=data)

    workspace = LocalWorkspace(args.workspace)
    # As `tango run` does: the training workers send their log records to this process.
    initialize_logging(log_level="warning")
    try:
        # Runs what the result needs and is not in the workspace yet: data, train, evaluate.
        mse = evaluate.result(workspace)
    finally:
        teardown_logging()

    # What the training step left: its work directory, weights.pt, metrics log, latest checkpoint.
    outputs = train_outputs(workspace, train)
    assert outputs.metrics and outputs.weights and outputs.latest_checkpoint, outputs
    metrics_file = outputs.metrics
    lines = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    # The first line of a run describes how its throughput figures are made ("kind": "run").
    training = [line for line in lines if line["kind"] == "train"]
    first, last = training[0], training[-1]
    validation = [line for line in lines if line["kind"] == "validation"][-1]
    print(f"train loss: step {first['step']} {first['loss']:.4f} -> step {last['step']} {last['loss']:.4f}")
    print(f"mae at step {last['step']}: {last['mae']:.4f}; validation loss {validation['val_loss']:.4f}")
    mfu = "unknown (no peak for this device)" if last["mfu"] is None else f"{100 * last['mfu']:.3f} %"
    print(f"step {last['step']}: {last['samples_per_second']:.0f} samples/s, MFU {mfu}")
    print(f"evaluate step, validation MSE of the trained model: {mse:.4f}")
    print(f"metrics log: {metrics_file} ({len(lines)} lines)")
    # The last step was checkpointed: its consolidated model is weights.pt, whichever backend wrote it.
    weights, checkpointed = read_weights(outputs.weights), read_checkpoint(outputs.latest_checkpoint)
    difference = max((weights[name] - checkpointed[name]).abs().max().item() for name in weights)
    checkpoint = outputs.latest_checkpoint.name
    print(f"weights.pt vs {checkpoint}: {len(weights)} tensors, max difference {difference}")


if __name__ == "__main__":
    main()
