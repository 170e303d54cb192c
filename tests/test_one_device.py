"""
A ``torch::train`` step of one device on the engine (``device_count: 1``, one host): Tango would run
it in its own process without a process group; the engine's step spawns its one worker with a
process group of one, so that a single GPU (or CPU) trains with either backend, CPU offload
included. The result equals Tango's own engine on the same device, and the main process never
built the engine.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import load_weights, max_abs_difference, run_tango, train_config, train_work_dir

#: As the other equivalence tests: FSDP flattens parameters and sums in another order.
TOLERANCE = 1e-5


def one_device(engine: str, backend: str = "fairscale") -> dict:
    if engine == "torch":
        config = train_config(engine="torch", wrap="none", device_count=1, train_steps=8, checkpoint_every=4)
        # No process group in Tango's one-process run: the same order of the data, given its world.
        sampler = config["steps"]["train"]["train_dataloader"]["sampler"]
        sampler.update({"num_replicas": 1, "rank": 0})
    else:
        config = train_config(
            wrap="nested",
            device_count=1,
            train_steps=8,
            checkpoint_every=4,
            engine_extra={"backend": backend},
            fsdp_config={},
        )
    config["steps"]["train"]["callbacks"] = []
    return config


@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_one_device_trains_in_one_worker_as_tangos_engine_does(tmp_path: Path, backend: str) -> None:
    reference = tmp_path / "tango_engine"
    run_tango(one_device("torch"), reference / "ws", cwd=reference)
    sharded = tmp_path / backend
    result = run_tango(one_device("fairscale", backend), sharded / "ws", cwd=sharded)

    difference = max_abs_difference(load_weights(sharded / "ws"), load_weights(reference / "ws"))
    assert difference <= TOLERANCE, difference
    work_dir = train_work_dir(sharded / "ws")
    # Trained by a worker of a process group of one (the run line's world), checkpointed by it.
    run = json.loads((work_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert run["world_size"] == 1, run
    assert (work_dir / "checkpoint_state_step8").is_dir()
    assert "needs a process group" not in result.stdout + result.stderr
    assert (
        torch.load(work_dir / "weights.pt", weights_only=True).keys() == load_weights(reference / "ws").keys()
    )


def test_an_engine_built_without_a_process_group_says_how_to_get_one(tmp_path: Path) -> None:
    from tango.common import Lazy
    from tango.common.exceptions import ConfigurationError
    from tango.integrations.torch import Optimizer, TrainConfig

    from examples.toy.components import ToyRegressor
    from tango_fairscale import FairScaleTrainingEngine

    with pytest.raises(ConfigurationError, match="is_distributed=True") as raised:
        FairScaleTrainingEngine(
            TrainConfig("own-step", tmp_path),  # one process, no process group
            Lazy(lambda: ToyRegressor(in_features=8, width=8, num_blocks=1), constructor_extras={}),  # type: ignore[arg-type]
            Lazy(Optimizer.by_name("torch::Adam"), constructor_extras={}),  # type: ignore[arg-type]
        )
    assert "needs a process group" in str(raised.value) and "torch::train step (any device_count)" in str(
        raised.value
    )
