"""
The GPT-2 example (examples/train_gpt2) end to end through the ``tango`` command line, in its
``tiny`` size (extended: make test runs the fine-tuning example through the CLI,
tests/test_example_finetune.py), and the ``fairscale::memory`` callback on its own.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
from tango.integrations.torch import TrainConfig

from tango_fairscale.telemetry.callbacks import MemoryCallback, WorkerStats, format_summary
from tests.helpers import TANGO, free_port

EXAMPLE_DIR = Path(__file__).resolve().parent.parent / "examples" / "train_gpt2"
SIZE = "tiny"


def _train_step_config() -> Dict[str, Any]:
    """The example's ``train`` step, as the tests run it."""
    from tango.common import Params

    params = Params.from_file(EXAMPLE_DIR / "config.jsonnet", ext_vars={"size": SIZE}).as_dict(quiet=True)
    return params["steps"]["train"]


def _plain_gpt2(model_config: Dict[str, Any]):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=model_config["vocab_size"],
            n_positions=model_config["n_positions"],
            n_embd=model_config["n_embd"],
            n_layer=model_config["n_layer"],
            n_head=model_config["n_head"],
        )
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Tuple[subprocess.CompletedProcess, Path]:
    """One ``tango run`` of the example in its tiny size, shared by the tests below."""
    workspace = tmp_path_factory.mktemp("gpt2_workspace")
    # Also record each worker's model-state bytes, for the `plan` estimate below.
    callbacks = _train_step_config()["callbacks"] + [{"type": "test::record_state_sizes"}]
    overrides = json.dumps({"steps.train.distributed_port": free_port(), "steps.train.callbacks": callbacks})
    command = [TANGO, "--log-level", "info", "run", "config.jsonnet", "-w", str(workspace)]
    command += ["--ext-var", f"size={SIZE}", "--overrides", overrides, "-i", "tests.components"]
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE_DIR.parent.parent)}
    result = subprocess.run(command, cwd=EXAMPLE_DIR, env=env, capture_output=True, text=True, timeout=300)
    return result, workspace


def _output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


@pytest.mark.extended
def test_example_trains_and_writes_plain_gpt2_weights(trained) -> None:
    result, workspace = trained
    assert result.returncode == 0, _output(result)[-6000:]
    work_dir = workspace / "latest" / "train" / "work"

    # The consolidated weights are a plain GPT-2 state dict.
    weights = work_dir / "weights.pt"
    assert weights.is_file()
    state = torch.load(weights, map_location="cpu", weights_only=True)
    model = _plain_gpt2(_train_step_config()["model"]["model"])
    model.load_state_dict(state, strict=True)

    # The validation loss went down, and the weights are the trained ones: the plain model
    # gets (about) the last validation loss on the validation blocks. Not exactly, because
    # Tango averages per batch and the last batch is smaller.
    curve: List[Dict[str, float]] = [json.loads(line) for line in (work_dir / "validation.jsonl").open()]
    assert len(curve) >= 2
    assert curve[-1]["loss"] < curve[0]["loss"] - 0.1, curve
    assert "Validation after step" in _output(result)

    from tango.workspaces import LocalWorkspace

    validation = LocalWorkspace(workspace).step_result("tokenized")["validation"]
    input_ids = torch.stack([item["input_ids"] for item in validation])
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=input_ids, labels=input_ids).loss.item()
    assert loss < math.log(model.config.vocab_size) - 1.0
    assert abs(loss - curve[-1]["loss"]) < 0.05, (loss, curve)


@pytest.mark.extended
def test_example_prints_memory_summary(trained) -> None:
    result, workspace = trained
    assert result.returncode == 0, _output(result)[-6000:]
    output = _output(result)
    assert "Per-worker memory and throughput (fairscale::memory)" in output
    table = output.split("Per-worker memory and throughput (fairscale::memory):", 1)[1]
    header, _rule, *rows = table.strip().splitlines()
    assert header.split()[:2] == ["worker", "device"]
    assert [row.split()[0] for row in rows[:2]] == ["0", "1"]

    summary = json.loads((workspace / "latest" / "train" / "work" / "memory_summary.json").read_text())
    workers = summary["workers"]
    assert [w["worker"] for w in workers] == [0, 1]
    for worker in workers:
        assert worker["peak_memory_mib"] > 0
        assert worker["samples_per_second"] > 0
        assert worker["steps"] == _train_step_config()["train_steps"]


