"""The benchmark harness in its --quick modes: every configuration runs and produces numbers."""

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from benchmarks.common import DOCS, RESULTS, chart_link
from benchmarks.gpu import CONFIGS as GPU_CONFIGS
from benchmarks.gpu import (
    LLAMA_MODELS,
    MODELS,
    LlamaLanguageModel,
    baseline_of,
    matmul_parameters,
    peak_tflops_for,
    training_flops_per_token,
)
from benchmarks.run import CONFIGS, GRAD_ACCUM, experiment
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


def calls_per_step(record: Dict[str, Any], name: str) -> List[int]:
    """A configuration's calls of an FSDP collective in each optimizer step, on every worker."""
    return [calls for worker in record["workers"] for calls in worker["collective_calls_per_step"][name]]


@pytest.mark.extended
@pytest.mark.timeout(1500)
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
        timeout=1400,
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
        # CPU seconds of each step, per worker, beside its wall time; the record has the workers' mean.
        for worker in record["workers"]:
            assert len(worker["cpu_times_s"]) == len(worker["step_times_s"]) > 0
            assert all(seconds > 0 for seconds in worker["cpu_times_s"])
        assert record["cpu_time_s"] == statistics.mean(w["cpu_time_s"] for w in record["workers"])
        # Time in FSDP's collectives is measured for both backends of the engine (not for DDP's
        # all-reduces), in all of them and per function.
        timed = ("collectives_time_s", "all_gather_time_s", "reduce_scatter_time_s")
        if CONFIGS[record["config"]].times_collectives:
            assert all(record[key] > 0 for key in timed), record["config"]
            assert all(calls_per_step(record, "all_gather")) and all(calls_per_step(record, "reduce_scatter"))
        else:
            assert all(record[key] is None for key in timed), record["config"]
            assert calls_per_step(record, "all_gather") == calls_per_step(record, "reduce_scatter") == []
        # MFU: the metrics log's FLOPs of a step over the median step time and the measured peak.
        assert record["model_flops_per_step"] > 0
        assert (
            record["mfu"]
            == record["model_flops_per_step"] / record["step_time_s"] / data["peak"]["flops_per_second"]
        )
        assert 0 < record["mfu"] <= 1 and 0 < record["metrics_log_mfu"] <= 1
    # The FLOPs of a step: those of one worker's batch times the workers (and the micro-batches).
    one = records[("ddp", 1)]["model_flops_per_step"]
    assert records[("fsdp", 2)]["model_flops_per_step"] == 2 * one
    assert records[("fsdp2", 2)]["model_flops_per_step"] == 2 * one
    assert records[("fsdp_accum", 2)]["model_flops_per_step"] == 2 * GRAD_ACCUM * one
    # The machine's peak, measured once on all cores by the peak command the page names.
    assert data["peak"]["command"] == f"python -m tango_fairscale peak --threads {os.cpu_count()} --seconds 3"
    assert data["peak"]["flops_per_second"] > 0
    # Sharding shows up in the exact tensor accounting (no timing assertions), FSDP2 (the
    # engine's torch backend) included.
    ddp_state = records[("ddp", 2)]["state_bytes_per_worker"]
    for name in ("fsdp", "fsdp2", "fsdp2_eager_init", "fsdp_accum", "fsdp_accum_local"):
        assert records[(name, 2)]["state_bytes_per_worker"] < 0.6 * ddp_state, name
    # Gradient accumulation, counted call by call: a reduce-scatter per micro-batch, or with
    # accumulate_grads_locally one per optimizer step, as without accumulation.
    once = calls_per_step(records[("fsdp", 2)], "reduce_scatter")
    accum = calls_per_step(records[("fsdp_accum", 2)], "reduce_scatter")
    local = calls_per_step(records[("fsdp_accum_local", 2)], "reduce_scatter")
    assert accum == [GRAD_ACCUM * calls for calls in local]
    assert local == once
    assert calls_per_step(records[("fsdp_accum_local_no_reshard", 2)], "reduce_scatter") == local
    # Without resharding after forward, the gathered parameters stay for the whole step.
    gathers = calls_per_step(records[("fsdp_accum_local_no_reshard", 2)], "all_gather")
    assert max(gathers) < min(calls_per_step(records[("fsdp_accum_local", 2)], "all_gather"))
    table = (tmp_path / "benchmarks.md").read_text()
    assert "| x `fsdp` | MFU | in collectives | all-gather | reduce-scatter |" in table
    # The torch backend's step against the fairscale backend's, and its targets beside fsdp's.
    fsdp2 = records[("fsdp2", 2)]
    assert fsdp2["time_vs_fsdp"] == fsdp2["step_time_s"] / records[("fsdp", 2)]["step_time_s"]
    verdict = "met" if fsdp2["time_vs_fsdp"] <= 1.0 else "missed"
    what = "step time / the fairscale backend's (`fsdp`)"
    assert f"| `fsdp2` | 2 | {what} | <= 1.00 | {fsdp2['time_vs_fsdp']:.3f} | {verdict} |" in table
    assert f"`{data['peak']['command']}`" in table
    for name in CONFIGS:
        assert f"| `{name}` | 2 |" in table
    ddp_row = next(line for line in table.splitlines() if line.startswith("| `ddp` | 2 |"))
    assert ddp_row.endswith("| - | - | - |") and ddp_row.count(" % |") == 1
    for name in ("fsdp", "fsdp2"):
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` | 2 |"))
        assert row.count(" s |") == 4  # the step time and the three collective times
        assert f"| {100 * records[(name, 2)]['mfu']:.2f} % |" in row
    assert (tmp_path / "benchmarks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_experiments_configure_the_engine_and_gradient_accumulation() -> None:
    model = {"n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16, "n_positions": 4}

    def steps(name: str) -> Dict[str, Any]:
        return experiment(name, world_size=2, model=model, steps=3, warmup=1, batch_size=2)["steps"]

    # FSDP2 is the real engine's torch backend, with the same wrap plan as the FairScale configurations.
    for name, meta in (("fsdp2", True), ("fsdp2_eager_init", False)):
        train = steps(name)["train"]
        assert train["training_engine"]["type"] == "fairscale"
        assert train["training_engine"]["backend"] == "torch"
        assert train["training_engine"].get("init_on_meta", False) is meta
        assert train["model"]["type"] == "fairscale::with_wrapped_modules"
        assert train["model"]["wrap_module_classes"] == ["GPT2Block"]
        assert "grad_accum" not in train
    assert not any(config.engine.startswith("benchmark::") for config in CONFIGS.values())

    plain = steps("fsdp")
    for name, local in (
        ("fsdp_accum", False),
        ("fsdp_accum_local", True),
        ("fsdp_accum_local_no_reshard", True),
    ):
        accumulating = steps(name)
        train = accumulating["train"]
        assert train["grad_accum"] == GRAD_ACCUM
        assert train["training_engine"]["accumulate_grads_locally"] is local
        assert train["training_engine"]["init_on_meta"] is True
        # The data grows with the micro-batches: every step gets all of them.
        assert accumulating["data"]["count"] == GRAD_ACCUM * plain["data"]["count"]
        assert accumulating["data"]["count"] >= 2 * 2 * 3 * GRAD_ACCUM
    no_reshard = steps("fsdp_accum_local_no_reshard")["train"]
    assert no_reshard["training_engine"]["fsdp_config"] == {"reshard_after_forward": False}
    assert no_reshard["model"]["fsdp_config"] == {"reshard_after_forward": False}


@pytest.mark.extended  # the GPU mode runs on a GPU (tests/test_gpu.py); here its harness on a CPU
def test_gpu_mode_harness_on_a_cpu_worker(tmp_path: Path) -> None:
    # The GPU mode's harness (engine on world size 1, timing, tokens/s, MFU, report) on the CPU,
    # where only fp32 applies; the AMP configurations are reported as skipped.
    result = run_benchmarks(
        "--gpu",
        "--device",
        "cpu",
        "--quick",
        "--configs",
        "fp32,plain_fp32,amp,amp_mixed_precision",
        "--peak-tflops",
        "1.5",
        "--json",
        str(tmp_path / "gpu.json"),
        "--markdown",
        str(tmp_path / "gpu.md"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    record, plain = data["records"]
    assert (record["config"], plain["config"]) == ("fp32", "plain_fp32")
    # The baseline: the same model and steps without the engine or a process group; after a step
    # it holds, as the engine does, its parameters, their gradients and AdamW's two moments (and
    # a step count per tensor: the engine's flat parameters are fewer tensors).
    assert plain["backend"] == "none" and len(plain["losses"]) == len(record["losses"])
    assert plain["parameters"] == record["parameters"]
    for key in ("parameters", "gradients"):
        assert plain["state_bytes"][key] == record["state_bytes"][key] > 0, key
    for state in (plain["state_bytes"], record["state_bytes"]):
        assert 2 * state["parameters"] <= state["optimizer_state"] < 2 * state["parameters"] + 1024
    assert plain["losses"][0] == pytest.approx(record["losses"][0], rel=1e-5)
    assert (record["world_size"], record["backend"]) == (1, "gloo")
    assert len(record["losses"]) == data["settings"]["steps"]
    assert all(math.isfinite(loss) for loss in record["losses"])
    expected_tokens_per_s = (
        data["settings"]["batch_size"] * MODELS["quick"]["n_positions"] / record["step_time_s"]
    )
    assert record["tokens_per_s"] == pytest.approx(expected_tokens_per_s)
    assert record["mfu"] == pytest.approx(record["flops_per_token"] * record["tokens_per_s"] / 1.5e12)
    assert record["peak_tflops"] == 1.5
    assert set(data["skipped"]) == {"amp", "amp_mixed_precision"}
    table = (tmp_path / "gpu.md").read_text()
    assert "| `fp32` |" in table and "| `plain_fp32` |" in table
    assert "| `amp` | skipped: float16 AMP needs CUDA" in table


@pytest.mark.extended  # the GPU mode runs on a GPU; here its Llama, eager and compiled, on a CPU
@pytest.mark.timeout(1500)
def test_gpu_mode_llama_eager_and_compiled_on_a_cpu_worker(tmp_path: Path) -> None:
    # --model llama: the engine and the plain module, each eager and with every LlamaDecoderLayer
    # compiled (the engine through with_wrapped_modules' compile, the plain module through the same
    # compile_unit), trained on the same data from the same seed.
    from transformers import LlamaConfig, LlamaForCausalLM

    configs = ["fp32", "fp32_compiled", "plain_fp32", "plain_fp32_compiled"]
    result = run_benchmarks(
        "--gpu",
        "--device",
        "cpu",
        "--quick",
        "--model",
        "llama",
        "--configs",
        ",".join(configs),
        "--json",
        str(tmp_path / "gpu.json"),
        "--markdown",
        str(tmp_path / "gpu.md"),
        timeout=1400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    settings = data["settings"]
    records = {r["config"]: r for r in data["records"]}
    assert list(records) == configs and data["skipped"] == {} and data["failed"] == {}
    assert settings["model"] == "llama"
    shape = LLAMA_MODELS["quick"]
    parameters = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**shape)).parameters())
    for name, record in records.items():
        # The engine's FSDP units hold the Llama's parameters once each, as the plain module does.
        assert record["model"] == "llama" and record["parameters"] == parameters, name
        assert record["compiled"] is name.endswith("_compiled"), name
        assert len(record["losses"]) == settings["steps"] and all(map(math.isfinite, record["losses"]))
        expected_tokens_per_s = (
            settings["batch_size"] * shape["max_position_embeddings"] / record["step_time_s"]
        )
        assert record["tokens_per_s"] == pytest.approx(expected_tokens_per_s)
        assert record["warmup_s"] == pytest.approx(sum(record["step_times_s"][: settings["warmup"]]))
    for eager_name, compiled_name in (("fp32", "fp32_compiled"), ("plain_fp32", "plain_fp32_compiled")):
        eager, compiled = records[eager_name], records[compiled_name]
        # The same batch every step: the loss falls, so the optimizer steps are compared as well.
        assert eager["losses"][-1] < eager["losses"][0] - 1e-3, eager["losses"]
        # Same seed, same data: the compiled blocks train as the eager ones, step for step.
        assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-4), compiled_name
        # Compiled once, the two blocks sharing the graphs; none recompiled or fell back to eager.
        assert compiled["compile"]["compiled_graphs"] > 0, compiled_name
        assert compiled["compile"]["recompiled_units"] == [] and compiled["compile"]["eager_units"] == []
        assert "compile" not in eager
    # The engine (its units materialised from the meta device) starts from the plain module's weights.
    assert records["fp32"]["losses"][0] == pytest.approx(records["plain_fp32"]["losses"][0], rel=1e-5)
    table = (tmp_path / "gpu.md").read_text()
    assert (
        "A tiny Llama (`--quick`), `transformers`' `LlamaForCausalLM` with SDPA attention "
        f"({parameters / 1e6:,.1f} M parameters, {parameters:,}; 2 layers, width 64," in table
    )
    assert "one FSDP unit per block (`LlamaDecoderLayer`)" in table and "--model llama" in table
    # "x plain": tokens/s over the plain row of the same compile setting; "warm-up": its steps' time.
    for name, base in (
        ("fp32", "plain_fp32"),
        ("fp32_compiled", "plain_fp32_compiled"),
        ("plain_fp32", None),
    ):
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        ratio = f"{records[name]['tokens_per_s'] / records[base]['tokens_per_s']:.3f}" if base else "-"
        assert cells[9:] == [ratio, f"{records[name]['warmup_s']:.1f} s"], row


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


def test_training_flops_formula_matches_counted_flops_of_the_llama() -> None:
    # The same for --model llama: N is the layers' weights and the output head, not the (untied)
    # token embeddings, which are only looked up. SDPA runs its math kernel here, whose matmuls
    # FlopCounterMode counts (the CPU's fused kernel is not in its table; a GPU's flash kernel is,
    # as the same 4 T d forward and 8 T d backward per token and layer).
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    shape = LLAMA_MODELS["quick"]
    hidden, vocab, layers = shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"]
    model = LlamaLanguageModel(**shape)
    assert model.llama.config._attn_implementation == "sdpa"
    assert model.llama.lm_head.weight is not model.llama.model.embed_tokens.weight
    key_value_width = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * key_value_width + 3 * hidden * shape["intermediate_size"]
    assert matmul_parameters(model) == layers * per_layer + vocab * hidden
    batch, length = 3, shape["max_position_embeddings"]
    tokens = torch.randint(vocab, (batch, length))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(input_ids=tokens, labels=tokens)["loss"].backward()
    per_token = training_flops_per_token(matmul_parameters(model), layers, hidden, length)
    assert counter.get_total_flops() == pytest.approx(per_token * batch * length, rel=0.01)
    # Tied, the shared weight counts once, as the head: the same N, vocab x hidden fewer parameters.
    tied = LlamaLanguageModel(**{**shape, "tie_word_embeddings": True})
    assert tied.llama.lm_head.weight is tied.llama.model.embed_tokens.weight
    assert matmul_parameters(tied) == matmul_parameters(model)
    assert (
        sum(p.numel() for p in tied.parameters())
        == sum(p.numel() for p in model.parameters()) - vocab * hidden
    )
    # The full shape is TinyLlama-1.1B's: 1,100,048,384 parameters, of which N leaves out the token
    # embeddings (32,000 x 2,048) and the 45 RMSNorm weights (2 per layer and the final one).
    full = LLAMA_MODELS["full"]
    with torch.device("meta"):
        model = LlamaLanguageModel(**full)
    assert sum(p.numel() for p in model.parameters()) == 1_100_048_384
    assert matmul_parameters(model) == 1_100_048_384 - 32000 * 2048 - 45 * 2048


def test_gpu_compiled_configurations_mirror_the_eager_ones() -> None:
    # Each *_compiled configuration is its eager one plus compile, and each engine configuration's
    # "x plain" is over the plain one of the same precision and compile setting.
    compiled = {name for name, (options, _) in GPU_CONFIGS.items() if options.get("compile")}
    assert compiled == {
        "fp32_compiled",
        "bf16_mixed_precision_compiled",
        "torch_bf16_mixed_precision_compiled",
        "plain_fp32_compiled",
        "plain_bf16_compiled",
    }
    for name in compiled:
        options, fsdp_options = GPU_CONFIGS[name]
        eager_options, eager_fsdp_options = GPU_CONFIGS[name.removesuffix("_compiled")]
        assert options == {**eager_options, "compile": True} and fsdp_options == eager_fsdp_options, name
    assert baseline_of("fp32") == baseline_of("torch_fp32") == "plain_fp32"
    assert baseline_of("amp") == baseline_of("amp_mixed_precision") == "plain_amp"
    assert baseline_of("bf16_mixed_precision") == baseline_of("torch_bf16_mixed_precision") == "plain_bf16"
    assert baseline_of("fp32_compiled") == "plain_fp32_compiled"
    assert baseline_of("bf16_mixed_precision_compiled") == "plain_bf16_compiled"
    assert baseline_of("torch_bf16_mixed_precision_compiled") == "plain_bf16_compiled"
    assert all(baseline_of(name) is None for name in GPU_CONFIGS if name.startswith("plain_"))


def test_peak_tflops_table() -> None:
    # The GPU mode reads the package's table (tango_fairscale.telemetry.peaks, whose figures
    # tests/test_throughput.py checks) in TFLOP/s: half precision by default, each configuration's
    # own dtype otherwise, the row the device's name finds.
    from tango_fairscale.telemetry.peaks import GPU_PEAK_TFLOPS

    table = dict(GPU_PEAK_TFLOPS)
    assert peak_tflops_for("NVIDIA H100 80GB HBM3") == table["H100"]["float16"]
    assert peak_tflops_for("NVIDIA H100 PCIe") == table["H100 PCIe"]["float16"] != table["H100"]["float16"]
    assert peak_tflops_for("NVIDIA H200") == table["H200"]["float16"]
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB") == table["A100"]["float16"]
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB", "float32") == table["A100"]["float32"]
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB", "float32", tf32=True) == table["A100"]["tf32"]
    assert table["A100"]["tf32"] != table["A100"]["float32"]  # so that the line above tells them apart
    assert peak_tflops_for("Some Future Accelerator") is None


def test_pages_in_docs_link_the_results_kept_beside_the_benchmarks() -> None:
    """The records and charts are in benchmarks/results/, each named by a page of docs/ or its README."""
    assert sorted(p.name for p in DOCS.iterdir() if p.suffix in (".json", ".png")) == []
    pages = {page: page.read_text() for page in DOCS.glob("*.md")}
    for page, text in pages.items():
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if not re.match(r"[a-z]+:", target):
                assert (page.parent / target).exists(), f"{page.name} links {target}, which is not there"
    named = "\n".join([*pages.values(), (RESULTS / "README.md").read_text()])
    results = [p.name for p in RESULTS.iterdir() if p.name != "README.md"]
    assert results and not [name for name in results if name.split(".")[0] not in named]
    # A page in docs/ links a chart here; one written beside its chart links it by name.
    assert chart_link(None, None, "benchmarks.png") == "../benchmarks/results/benchmarks.png"
    assert chart_link(None, DOCS / "benchmarks.md", "x.png") == "../benchmarks/results/x.png"
    assert chart_link(RESULTS / "c.png", DOCS / "c.md", "x.png") == "../benchmarks/results/c.png"
    assert chart_link(DOCS / "c.png", DOCS / "c.md", "x.png") == "c.png"


def test_published_backends_table_reports_mfu_with_its_peak() -> None:
    """docs/benchmarks-backends.md (its records: benchmarks/results/): MFU of DDP and both backends at
    2 workers, the peak and its command."""
    data = json.loads((RESULTS / "benchmarks-backends.json").read_text())
    page = (REPO / "docs" / "benchmarks-backends.md").read_text()
    peak = data["peak"]
    assert (
        peak["command"].startswith("python -m tango_fairscale peak --threads ")
        and peak["flops_per_second"] > 0
    )
    assert f"`{peak['command']}`" in page and f"{peak['flops_per_second'] / 1e9:.1f} GFLOP/s" in page
    assert f"`{peak['output']}`" in page
    records = {(r["config"], r["world_size"]): r for r in data["records"]}
    for name in ("ddp", "fsdp", "fsdp2"):
        record = records[(name, 2)]
        mfu = record["model_flops_per_step"] / record["step_time_s"] / peak["flops_per_second"]
        assert record["mfu"] == pytest.approx(mfu, rel=1e-9) and 0 < mfu <= 1
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` | 2 |"))
        assert f"| {100 * mfu:.2f} % |" in row, row
        print(f"{name}, 2 workers: step {record['step_time_s']:.3f} s, MFU {100 * mfu:.2f} %")
