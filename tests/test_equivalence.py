"""
The heart of the plugin: FSDP on 2 CPU workers trains to the same weights as Tango's own DDP
engine on 2 CPU workers, through the real ``tango`` CLI.
"""

import json
from pathlib import Path
from typing import Dict

import pytest
from tango.integrations.torch.util import set_seed_all
from tango.workspaces import LocalWorkspace

from examples.toy.components import ToyRegressor
from tests.helpers import load_weights, max_abs_difference, run_tango, train_config, train_work_dir

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
SEED = 7  # train_config()'s default seed


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp")
    run_tango(train_config(engine="torch", wrap="none"), root / "ws", cwd=root / "cwd")
    return root / "ws"


def state_sizes(workspace: Path) -> Dict[int, dict]:
    work_dir = train_work_dir(workspace)
    sizes = [json.loads(p.read_text()) for p in sorted(work_dir.glob("state_sizes_worker*.json"))]
    return {entry["worker"]: entry for entry in sizes}


@pytest.mark.parametrize("wrap", ["root", "nested", "nested_ckpt"])
def test_fsdp_matches_ddp(wrap: str, ddp_run: Path, tmp_path: Path) -> None:
    run_tango(train_config(engine="fairscale", wrap=wrap), tmp_path / "ws", cwd=tmp_path / "cwd")
    fsdp_weights = load_weights(tmp_path / "ws")
    ddp_weights = load_weights(ddp_run)

    # Same keys as the plain model, and loadable into it strictly.
    plain = ToyRegressor(in_features=8, width=32, num_blocks=4)
    plain.load_state_dict(fsdp_weights, strict=True)

    # Training moved the weights away from their initialisation (Tango seeds before building
    # the model), so the equality below is not the two runs merely sharing an init.
    set_seed_all(SEED)
    initial = ToyRegressor(in_features=8, width=32, num_blocks=4).state_dict()
    assert max_abs_difference(fsdp_weights, initial) > 1e-2

    difference = max_abs_difference(fsdp_weights, ddp_weights)
    print(f"[{wrap}] max |FSDP - DDP| over all weights: {difference:.3e}")
    assert difference <= TOLERANCE


def test_step_result_is_the_trained_model(tmp_path: Path) -> None:
    run_tango(
        train_config(engine="fairscale", wrap="nested_ckpt", train_steps=4, checkpoint_every=2),
        tmp_path / "ws",
        cwd=tmp_path / "cwd",
    )
    workspace = LocalWorkspace(tmp_path / "ws")
    (run_name,) = workspace.registered_runs().keys()
    model = workspace.step_result_for_run(run_name, "train")
    weights = load_weights(tmp_path / "ws")
    assert max_abs_difference(model.state_dict(), weights) == 0.0


def test_each_worker_holds_half_of_ddp_state(ddp_run: Path, tmp_path: Path) -> None:
    run_tango(train_config(engine="fairscale", wrap="nested"), tmp_path / "ws", cwd=tmp_path / "cwd")
    ddp = state_sizes(ddp_run)
    fsdp = state_sizes(tmp_path / "ws")
    assert sorted(ddp) == sorted(fsdp) == [0, 1]
    full_params = sum(p.numel() for p in ToyRegressor(in_features=8, width=32, num_blocks=4).parameters())
    for worker in (0, 1):
        assert ddp[worker]["param_numel"] == full_params
        param_ratio = fsdp[worker]["param_numel"] / ddp[worker]["param_numel"]
        optimizer_ratio = fsdp[worker]["optimizer_numel"] / ddp[worker]["optimizer_numel"]
        print(f"worker {worker}: params {param_ratio:.4f} x DDP, optimizer state {optimizer_ratio:.4f} x DDP")
        # Half, plus at most one element of padding per FSDP unit's flat parameter.
        assert 0.5 <= param_ratio <= 0.5 + 6 / full_params
        assert 0.5 <= optimizer_ratio <= 0.5 + 12 / full_params
    # The two halves cover the model exactly once (up to padding).
    assert fsdp[0]["param_numel"] == fsdp[1]["param_numel"]
