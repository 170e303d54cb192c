"""
The fine-tuning example (examples/finetune_pretrained) end to end, as its README runs it: a
"pretrained" GPT-2 saved by ``make_pretrained.py``, fine-tuned through the ``tango`` command line
with ``fairscale::from_pretrained``, ``init_on_meta`` and ``export_hf``, then loaded from the
exported directory with plain ``transformers`` and ``generate.py``. In its ``tiny`` size in
``make test``; the ``default`` size, what ``make demo-finetune`` runs, is ``extended``.
"""

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Tuple

import pytest
import torch

from tests.helpers import REPO, TANGO, free_port

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402  (transformers brings safetensors)

EXAMPLE_DIR = REPO / "examples" / "finetune_pretrained"
PROMPT = "The Queen"


def script(name: str) -> ModuleType:
    """One of the example's scripts, imported from its file (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"finetune_example_{name}", EXAMPLE_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(
    root: Path, size: str, pretrain_args: List[str], extra: Tuple[str, ...] = ()
) -> Tuple[Path, Path, str]:
    """
    ``make_pretrained.py`` (in this process: its imports are the test's), then the example's
    ``tango run`` from its own directory, as the README and the Makefile run them. Returns the
    pretrained directory, the training step's work directory and the run's output.
    """
    pretrained, workspace = root / "pretrained", root / "workspace"
    script("make_pretrained").main([str(pretrained), *pretrain_args])
    overrides = json.dumps({"steps.train.distributed_port": free_port()})
    command = [TANGO, "--log-level", "info", "run", "config.jsonnet", "-w", str(workspace)]
    command += ["--ext-var", f"size={size}", "--ext-var", f"pretrained={pretrained}"]
    command += ["--overrides", overrides, *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=EXAMPLE_DIR, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return pretrained, workspace / "latest" / "train" / "work", output


def validation_loss(model_dir: Path, blocks: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return float(model(input_ids=blocks, labels=blocks).loss)


def check_run(pretrained: Path, work_dir: Path, capsys: Any) -> Dict[str, float]:
    """What the README promises of a run of the example; returns the losses it measured."""
    from tango.workspaces import LocalWorkspace
    from transformers import AutoTokenizer

    exported = work_dir / "hf"
    # The export is weights.pt (the best checkpoint's weights) under transformers' names, the
    # LM head tied to the embedding, with the pretrained directory's tokenizer.
    weights = torch.load(work_dir / "weights.pt", weights_only=True)
    saved = load_file(str(exported / "model.safetensors"))
    assert saved.keys() == weights.keys() - {"lm_head.weight"}
    assert all(torch.equal(saved[name], weights[name]) for name in saved)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (exported / name).read_bytes() == (pretrained / name).read_bytes(), name

    # Fine-tuning helped on the held-out end of the book, which the pretrained model never saw.
    workspace = work_dir.parent.parent.parent
    validation = LocalWorkspace(workspace).step_result("data")["validation"]
    blocks = torch.stack([item["input_ids"] for item in validation])
    before, after = validation_loss(pretrained, blocks), validation_loss(exported, blocks)
    lines = [json.loads(line) for line in (work_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [round(line["val_loss"], 3) for line in lines if "val_loss" in line]
    assert after < before - 0.05, (before, after)

    # The README's consolidate of the best checkpoint writes the same directory again.
    from tango_fairscale import cli

    again = workspace.parent / "hf-again"  # outside the workspace, whose directories are Tango's
    best = str(work_dir / "checkpoint_state_best")
    assert cli.main(["consolidate", best, str(again), "--format", "hf", "--hf-config", str(pretrained)]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (exported / name).read_bytes(), name

    # The tokenizer loads with AutoTokenizer and round-trips the book's text.
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.decode(tokenizer("Alice was beginning")["input_ids"]) == "Alice was beginning"
    # generate.py: text from the exported directory, the prompt first.
    capsys.readouterr()
    script("generate").main([str(exported), "--prompt", PROMPT, "--max-new-tokens", "20"])
    text = capsys.readouterr().out.strip()
    print(f"validation loss: pretrained {before:.3f}, exported {after:.3f}; in the run {curve}")
    print(f"generate.py: {text!r}")
    assert text.startswith(PROMPT) and len(text) > len(PROMPT) + 10
    return {"pretrained": before, "exported": after}


def test_tiny_example_fine_tunes_exports_and_generates(tmp_path: Path, capsys: Any) -> None:
    # A few pretraining steps of a smaller model: seconds, not the README's minutes.
    pretrained, work_dir, output = run_example(tmp_path, "tiny", ["--steps", "5", "--n-layer", "2"])
    assert "Writing " in output and "for transformers' from_pretrained" in output
    check_run(pretrained, work_dir, capsys)


@pytest.mark.extended
def test_default_example_as_make_demo_finetune_runs_it(tmp_path: Path, capsys: Any) -> None:
    pretrained, work_dir, _ = run_example(tmp_path, "default", [])
    losses = check_run(pretrained, work_dir, capsys)
    # What the README reports of this run: a clear fall from the pretrained model's loss (0.21
    # nats per token measured).
    assert losses["exported"] < losses["pretrained"] - 0.1


@pytest.mark.extended
def test_the_lora_variant_trains_exports_the_adapter_and_generates(tmp_path: Path, capsys: Any) -> None:
    # make demo-finetune-lora, tiny: the pretrained weights frozen, the adapter exported and loaded
    # onto the base model with peft by generate.py.
    pytest.importorskip("peft")
    pretrained, work_dir, _ = run_example(tmp_path, "tiny", ["--steps", "30"], ("--ext-var", "lora=true"))
    adapter = work_dir / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    weights = torch.load(work_dir / "weights.pt", weights_only=True)
    base = load_file(str(pretrained / "model.safetensors"))
    frozen = [key for key in weights if "lora_" not in key and key.removeprefix("base_model.model.") in base]
    assert frozen and all(torch.equal(weights[k], base[k.removeprefix("base_model.model.")]) for k in frozen)
    generate = script("generate")
    capsys.readouterr()  # what make_pretrained printed
    model = generate.load(adapter)
    assert type(model).__name__ == "PeftModel"
    generate.main([str(adapter), "--prompt", PROMPT, "--max-new-tokens", "8"])
    assert capsys.readouterr().out.startswith(PROMPT)
