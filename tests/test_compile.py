"""
Compiled units (``with_wrapped_modules.compile``): in float32 a compiled run ends within 1e-5 of
the eager run on both backends, with activation checkpointing and with LoRA; blocks of one class
compile once; a unit that cannot be compiled stops the run in one line naming it, or runs eagerly
where the config asks for that.
"""

import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from torch import nn

from tango_fairscale.compiling import CompileConfig, compile_config, compile_unit, innermost, stats
from tests import harness
from tests.conftest import TinyPretrained
from tests.helpers import TINY_LLAMA, max_abs_difference, toy_model, train_config
from tests.test_lora import pretrained  # noqa: F401 - a fixture

TOLERANCE = 1e-5


def _compile_stats(worker: harness.Worker) -> Dict[str, Any]:
    return stats().as_dict()


BACKENDS = ["fairscale", "torch"]


def _experiment(backend: str, wrap: str, compile: Any) -> Dict[str, Any]:
    config = train_config(
        wrap=wrap,
        train_steps=4,
        checkpoint_every=4,
        engine_extra={"backend": backend},
        callbacks=[],
        model=toy_model(num_blocks=3, width=16),
    )
    if compile is not None:
        config["steps"]["train"]["model"]["compile"] = compile
    return config


@pytest.mark.parametrize("backend", BACKENDS)
# Plain nested units compile in make test too, with gradient accumulation and a resume (below).
@pytest.mark.parametrize("wrap", [pytest.param("nested", marks=pytest.mark.extended), "nested_ckpt"])
def test_a_compiled_run_ends_as_the_eager_one(backend: str, wrap: str, tmp_path: Path) -> None:
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    results = harness.run(
        [
            harness.Train(_experiment(backend, wrap, None), eager),
            harness.Call(_compile_stats),
            harness.Train(_experiment(backend, wrap, True), compiled),
            harness.Call(_compile_stats),
        ],
        out=tmp_path / "harness",
    )
    for result in results:
        result.check()
    eager_stats, compiled_stats = (results[i].workers[0].value for i in (1, 3))
    assert eager_stats["compiled_graphs"] == 0, eager_stats
    # The three blocks share one graph (a checkpointed one a second, for its recomputation with
    # gradients); none runs eagerly.
    assert 1 <= compiled_stats["compiled_graphs"] <= (2 if wrap == "nested_ckpt" else 1), compiled_stats
    assert compiled_stats["compile_s"] > 0 and compiled_stats["eager_units"] == [], compiled_stats
    # The metrics log says so on the line of the step that compiled: the second (the first runs
    # eagerly under the FLOP count), and only there.
    compiled_lines = [
        line
        for line in map(json.loads, (compiled / "metrics.jsonl").read_text().splitlines())
        if "compile_s" in line
    ]
    assert [line["step"] for line in compiled_lines][:1] == [2], compiled_lines
    assert compiled_lines[-1]["compiled_graphs"] == compiled_stats["compiled_graphs"], compiled_lines
    assert "compile_s" not in (eager / "metrics.jsonl").read_text()
    a = torch.load(eager / "weights.pt", weights_only=True)
    b = torch.load(compiled / "weights.pt", weights_only=True)
    assert a.keys() == b.keys()
    difference = max_abs_difference(a, b)
    assert difference <= TOLERANCE, difference


def test_the_options_are_checked_and_a_unit_that_cannot_compile_is_one_line_or_eager() -> None:
    from tango.common.exceptions import ConfigurationError

    assert compile_config(False) is None and compile_config(True) == CompileConfig()
    with pytest.raises(ConfigurationError, match="compile.fulgraph: not an option: did you mean 'fullgraph'"):
        compile_config({"fulgraph": True})
    with pytest.raises(ConfigurationError, match="compile.mode: 'fastest' is not one of"):
        compile_config({"mode": "fastest"})
    assert innermost(["a.b", "a", "c"]) == ["a.b", "c"]

    class Breaks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._dynamo.graph_break()
            return self.linear(x)

    x = torch.randn(2, 4)
    strict = Breaks()
    expected = strict(x)
    compile_unit(strict, CompileConfig(fullgraph=True, backend="eager"), "blocks.0")
    with pytest.raises(ConfigurationError) as raised:
        strict(x)
    assert str(raised.value).startswith(
        "with_wrapped_modules.compile: unit blocks.0 (Breaks) cannot be compiled: "
    ) and "\n" not in str(raised.value), str(raised.value)
    lenient = Breaks()
    lenient.load_state_dict(strict.state_dict())
    compile_unit(lenient, CompileConfig(fullgraph=True, backend="eager", fallback_to_eager=True), "blocks.1")
    assert torch.equal(lenient(x), expected) and torch.equal(lenient(x), expected)
    assert stats().fallbacks[-1:] == ["blocks.1"]


