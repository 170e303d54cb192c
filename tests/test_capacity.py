"""
The capacity benchmark (benchmarks/capacity.py) and example (examples/capacity): the per-worker
memory limit, the search for the largest model that fits, the report, and, end to end, the
example's GPT-2 failing for memory under Tango's DDP engine and training with FSDP in the same
budget.
"""

import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch
from tango.workspaces import LocalWorkspace

from benchmarks.capacity import (
    SHAPES,
    MemoryModel,
    Search,
    Trial,
    failure_reason,
    model_parameters,
    next_depth,
    write_outputs,
)
from benchmarks.components import parse_bytes
from tests.helpers import REPO, free_port

EXAMPLE_DIR = REPO / "examples" / "capacity"
#: The example's budget for each process of the run: `ulimit -d 1468006` (KiB) in its README.
BUDGET_KIB = 1468006
assert f"ulimit -d {BUDGET_KIB}" in (EXAMPLE_DIR / "README.md").read_text()
TANGO = str(Path(sys.executable).with_name("tango"))
MIB = 2**20


def test_parse_bytes() -> None:
    assert parse_bytes(1234) == 1234
    assert parse_bytes("1GiB") == 2**30
    assert parse_bytes("1.5 GiB") == 3 * 2**29
    assert parse_bytes("1536MiB") == 1536 * MIB
    assert parse_bytes("2048") == 2048
    with pytest.raises(ValueError, match="Not a memory size"):
        parse_bytes("lots")


def test_limit_applies_to_the_worker_and_can_be_lifted() -> None:
    # In a process of its own: the limit is the process's. 600 MiB on top of what the runtime
    # already uses cannot be allocated under the limit, and can once it is lifted.
    script = """
import torch
from benchmarks.components import _vm_data_bytes, lift_worker_memory_limit, limit_worker_memory
limit_worker_memory(_vm_data_bytes() + 300 * 2**20)
try:
    torch.ones(600 * 2**20 // 4)
    print("allocated under the limit")
except RuntimeError as error:
    print("refused:", "Cannot allocate memory" in str(error))
lift_worker_memory_limit()
print("after lifting:", torch.ones(600 * 2**20 // 4).numel() * 4 // 2**20, "MiB")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["refused: True", "after lifting: 600 MiB"]


def test_failure_reason_names_the_allocation_and_where() -> None:
    output = """
