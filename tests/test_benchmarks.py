"""The benchmark harness in its --quick modes: every configuration runs and produces numbers."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import MODELS, matmul_parameters, peak_tflops_for, training_flops_per_token
from benchmarks.run import CONFIGS
from tests.helpers import REPO


def run_benchmarks(*arguments: str, timeout: float = 600) -> "subprocess.CompletedProcess[str]":
    """``python benchmarks/run.py ARGUMENTS`` from the repository root."""
    return subprocess.run(
        [sys.executable, "benchmarks/run.py", *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
def test_quick_benchmark_runs_every_configuration(tmp_path: Path) -> None:
    result = run_benchmarks(
        "--quick",
        "--world-sizes",
        "2",
        "--json",
        str(tmp_path / "results.json"),
        "--markdown",
        str(tmp_path / "benchmarks.md"),
        "--chart",
        str(tmp_path / "benchmarks.png"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    records = {(r["config"], r["world_size"]): r for r in data["records"]}
    assert set(records) == {("ddp", 1)} | {(name, 2) for name in CONFIGS}
    for record in records.values():
        assert record["state_bytes_per_worker"] > 0
        assert record["peak_rss_bytes_per_worker"] > 0
        assert record["step_time_s"] > 0
        assert len(record["workers"]) == record["world_size"]
        # Time in FairScale's collectives is measured for this plugin's configurations only.
        if CONFIGS[record["config"]][0] == "fairscale":
            assert record["collectives_time_s"] > 0
        else:
            assert record["collectives_time_s"] is None
    # Sharding shows up in the exact tensor accounting (no timing assertions).
    assert (
        records[("fsdp", 2)]["state_bytes_per_worker"] < 0.6 * records[("ddp", 2)]["state_bytes_per_worker"]
    )
    assert (
        records[("fsdp2", 2)]["state_bytes_per_worker"] < 0.6 * records[("ddp", 2)]["state_bytes_per_worker"]
    )
    table = (tmp_path / "benchmarks.md").read_text()
    for name in CONFIGS:
        assert f"| `{name}` | 2 |" in table
    assert (tmp_path / "benchmarks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_gpu_mode_harness_on_a_cpu_worker(tmp_path: Path) -> None:
    # The GPU mode's harness (engine on world size 1, timing, tokens/s, MFU, report) on the CPU,
    # where only fp32 applies; the AMP configurations are reported as skipped.
    result = run_benchmarks(
        "--gpu",
        "--device",
        "cpu",
        "--quick",
        "--peak-tflops",
        "1.5",
        "--json",
        str(tmp_path / "gpu.json"),
        "--markdown",
        str(tmp_path / "gpu.md"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    (record,) = data["records"]
    assert record["config"] == "fp32"
    assert (record["world_size"], record["backend"]) == (1, "gloo")
    assert len(record["losses"]) == data["settings"]["steps"]
    assert all(math.isfinite(loss) for loss in record["losses"])
    expected_tokens_per_s = (
        data["settings"]["batch_size"] * MODELS["quick"]["n_positions"] / record["step_time_s"]
    )
    assert record["tokens_per_s"] == pytest.approx(expected_tokens_per_s)
    assert record["mfu"] == pytest.approx(record["flops_per_token"] * record["tokens_per_s"] / 1.5e12)
    assert set(data["skipped"]) == {"amp", "amp_mixed_precision"}
    table = (tmp_path / "gpu.md").read_text()
    assert "| `fp32` |" in table and "| `amp` | skipped: float16 AMP needs CUDA" in table


def test_gpu_mode_without_cuda_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = run_benchmarks("--gpu", "--quick", timeout=120)
    assert result.returncode == 2
    assert "--gpu needs a CUDA GPU" in result.stderr and "--device cpu" in result.stderr


def test_training_flops_formula_matches_counted_flops() -> None:
    # 6 N + 12 L d T per token against PyTorch's FLOP counter over a real forward and backward
    # pass (eager attention, so that its two matrix products are counted as matmuls).
    from torch.utils.flop_counter import FlopCounterMode

    from examples.train_gpt2.components import GPT2LanguageModel

    shape = MODELS["quick"]
    model = GPT2LanguageModel(dropout=0.0, **shape)
    model.transformer.config._attn_implementation = "eager"
    batch, length = 3, shape["n_positions"]
    tokens = torch.randint(shape["vocab_size"], (batch, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=tokens, labels=tokens)["loss"].backward()
    per_token = training_flops_per_token(matmul_parameters(model), shape["n_layer"], shape["n_embd"], length)
    assert counter.get_total_flops() == pytest.approx(per_token * batch * length, rel=0.01)


def test_peak_tflops_table() -> None:
    assert peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756.5
    assert peak_tflops_for("NVIDIA H200") == 989.4
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops_for("Some Future Accelerator") is None