@pytest.mark.extended
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_lora_run_with_checkpointing_ends_as_the_eager_one(
    backend: str,
    pretrained: Path,  # noqa: F811 - tests.test_lora's fixture
    tmp_path: Path,
) -> None:
    """LoRA (frozen and trainable parameters in one unit), init_on_meta, activation checkpointing."""
    from tests.test_lora import experiment as lora_experiment

    eager = lora_experiment(pretrained, backend, True, 0.01, 3, checkpointing=True)
    compiled = lora_experiment(pretrained, backend, True, 0.01, 3, checkpointing=True)
    compiled["steps"]["train"]["model"]["compile"] = True
    results = harness.run(
        [
            harness.Train(eager, tmp_path / "eager"),
            harness.Train(compiled, tmp_path / "compiled"),
            harness.Call(_compile_stats),
        ],
        out=tmp_path / "harness",
        timeout=900,
    )
    for result in results:
        result.check()
    assert results[2].workers[0].value["compiled_graphs"] >= 1, results[2].workers[0].value
    a = torch.load(tmp_path / "eager" / "weights.pt", weights_only=True)
    b = torch.load(tmp_path / "compiled" / "weights.pt", weights_only=True)
    difference = max_abs_difference(a, b)
    assert difference <= TOLERANCE, difference


# Extended: make test compares compiled and eager checkpointed nested units on both backends, and
# kills and reruns eager runs through the command line (tests/test_checkpoints.py).
@pytest.mark.extended
def test_compiled_with_gradient_accumulation_killed_and_resumed_ends_as_the_eager_run(tmp_path: Path) -> None:
    """
    Gradient accumulation (2 micro-batches, the first under ``no_sync``) and a kill after the
    step-2 checkpoint: the compiled run resumed ends within 1e-5 of the uninterrupted eager run on
    both backends, and the resumed process compiles again (its metrics log says how long).
    """

    def experiment(backend: str, compile: bool) -> Dict[str, Any]:
        config = _experiment(backend, "nested", True if compile else None)
        train = config["steps"]["train"]
        train.update(checkpoint_every=2, grad_accum=2)
        if compile:
            train["callbacks"] = [{"type": "test::kill_once", "step": 3}]
        return config

    plain = {b: harness.Train(experiment(b, False), tmp_path / f"{b}-eager") for b in BACKENDS}
    killed = {b: harness.Train(experiment(b, True), tmp_path / f"{b}-compiled") for b in BACKENDS}
    reruns = harness.killed_and_rerun(plain, killed, tmp_path)
    for backend in BACKENDS:
        resumed = killed[backend].work_dir
        assert (
            "Recovering from previous run at " + str(resumed / "checkpoint_state_step2")
            in reruns[backend].logs
        )
        lines = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
        compiles = [(line["step"], line["compile_s"]) for line in lines if "compile_s" in line]
        print(f"[{backend}] compile time on the metrics log's lines (step, s): {compiles}")
        # The first process compiled on step 2, the resumed one again on its first step after the
        # FLOP count's (step 4: step 3 is its first, run eagerly under the count).
        assert [step for step, _ in compiles][:1] == [2] and compiles[-1][0] == 4, compiles
        eager = torch.load(plain[backend].work_dir / "weights.pt", weights_only=True)
        compiled = torch.load(resumed / "weights.pt", weights_only=True)
        difference = max_abs_difference(eager, compiled)
        assert difference <= TOLERANCE, (backend, difference)