-- Process 1 terminated with the following error:
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/optim/adam.py", line 182, in _init_group
    state["exp_avg"] = torch.zeros_like(
RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: \
you tried to allocate 9437184 bytes. Error code 12 (Cannot allocate memory)
"""
    assert failure_reason(output, 1) == (True, "can't allocate 9.0 MiB (ENOMEM) in adam.py:_init_group")
    assert failure_reason("process 0 terminated with signal SIGKILL", 1) == (
        True,
        "a worker was killed by SIGKILL",
    )
    aborted = "terminate called without an active exception\n... process 1 terminated with signal SIGABRT"
    assert failure_reason(aborted, 1) == (
        True,
        "a worker was killed by SIGABRT (terminate called without an active exception)",
    )
    assert failure_reason("ConfigurationError: bad config\n", 1) == (False, "ConfigurationError: bad config")


def simulate(
    peak: Callable[[int], float], budget: int, model: MemoryModel, max_trials: int = 6, name: str = "fsdp"
) -> Search:
    """The search of capacity.py against a made-up memory curve instead of real runs."""
    shape = SHAPES["full"]
    search = Search(name, 2)
    for _ in range(max_trials):
        depth = next_depth(search, budget, model, shape)
        if depth is None:
            break
        fits = peak(depth) <= budget
        search.trials.append(
            Trial(
                name,
                2,
                depth,
                model_parameters(shape, depth),
                fits,
                1.0,
                peak_vm_data_bytes=int(peak(depth)) if fits else None,
            )
        )
    return search


@pytest.mark.parametrize(
    "name, intercept_mib, per_block_mib, model_intercept_mib, model_extra_mib, most_trials",
    [
        ("fsdp", 500, 69, 500, 12, 3),  # the memory model is about right
        ("fsdp", 500, 69, 300, 12, 5),  # it underestimates the fixed cost: the first guess fails
        ("fsdp", 900, 69, 300, 0, 8),  # by far, and the cost per block too
        ("fsdp", 300, 40, 600, 30, 5),  # it overestimates both: the first guess fits, with room
        ("ddp", 400, 150, 400, 0, 4),  # DDP: steep
    ],
)
def test_search_finds_the_boundary_in_few_trials(
    name: str,
    intercept_mib: int,
    per_block_mib: int,
    model_intercept_mib: int,
    model_extra_mib: int,
    most_trials: int,
) -> None:
    budget = 1600 * MIB

    def peak(depth: int) -> float:
        # A little curvature and noise, as measured peaks have.
        return (intercept_mib + per_block_mib * depth + 3 * (depth % 3)) * MIB

    model = MemoryModel(model_intercept_mib * MIB, model_extra_mib * MIB)
    search = simulate(peak, budget, model, max_trials=most_trials, name=name)
    truth = max(d for d in range(1, 200) if peak(d) <= budget)
    assert search.resolved, [(t.depth, t.fits) for t in search.trials]
    assert search.largest_fit is not None and search.largest_fit.depth == truth


def test_search_when_nothing_fits() -> None:
    search = simulate(lambda depth: 2000 * MIB, 1600 * MIB, MemoryModel(300 * MIB, 0))
    assert search.resolved and search.largest_fit is None
    assert search.smallest_failure is not None and search.smallest_failure.depth == 1


def test_report_from_results(tmp_path: Path) -> None:
    # The table, targets and chart from a results file, as --render draws them (no runs).
    def record(config: str, world_size: int, fit: int, fail: int, ratio: float) -> Dict[str, object]:
        shape = SHAPES["full"]
        fit_trial = {
            "depth": fit,
            "parameters": model_parameters(shape, fit),
            "peak_vm_data_bytes": 1500 * MIB,
            "peak_rss_bytes": 1480 * MIB,
            "peak_vm_size_bytes": 2400 * MIB,
            "main_peak_rss_bytes": 1200 * MIB,
            "consolidation_vm_data_bytes": 1900 * MIB,
        }
        fail_trial = {
            "depth": fail,
            "parameters": model_parameters(shape, fail),
            "error": "can't allocate 9.0 MiB (ENOMEM) in adam.py:_init_group",
            "memory_error": True,
        }
        return {
            "config": config,
            "world_size": world_size,
            "resolved": True,
            "fit": fit_trial,
            "fail": fail_trial,
            "fit_parameters": fit_trial["parameters"],
            "fail_parameters": fail_trial["parameters"],
            "vs_ddp": ratio,
            "trials": [fit_trial, fail_trial],
            "breakdown_bytes": {
                "runtime": 300 * MIB,
                "model_state": 900 * MIB,
                "rest": 300 * MIB,
                "headroom": 100 * MIB,
            },
        }

    records: List[Dict[str, object]] = [
        record("ddp", 2, 8, 9, 1.0),
        record("fsdp", 2, 15, 16, 1.87),
        record("ddp", 4, 8, 9, 1.0),
        record("fsdp", 4, 26, 27, 3.24),
    ]
    data = {
        "environment": {"machine": "test"},
        "settings": {
            "quick": False,
            "steps": 3,
            "batch_size": 2,
            "world_sizes": [2, 4],
            "configs": ["ddp", "fsdp"],
            "shape": SHAPES["full"],
        },
        "budget_bytes": 1600 * MIB,
        "records": records,
    }

    class Args:
        json = tmp_path / "capacity.json"
        markdown = tmp_path / "capacity.md"
        chart = tmp_path / "capacity.png"

    text = write_outputs(data, Args)  # type: ignore[arg-type]
    assert "| `fsdp` | 2 | 106.6 M (15 blocks) | 1.87 | 113.7 M (16 blocks) |" in text
    assert "| 2 | >= 1.8 x | 1.87 x | met |" in text
    assert "| 4 | >= 3.2 x | 3.24 x | met |" in text
    assert Args.markdown.read_text() == text
    assert json.loads(Args.json.read_text())["budget_bytes"] == 1600 * MIB
    assert Args.chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# The example, end to end: two `tango run`s of examples/capacity on 2 CPU workers.


def run_example(workspace: Path, *ext_vars: str) -> "subprocess.CompletedProcess[str]":
    command = [TANGO, "--log-level", "info", "run", "config.jsonnet", "-w", str(workspace)]
    for ext_var in ext_vars:
        command += ["--ext-var", ext_var]
    command += ["--overrides", json.dumps({"steps.train.distributed_port": free_port()})]

    def limit() -> None:  # `ulimit -d`: the tango run process, so every worker too
        resource.setrlimit(resource.RLIMIT_DATA, (BUDGET_KIB * 1024, BUDGET_KIB * 1024))

    return subprocess.run(
        command,
        cwd=EXAMPLE_DIR,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        preexec_fn=limit,
    )


def work_dir(workspace: Path) -> Path:
    return workspace / "latest" / "train" / "work"


@pytest.mark.capacity
def test_example_ddp_runs_out_of_memory(tmp_path: Path) -> None:
    result = run_example(tmp_path / "ddp", "engine=ddp")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    # The allocation that the budget refused, from PyTorch's CPU allocator: ENOMEM.
    assert "DefaultCPUAllocator: can't allocate memory" in output, output[-4000:]
    assert "Error code 12 (Cannot allocate memory)" in output


@pytest.mark.capacity
@pytest.mark.parametrize("engine", ["fsdp", "fsdp2"])
def test_example_fsdp_trains_in_the_same_budget(tmp_path: Path, engine: str) -> None:
    workspace = tmp_path / engine
    result = run_example(workspace, f"engine={engine}")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    curve = [json.loads(line) for line in (work_dir(workspace) / "validation.jsonl").open()]
    assert len(curve) >= 2
    assert curve[-1]["loss"] < curve[0]["loss"] - 0.5, curve
    # The run finished: weights.pt and the step's result, the trained model, equal to it.
    weights = torch.load(work_dir(workspace) / "weights.pt", weights_only=True)
    workspace_ = LocalWorkspace(workspace)
    (run_name,) = workspace_.registered_runs().keys()
    model = workspace_.step_result_for_run(run_name, "train")
    state = model.state_dict()
    assert max((state[k] - weights[k]).abs().max().item() for k in weights) == 0.0
    # Each worker ran under the budget (inherited from the tango process), and stayed in it.
    for worker in (0, 1):
        record = json.loads((work_dir(workspace) / f"capacity_worker{worker}.json").read_text())
        assert record["limit_bytes"] == BUDGET_KIB * 1024
        assert record["peak_vm_data_bytes"] <= record["limit_bytes"]
        print(f"[{engine}] worker {worker}: peak VmData {record['peak_vm_data_bytes'] / 2**20:,.0f} MiB")
