"""
``python -m tango_fairscale plan``: the wrap plan, and its estimate against a real 2-worker
training (in the test's own workers, :mod:`tests.harness`).
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests import harness
from tests.helpers import tango_env, train_config


def run_plan(config: Dict[str, Any], tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "tango_fairscale", "plan", str(config_path)]
    command += ["-i", "examples.toy.components", *extra]
    return subprocess.run(command, cwd=tmp_path, env=tango_env(), capture_output=True, text=True, check=False)


def plan(config: Dict[str, Any], tmp_path: Path, *extra: str) -> Dict[str, Any]:
    result = run_plan(config, tmp_path, "--json", str(tmp_path / "plan.json"), *extra)
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    return {"text": result.stdout, **json.loads((tmp_path / "plan.json").read_text())}


def test_plan_tree_and_estimates(tmp_path: Path) -> None:
    result = plan(train_config(wrap="nested_ckpt"), tmp_path, "--world-size", "4")
    names: List[str] = [unit["name"] for unit in result["units"]]
    assert names == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert all(unit["checkpointed"] for unit in result["units"][1:])
    # 8*32+32 (input) + 32+1 (head) in the root; 32*32+32 per block.
    assert [unit["parameters"] for unit in result["units"]] == [321, 1056, 1056, 1056, 1056]
    assert [unit["shard_parameters"] for unit in result["units"]] == [81, 264, 264, 264, 264]
    assert result["parameters"] == 321 + 4 * 1056
    assert result["world_size"] == 4
    assert "built on the meta device" in result["text"]
    assert "└── blocks.3 (FeedForward)" in result["text"]
    ddp = result["ddp_bytes_per_worker"]["total"]
    assert ddp == result["parameters"] * 4 * (1 + 1 + 2)  # fp32 params, grads, AdamW's 2 moments
    assert result["bytes_per_worker"]["total"] / ddp == pytest.approx(0.25, abs=0.01)


def test_plan_without_fsdp_units_is_root_only(tmp_path: Path) -> None:
    result = plan(train_config(wrap="root"), tmp_path)
    assert [unit["name"] for unit in result["units"]] == [""]
    assert result["world_size"] == 2  # the step's device_count


def test_plan_errors_name_the_problem(tmp_path: Path) -> None:
    config = train_config(wrap="nested")
    config["steps"]["train"]["model"]["modules_to_wrap"] = ["nope"]
    result = run_plan(config, tmp_path)
    assert result.returncode == 2
    assert "'nope' matches no submodule of ToyRegressor" in result.stderr


def test_plan_refuses_a_tie_split_across_units_as_tango_run_does(tmp_path: Path) -> None:
    config = train_config(wrap="nested", model={"type": "test::tied_lm"})
    config["steps"]["train"]["model"]["modules_to_wrap"] = ["embed", "blocks\\.[0-9]+"]
    result = run_plan(config, tmp_path, "-i", "tests.components")
    assert result.returncode == 2, result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert "would be split across FSDP units" in line and "embed.weight in FSDP unit 'embed'" in line, line


def test_plan_of_a_ddp_step_says_nothing_is_sharded(tmp_path: Path) -> None:
    result = plan(train_config(engine="torch", wrap="none"), tmp_path)
    assert [unit["shard_parameters"] for unit in result["units"]] == [
        unit["parameters"] for unit in result["units"]
    ]
    assert result["bytes_per_worker"]["total"] == result["ddp_bytes_per_worker"]["total"]
    assert 'The training engine "torch" does not shard' in result["text"]


def test_plan_of_a_model_whose_constructor_raises_is_one_line(tmp_path: Path) -> None:
    config = train_config(wrap="root")
    config["steps"]["train"]["model"] = {"type": "test::raises_in_constructor"}
    result = run_plan(config, tmp_path, "-i", "tests.components")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: model: building 'test::raises_in_constructor' raised ValueError: checkpoint file "
        "/nowhere/model.bin not found"
    ], result.stderr


def test_estimate_matches_a_real_two_worker_run(tmp_path: Path) -> None:
    config = train_config(wrap="nested_ckpt", train_steps=4, checkpoint_every=4)
    estimate = plan(config, tmp_path / "plan")
    work_dir = tmp_path / "work"
    harness.train(config, work_dir)
    for path in sorted(work_dir.glob("state_sizes_worker*.json")):
        measured = json.loads(path.read_text())
        measured_total = measured["param_bytes"] + measured["grad_bytes"] + measured["optimizer_bytes"]
        estimated_total = estimate["bytes_per_worker"]["total"]
        print(f"worker {measured['worker']}: measured {measured_total} B, estimated {estimated_total} B")
        assert abs(estimated_total - measured_total) <= 0.10 * measured_total
