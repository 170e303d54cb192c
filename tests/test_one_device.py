"""
A ``torch::train`` step of one device on the engine (``device_count: 1``, one host): Tango would run
it in its own process without a process group; the engine's step spawns its one worker with a
process group of one, so that a single GPU (or CPU) trains with either backend, CPU offload
included. The result equals Tango's own engine on the same device, and the main process never
built the engine.
"""

import json
import os
from pathlib import Path
from typing import Dict

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
    config["steps"]["train"]["callbacks"] = [{"type": "test::record_process"}]
    return config


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, torch.Tensor]:
    """Tango's own engine on the one device, in Tango's process."""
    cwd = tmp_path_factory.mktemp("tango_engine")
    run_tango(one_device("torch"), cwd / "ws", cwd=cwd)
    process = json.loads((train_work_dir(cwd / "ws") / "process.json").read_text())
    # The reference trained in `tango run`'s own process (this test's child), without a process
    # group: what the engine's step does differently is spawn a worker that has one.
    assert process["ppid"] == os.getpid() and not process["process_group"], process
    return load_weights(cwd / "ws")


# The torch backend's in the extended suite: the one-worker route is the step's, the same for both.
@pytest.mark.parametrize("backend", ["fairscale", pytest.param("torch", marks=pytest.mark.extended)])
def test_one_device_trains_in_one_worker_as_tangos_engine_does(
    tmp_path: Path, backend: str, reference: Dict[str, torch.Tensor]
) -> None:
    run_tango(one_device("fairscale", backend), tmp_path / "ws", cwd=tmp_path)

    difference = max_abs_difference(load_weights(tmp_path / "ws"), reference)
    assert difference <= TOLERANCE, difference
    work_dir = train_work_dir(tmp_path / "ws")
    # Trained by a worker that `tango run` spawned (its parent is not this test), in a process
    # group of one, and checkpointed by it.
    process = json.loads((work_dir / "process.json").read_text())
    assert process["ppid"] != os.getpid(), process
    assert process["process_group"] and process["world_size"] == 1, process
    assert (work_dir / "checkpoint_state_step8" / "COMPLETE.json").is_file()


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
