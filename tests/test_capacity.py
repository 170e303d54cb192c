"""
The capacity benchmark (benchmarks/capacity.py) and example (examples/capacity): the per-worker
memory limit, the search for the largest model that fits, the report, and, end to end, the
example's GPT-2 failing for memory under Tango's DDP engine and training with FSDP in the same
budget.
"""

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest
import torch
from tango.workspaces import LocalWorkspace

from benchmarks.capacity import (
    FAMILIES,
    GPT2,
    SHAPES,
    MemoryModel,
    Search,
    Trial,
    failure_reason,
    model_parameters,
    next_depth,
    run_trial,
    write_outputs,
)
from benchmarks.components import parse_bytes
from tests.helpers import REPO, TANGO, free_port

EXAMPLE_DIR = REPO / "examples" / "capacity"
#: The example's budget for each process of the run: `ulimit -d 1468006` (KiB) in its README.
BUDGET_KIB = 1468006
assert f"ulimit -d {BUDGET_KIB}" in (EXAMPLE_DIR / "README.md").read_text()
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
        depth = next_depth(search, budget, model, GPT2, shape)
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("size", ["quick", "full"])
def test_family_counts_its_model(family: str, size: str) -> None:
    # What the search and the report count (parameters per depth) is the model the trials build,
    # with one unit per block under the class name the wrap plan selects.
    from tango.integrations.torch import Model

    import benchmarks.components  # noqa: F401 - registers the families' models
    import examples.train_gpt2.components  # noqa: F401 - GPT-2's

    chosen = FAMILIES[family]
    shape = chosen.shapes[size]
    config = chosen.model(shape, 3)
    with torch.device("meta"):
        model = Model.by_name(config.pop("type"))(**config)  # type: ignore[operator]
    blocks = [m for m in model.modules() if type(m).__name__ == chosen.unit]
    assert len(blocks) == 3
    assert sum(p.numel() for p in blocks[0].parameters()) == chosen.block_parameters(shape)
    assert sum(p.numel() for p in model.parameters()) == chosen.model_parameters(shape, 3)
    assert chosen.model_parameters(shape, 0) == chosen.fixed_parameters(shape)


@pytest.mark.extended
@pytest.mark.parametrize("family", ["mlp", "llama"])
def test_quick_trial_of_a_family(tmp_path: Path, family: str) -> None:
    # One trial of the benchmark on the family's quick shape (a tango run of 2 workers, no limit):
    # FairScale units of the family's blocks train, the records are read back, and the losses
    # are DDP's (init_on_meta builds the eager model's values).
    chosen = FAMILIES[family]
    args = _quick_args(family)
    trials = {name: run_trial(name, 2, 2, args, tmp_path, None) for name in ("ddp", "fsdp")}
    for trial in trials.values():
        assert trial.fits, trial.error
        assert trial.parameters == chosen.model_parameters(args.shape, 2)
        assert trial.peak_vm_data_bytes and trial.state_bytes
    ddp, fsdp = trials["ddp"].losses, trials["fsdp"].losses
    assert ddp is not None and fsdp is not None and len(ddp) == 2
    assert fsdp == pytest.approx(ddp, rel=1e-5, abs=1e-6)


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


# LoRA against full fine-tuning (benchmarks/capacity.py --lora): the trials' config and
# pretrained files, the report, and one trial of the quick shape.


def _quick_args(family: str, budget: Optional[int] = None) -> argparse.Namespace:
    """The options of a trial of ``family``'s quick shape (2 sequences, 2 steps), as the CLI parses them."""
    chosen = FAMILIES[family]
    return argparse.Namespace(
        family=chosen,
        shape=chosen.shapes["quick"],
        batch_size=2,
        steps=2,
        trial_timeout=300,
        budget_bytes=budget,
    )


def test_lora_trial_config_and_its_pretrained_files(tmp_path: Path) -> None:
    # A LoRA trial fine-tunes the files written before it, as a downloaded model, with adapters on
    # q_proj and v_proj; a full one the same files; both under init_on_meta, exporting.
    from transformers import AutoModelForCausalLM

    from benchmarks.capacity import FAMILIES as families
    from benchmarks.capacity import LORA_OPTIONS, experiment

    args = _quick_args("llama")
    records = tmp_path / "run" / "records"
    lora = experiment("fsdp_lora", 2, 3, args, records)["steps"]["train"]
    full = experiment("fsdp2_full", 2, 3, args, records)["steps"]["train"]
    assert lora["model"]["model"]["type"] == "fairscale::with_lora"
    assert {k: lora["model"]["model"][k] for k in LORA_OPTIONS} == LORA_OPTIONS
    pretrained = lora["model"]["model"]["model"]
    assert full["model"]["model"] == pretrained and pretrained["type"] == "fairscale::from_pretrained"
    assert lora["model"]["wrap_module_classes"] == ["LlamaDecoderLayer"]
    for train, backend in ((lora, None), (full, "torch")):
        engine = train["training_engine"]
        assert engine["init_on_meta"] is True and engine["export_hf"] == "hf"
        assert engine.get("backend") == backend
    directory = Path(pretrained["pretrained_model_name_or_path"])
    assert directory.parent == tmp_path / "pretrained"
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == families["llama"].model_parameters(args.shape, 3)
    assert torch.equal(model.model.norm.weight, torch.ones(args.shape["hidden_size"]))
    assert 0.015 < model.model.layers[2].mlp.up_proj.weight.std().item() < 0.025


