"""
The GPU recipe's config (examples/gpu_recipe, docs/gpu-recipe.md) is a config this package takes:
its wrap plan drawn by ``plan`` for a model of the recipe's classes saved locally, on a world of
16 workers, with and without LoRA.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, tango_env

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
    return directory


@pytest.mark.parametrize("lora", ["false", "true"])
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
