"""
The GPU recipe's config (examples/gpu_recipe, docs/gpu-recipe.md) is a config this package takes:
its wrap plan drawn by ``plan`` for a model of the recipe's classes saved locally, on a world of
16 workers, with and without LoRA; and the config itself, unchanged but for its sizes, trained end
to end by ``tango run`` on one GPU (``-m gpu``) or two CPU workers (``-m extended``), fully and
with LoRA, its export loaded back.
"""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, TANGO, free_port, pretrained_name, tango_env, word_tokenizer

pytest.importorskip("peft")

CONFIG = REPO / "examples" / "gpu_recipe" / "config.jsonnet"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, num_hidden_layers=3, **shape))
    directory = tmp_path_factory.mktemp("recipe") / "llama"
    model.save_pretrained(directory)
    # The recipe's data step reads the tokenizer from the pretrained directory, as from a hub copy.
    word_tokenizer(64).save_pretrained(directory)
    return directory


# Without LoRA in the extended suite: the LoRA plan has the same units under peft's prefix.
@pytest.mark.parametrize("lora", [pytest.param("false", marks=pytest.mark.extended), "true"])
def test_the_recipe_plans_one_unit_per_decoder_layer(pretrained: Path, tmp_path: Path, lora: str) -> None:
    variables = {"pretrained": str(pretrained), "text": str(tmp_path), "gpus_per_node": "8", "lora": lora}
    command = [sys.executable, "-m", "tango_fairscale", "plan", str(CONFIG), "--world-size", "16"]
    for key, value in variables.items():
        command += ["-D", f"{key}={value}"]
    command += ["--json", str(tmp_path / "plan.json")]
    result = subprocess.run(
        command, cwd=tmp_path, env=tango_env(), capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    units = [unit["name"] for unit in plan["units"]]
    prefix = "base_model.model." if lora == "true" else ""
    assert units == ["", *(f"{prefix}model.layers.{index}" for index in range(3))], units
    assert all(unit["checkpointed"] for unit in plan["units"][1:])
    assert plan["world_size"] == 16


#: The recipe's sizes, cut to a tiny run: 16-token blocks, 4 steps of 4 x 4 blocks per worker,
#: validation and a checkpoint every 2 steps.
SHORT_RUN = {
    "steps.data.block_size": 16,
    "steps.data.validation_fraction": 0.2,
    "steps.train.train_steps": 4,
    "steps.train.validate_every": 2,
    "steps.train.checkpoint_every": 2,
    "steps.train.log_every": 1,
    "steps.train.training_engine.lr_scheduler.T_max": 4,
}


def words(count: int) -> str:
    """``count`` words of the tokenizer's vocabulary, ten to a line."""
    rng = random.Random(0)
    chosen = [f"w{rng.randrange(1, 64)}" for _ in range(count)]
    return "".join(" ".join(chosen[i : i + 10]) + "\n" for i in range(0, count, 10))


@pytest.mark.parametrize(
    "workers",
    [
        # One GPU: the recipe as a single-GPU machine runs it (gpus_per_node=1).
        pytest.param(
            1,
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
            id="one_gpu",
        ),
        # Two CPU workers, where the recipe's bfloat16 runs under CPU autocast.
        pytest.param(2, marks=pytest.mark.extended, id="two_cpu_workers"),
    ],
)
@pytest.mark.parametrize("lora", ["false", "true"])
def test_the_recipe_trains_and_exports(pretrained: Path, tmp_path: Path, workers: int, lora: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    (tmp_path / "corpus.txt").write_text(words(3000 * workers))
    command = [TANGO, "--log-level", "info", "run", str(CONFIG), "-i", "tango_fairscale"]
    command += ["-w", str(tmp_path / "workspace")]
    variables = {
        "pretrained": pretrained,
        "text": tmp_path / "corpus.txt",
        "gpus_per_node": workers,
        "lora": lora,
    }
    for key, value in variables.items():
        command += ["--ext-var", f"{key}={value}"]
    command += ["--overrides", json.dumps({**SHORT_RUN, "steps.train.distributed_port": free_port()})]
    result = subprocess.run(
        command, cwd=tmp_path, env=tango_env(), capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]

    work_dir = tmp_path / "workspace" / "latest" / "train" / "work"
    metrics = [json.loads(line) for line in (work_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [line["loss"] for line in metrics if "loss" in line]
    validation = [line["val_loss"] for line in metrics if "val_loss" in line]
    assert len(losses) == 4 and len(validation) == 2, metrics
    assert all(math.isfinite(value) for value in losses + validation), metrics

    weights = torch.load(work_dir / "weights.pt", weights_only=True)
    start = load_file(str(pretrained / "model.safetensors"))
    exported = work_dir / "hf"
    if lora == "false":
        # Every weight trained; the export is weights.pt under transformers' names, in float32.
        model = AutoModelForCausalLM.from_pretrained(exported)
        state = model.state_dict()
        assert all(torch.equal(state[name], weights[name]) for name in weights)
        assert all(not torch.equal(weights[name], start[name]) for name in start)
    else:
        from peft import PeftModel

        # The frozen base is the pretrained file's, bit for bit; the adapters trained (lora_B
        # starts at zero), and the exported adapter directory loads onto the pretrained model.
        base = {pretrained_name(key): value for key, value in weights.items()}
        assert all(torch.equal(base[name], start[name]) for name in start)
        adapters = {name: value for name, value in weights.items() if "lora_B" in name}
        assert len(adapters) == 3 * 4 and all(value.abs().sum() > 0 for value in adapters.values())
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), exported)
        state = model.state_dict()
        for name, value in adapters.items():
            assert torch.equal(state[name], value), name