def test_lora_report_from_results(tmp_path: Path) -> None:
    # The LoRA section from a results file (no runs): the ratio to full fine-tuning, the target,
    # and each process's peaks in the largest that fits and the smallest that fails.
    from benchmarks.capacity import FAMILIES as families

    llama, shape = families["llama"], families["llama"].shapes["full"]

    def trial(depth: int, main_mib: int, error: Optional[str] = None) -> Dict[str, object]:
        return {
            "depth": depth,
            "parameters": llama.model_parameters(shape, depth),
            "training_vm_data_bytes": 1200 * MIB,
            "consolidation_vm_data_bytes": 1100 * MIB,
            "main_peak_vm_data_bytes": main_mib * MIB,
            "error": error,
            "memory_error": error is not None,
        }

    def record(config: str, fit: int, fail: int) -> Dict[str, object]:
        fits, fails = (
            trial(fit, 1500),
            trial(fail, 1590, "can't allocate 6.0 MiB (ENOMEM) in serialization.py:load"),
        )
        return {
            "config": config,
            "world_size": 2,
            "resolved": True,
            "fit": fits,
            "fail": fails,
            "fit_parameters": fits["parameters"],
            "fail_parameters": fails["parameters"],
            "trials": [fits, fails],
        }

    data = {
        "environment": {"machine": "test"},
        "settings": {
            "quick": False,
            "steps": 3,
            "batch_size": 2,
            "world_sizes": [2],
            "lora": {"r": 8, "target_modules": ["q_proj", "v_proj"]},
            "shape": shape,
        },
        "budget_bytes": 1600 * MIB,
        "records": [record("fsdp_full", 16, 17), record("fsdp_lora", 49, 50)],
    }

    class Args:
        json = tmp_path / "capacity-lora.json"
        markdown = tmp_path / "capacity-lora.md"
        chart = tmp_path / "capacity-lora.png"

    text = write_outputs(data, Args)  # type: ignore[arg-type]
    assert (
        "Reproduce: `python benchmarks/run.py --capacity --lora --world-sizes 2 --budget 1677721600`" in text
    )
    assert "| `fairscale` | 2 | 100.9 M (16 layers) | 107.2 M (17 layers) | 308.6 M (49 layers) " in text
    assert "| 3.06 x | 2+2 |" in text and "| LoRA >= 3.0 x full | `fairscale` | 2 | 3.06 x | met |" in text
    assert (
        "| `fsdp_lora` | 2 | 308.6 M (49 layers) | 1,200 MiB | 1,100 MiB | 1,500 MiB | 314.8 M (50 layers)"
        in text
    )
    assert Args.markdown.read_text() == text and not Args.chart.exists()


@pytest.mark.extended
def test_quick_lora_trial_runs_and_records(tmp_path: Path) -> None:
    # One LoRA trial of the quick shape under the benchmark's budget: it fits, with every
    # process's peak recorded, and the search reads the largest of them.
    from benchmarks.capacity import FAMILIES as families

    args = _quick_args("llama", budget=1600 * MIB)
    trial = run_trial("fsdp_lora", 2, 2, args, tmp_path, None)
    assert trial.fits, trial.error
    assert trial.parameters == families["llama"].model_parameters(args.shape, 2)
    peaks = [trial.training_vm_data_bytes, trial.consolidation_vm_data_bytes, trial.main_peak_vm_data_bytes]
    assert all(peak and 100 * MIB < peak < 1600 * MIB for peak in peaks), peaks
    assert trial.run_peak_vm_data_bytes == max(peaks)  # type: ignore[type-var]
    assert trial.losses is not None and len(trial.losses) == 2
    # Adapters only train: a few kB of AdamW state beside the frozen shard (parameters only).
    assert trial.state_bytes is not None
    frozen_shard = families["llama"].model_parameters(args.shape, 2) * 4 / 2
    assert frozen_shard <= trial.state_bytes < frozen_shard * 1.2