@pytest.mark.extended
def test_generate_prints_text(trained) -> None:
    result, workspace = trained
    assert result.returncode == 0, _output(result)[-6000:]
    prompt = "Alice said"
    generated = subprocess.run(
        [sys.executable, "generate.py", str(workspace), "--prompt", prompt, "--max-new-tokens", "80"],
        cwd=EXAMPLE_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert generated.returncode == 0, generated.stderr[-4000:]
    text = generated.stdout.strip()
    assert text.startswith(prompt)
    assert len(text) > len(prompt) + 10


def test_format_summary_one_row_per_worker_and_a_total() -> None:
    figures = {"tokens": 300 * 64, "flops": 3e11, "peak_flops_per_second": 1e11}
    stats = [
        WorkerStats(
            worker=1,
            device="cpu",
            peak_memory_mib=600.25,
            samples=300,
            steps=30,
            train_seconds=10.0,
            collective_seconds=6.0,
            **figures,
        ),
        WorkerStats(
            worker=0,
            device="cpu",
            peak_memory_mib=512.0,
            samples=300,
            steps=30,
            train_seconds=6.0,
            collective_seconds=3.0,
            **figures,
        ),
    ]
    lines = format_summary(stats).splitlines()
    assert lines[0].split() == [
        "worker",
        "device",
        "peak",
        "memory",
        "(MiB)",
        "samples/s",
        "tokens/s",
        "MFU",
        "collectives",
        "(s/step)",
        "steps",
    ]
    assert set(lines[1]) == {"-", " "}
    # 3e11 FLOPs in 6 s against a peak of 1e11 FLOP/s: 50 %.
    assert lines[2].split() == ["0", "cpu", "512.0", "50.0", "3200.0", "50.00%", "0.100", "30"]
    assert lines[3].split() == ["1", "cpu", "600.2", "30.0", "1920.0", "30.00%", "0.200", "30"]
    assert set(lines[4]) == {"-", " "}
    # The total: the highest peak, the summed throughput, all FLOP/s over all peaks, the slowest
    # worker's time in collectives.
    assert lines[5].split() == ["all", "600.2", "80.0", "5120.0", "40.00%", "0.200", "30"]
    # Columns line up: every row is as wide as the header's columns need.
    assert len({line.index("cpu") for line in lines[2:4]}) == 1


def test_format_summary_single_worker_has_no_total() -> None:
    stats = [
        WorkerStats(worker=0, device="cuda:0", peak_memory_mib=1.5, samples=0, steps=0, train_seconds=0.0)
    ]
    lines = format_summary(stats).splitlines()
    assert len(lines) == 3
    # Nothing measured yet, no tokens, no peak: dashes.
    assert lines[2].split() == ["0", "cuda:0", "1.5", "0.0", "-", "-", "-", "0"]


def test_memory_callback_counts_samples_and_steps(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # devices=[-1]: a CPU worker even where there is a GPU, so that peak memory is the RSS.
    config = TrainConfig(step_id="test", work_dir=tmp_path, train_steps=3, log_every=1, devices=[-1])
    callback = MemoryCallback(
        workspace=None,
        train_config=config,
        training_engine=None,
        dataset_dict=None,
        train_dataloader=None,
    )
    callback.pre_train_loop()
    for step in range(3):
        # Two micro-batches of 4 samples (gradient accumulation): 8 samples per step.
        batch = [{"input_ids": torch.zeros(4, 5), "labels": torch.zeros(4, 5)}] * 2
        callback.pre_batch(step, 0, batch)
        callback.post_batch(step, 0, 0.0, [])
    callback.pre_val_batch(2, 0, 0, {})
    # Time spent validating is not training time.
    seconds = callback.train_seconds
    callback.post_train_loop(2, 0)
    assert callback.train_seconds == seconds

    assert (callback.samples, callback.steps) == (24, 3)
    printed = capsys.readouterr().out
    assert "Per-worker memory and throughput (fairscale::memory)" in printed
    summary = json.loads((tmp_path / "memory_summary.json").read_text())
    (worker,) = summary["workers"]
    assert (worker["worker"], worker["device"], worker["samples"], worker["steps"]) == (0, "cpu", 24, 3)
    assert worker["peak_memory_mib"] > 0
    # input_ids of 4 x 5: 40 tokens a step. No model ran between the hooks: no FLOPs, MFU 0.
    assert worker["tokens"] == 120 and worker["tokens_per_second"] == 120 / worker["train_seconds"]
    assert worker["flops"] == 0.0 and worker["mfu"] == 0.0 and worker["peak_flops_per_second"] > 0
    assert worker["collective_seconds"] is None  # no timed collective ran in this process

    # A resumed run continues the counts.
    resumed = MemoryCallback(
        workspace=None, train_config=config, training_engine=None, dataset_dict=None, train_dataloader=None
    )
    resumed.load_state_dict(callback.state_dict())
    assert (resumed.samples, resumed.steps, resumed.tokens) == (24, 3, 120)


def test_memory_callback_is_registered() -> None:
    from tango.integrations.torch import TrainCallback

    assert TrainCallback.by_name("fairscale::memory") is MemoryCallback


@pytest.mark.extended
def test_plan_estimate_matches_the_example_run(trained, tmp_path: Path) -> None:
    result, workspace = trained
    assert result.returncode == 0, _output(result)[-6000:]
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "tango_fairscale",
            "plan",
            "config.jsonnet",
            "--ext-var",
            f"size={SIZE}",
            "--json",
            str(tmp_path / "plan.json"),
        ],
        cwd=EXAMPLE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    print(plan.stdout)
    assert "transformer.h.0 (GPT2Block)" in plan.stdout and "yes" in plan.stdout
    estimate = json.loads((tmp_path / "plan.json").read_text())
    assert [unit["name"] for unit in estimate["units"]][1:] == ["transformer.h.0", "transformer.h.1"]
    work_dir = workspace / "latest" / "train" / "work"
    sizes = sorted(work_dir.glob("state_sizes_worker*.json"))
    assert len(sizes) == 2
    for path in sizes:
        measured = json.loads(path.read_text())
        total = measured["param_bytes"] + measured["grad_bytes"] + measured["optimizer_bytes"]
        estimated = estimate["bytes_per_worker"]["total"]
        print(f"worker {measured['worker']}: measured {total} B, estimated {estimated} B")
        assert abs(estimated - total) <= 0.10 * total