@pytest.mark.extended
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_in_bfloat16_mixed_precision_strays_from_eager_less_than_bfloat16_from_float32(
    backend: str, tmp_path: Path
) -> None:
    """
    AMP in bfloat16 with FSDP's bfloat16 mixed precision (the GPU recipe's precision) on CPU
    workers: compiled and eager differ by rounding (inductor fuses what eager rounds after each
    operator), so the bound is the precision's own: the compiled run ends no farther from the eager
    one than the eager bfloat16 run ends from float32.
    """

    def experiment(mixed: bool, compile: bool) -> Dict[str, Any]:
        config = _experiment(backend, "nested", True if compile else None)
        train = config["steps"]["train"]
        if mixed:
            train["training_engine"].update(amp=True, amp_use_bfloat16=True)
            train["training_engine"]["fsdp_config"] = {"mixed_precision": True}
            train["model"]["fsdp_config"] = {"mixed_precision": True}
        return config

    runs = {"float32": (False, False), "eager": (True, False), "compiled": (True, True)}
    results = harness.run(
        [harness.Train(experiment(*options), tmp_path / name) for name, options in runs.items()],
        out=tmp_path / "harness",
    )
    for result in results:
        result.check()
    weights = {name: torch.load(tmp_path / name / "weights.pt", weights_only=True) for name in runs}
    compiled_from_eager = max_abs_difference(weights["compiled"], weights["eager"])
    eager_from_float32 = max_abs_difference(weights["eager"], weights["float32"])
    print(f"[{backend}] compiled - eager {compiled_from_eager:.3g}, eager - float32 {eager_from_float32:.3g}")
    assert 0 < eager_from_float32 and compiled_from_eager <= eager_from_float32


#: A Hugging Face Llama of 12 decoder layers, small enough to compile in seconds on a CPU.
DEEP_LLAMA = {
    **TINY_LLAMA,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 12,
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_layer_of_a_deep_hugging_face_model_runs_compiled_sharing_one_graph(
    backend: str, tiny_pretrained: TinyPretrained, tmp_path: Path
) -> None:
    """
    With transformers' defaults (``use_cache`` on): each layer read its own slot of the key/value
    cache, compiled a graph of its own, and past dynamo's recompile limit (8) the later layers ran
    eagerly. Compiled, the 12 layers share their graphs and the run ends within 1e-5 of eager.
    """
    directory = tiny_pretrained(DEEP_LLAMA, seed=17)
    assert json.loads((directory / "config.json").read_text())["use_cache"] is True

    def experiment(compile: Any) -> Dict[str, Any]:
        model = {"type": "fairscale::from_pretrained", "pretrained_model_name_or_path": str(directory)}
        config = train_config(
            model={
                "type": "fairscale::with_wrapped_modules",
                "model": model,
                "wrap_module_classes": ["LlamaDecoderLayer"],
                "fsdp_config": {},
                **({"compile": compile} if compile is not None else {}),
            },
            train_steps=3,
            checkpoint_every=3,
            callbacks=[],
            engine_extra={"backend": backend},
        )
        config["steps"]["data"] = {
            "type": "test::lm_data",
            "vocab_size": DEEP_LLAMA["vocab_size"],
            "length": 16,
        }
        return config

    results = harness.run(
        [
            harness.Train(experiment(None), tmp_path / "eager"),
            harness.Train(experiment(True), tmp_path / "compiled"),
            harness.Call(_compile_stats),
        ],
        out=tmp_path / "harness",
        timeout=600,
    )
    for result in results:
        result.check()
    compiled = results[2].workers[0].value
    assert "recompile_limit" not in results[1].logs and "cache_size_limit" not in results[1].logs
    assert compiled["eager_units"] == [], compiled
    # Forward and backward of one layer's graph, whichever of the 12 layers runs it.
    assert 1 <= compiled["compiled_graphs"] <= 2, compiled
    assert "use_cache = False" in results[1].logs
    a = torch.load(tmp_path / "eager" / "weights.pt", weights_only=True)
    b = torch.load(tmp_path / "compiled" / "weights.pt", weights_only=True)
    difference = max_abs_difference(a, b)
    print(f"[{backend}] 12-layer Llama, compiled vs eager: {difference:.3e}")
    assert difference <= TOLERANCE, difference
