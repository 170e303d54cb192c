"""
Class-name auto-wrapping on real transformer models built from configs (no downloads):
GPT-2 (GPT2Block units) matches DDP; T5 (T5Block units) trains and round-trips.
"""

from pathlib import Path
from typing import Any, Dict

import pytest
import torch

pytest.importorskip("transformers")

from tests.components import HFGPT2, TinyT5  # noqa: E402
from tests.helpers import INCLUDES, load_weights, max_abs_difference, run_tango, train_work_dir  # noqa: E402

GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 96, "n_positions": 16}
INCLUDE = INCLUDES + ["benchmarks.components"]


def lm_config(
    model: Dict[str, Any], engine: str, wrap_classes: Any, checkpointing: bool = False
) -> Dict[str, Any]:
    if wrap_classes:
        model = {
            "type": "fairscale::with_wrapped_modules",
            "model": model,
            "wrap_module_classes": wrap_classes,
            "fsdp_config": {},
            "activation_checkpointing": checkpointing,
        }
    return {
        "steps": {
            "data": {
                "type": "benchmark::random_tokens",
                "vocab_size": 96,
                "sequence_length": 16,
                "count": 128,
            },
            "train": {
                "type": "torch::train",
                "model": model,
                "training_engine": {
                    "type": engine,
                    "optimizer": {"type": "torch::AdamW", "lr": 3e-3},
                    "lr_scheduler": {"type": "torch::StepLR", "step_size": 3, "gamma": 0.7},
                },
                "dataset_dict": {"type": "ref", "ref": "data"},
                "train_dataloader": {
                    "batch_size": 4,
                    "sampler": {"type": "torch::DistributedSampler", "shuffle": True, "drop_last": True},
                },
                "train_steps": 8,
                "checkpoint_every": 8,
                "device_count": 2,
                "seed": 11,
                "callbacks": [{"type": "test::record_losses"}],
            },
        }
    }


@pytest.mark.extended
def test_gpt2_class_auto_wrap_matches_ddp(tmp_path: Path) -> None:
    model = {"type": "test::hf_gpt2", **GPT2}
    run_tango(lm_config(model, "torch", None), tmp_path / "ddp", cwd=tmp_path / "c1", includes=INCLUDE)
    run_tango(
        lm_config(model, "fairscale", ["GPT2Block"], checkpointing=True),
        tmp_path / "fsdp",
        cwd=tmp_path / "c2",
        includes=INCLUDE,
    )
    fsdp, ddp = load_weights(tmp_path / "fsdp"), load_weights(tmp_path / "ddp")
    # Hugging Face's default keeps a key/value cache, which checkpointing must turn off
    # (otherwise a recomputed block appends to it twice): this run exercised that.
    assert HFGPT2(**GPT2).gpt2.config.use_cache
    plain = HFGPT2(**GPT2)
    plain.load_state_dict(fsdp, strict=True)
    # Tied input and output embeddings survive consolidation as one tensor's values.
    assert torch.equal(fsdp["gpt2.lm_head.weight"], fsdp["gpt2.transformer.wte.weight"])
    difference = max_abs_difference(fsdp, ddp)
    print(f"GPT-2, GPT2Block units + checkpointing: max |FSDP - DDP| = {difference:.3e}")
    assert difference <= 1e-5


@pytest.mark.extended
def test_t5_class_auto_wrap_trains(tmp_path: Path) -> None:
    import json

    model = {"type": "test::t5", "vocab_size": 96}
    run_tango(
        lm_config(model, "fairscale", ["T5Block"], checkpointing=True),
        tmp_path / "ws",
        cwd=tmp_path / "c",
        includes=INCLUDE,
    )
    weights = load_weights(tmp_path / "ws")
    plain = TinyT5(vocab_size=96)
    plain.load_state_dict(weights, strict=True)
    losses = json.loads((train_work_dir(tmp_path / "ws") / "losses.json").read_text())
    steps = sorted(losses, key=int)
    assert losses[steps[-1]] < losses[steps[0]]
