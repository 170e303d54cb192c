"""
A pretrained Hugging Face model as the step's model (``"fairscale::from_pretrained"``): with
either backend and ``init_on_meta`` each unit is read from the saved safetensors files as it is
sharded; the trained weights start from the pretrained ones exactly and fine-tune as Tango's DDP
engine fine-tunes ``from_pretrained``'s model. In the test's own workers (:mod:`tests.harness`).
"""

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from tango.common.exceptions import ConfigurationError

from tango_fairscale.materialize import parameters_on_meta
from tango_fairscale.pretrained import from_pretrained
from tests import harness
from tests.helpers import max_abs_difference, train_config

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402  (transformers brings safetensors)

GPT2 = {"n_layer": 3, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
BACKENDS = ["fairscale", "torch"]
TOLERANCE = 1e-5
STEPS = 4


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small GPT-2 with tied embedding and LM head, trained a little and saved as transformers does."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(11)
    model = GPT2LMHeadModel(GPT2Config(**GPT2))
    # Move the weights away from any initialisation, so that loading them is what is tested.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens = torch.randint(GPT2["vocab_size"], (4, GPT2["n_positions"]))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    directory = tmp_path_factory.mktemp("pretrained") / "gpt2"
    model.save_pretrained(directory)
    return directory


def experiment(directory: Path, backend: str, lr: float, steps: int = STEPS) -> Dict[str, Any]:
    """Fine-tuning the saved model: ``backend`` with one unit per block and init_on_meta, or ``"ddp"``."""
    model: Dict[str, Any] = {
        "type": "fairscale::from_pretrained",
        "pretrained_model_name_or_path": str(directory),
        "config_overrides": NO_DROPOUT,
    }
    if backend == "ddp":
        config = train_config(
            engine="torch", model=model, train_steps=steps, checkpoint_every=steps, callbacks=[]
        )
    else:
        wrapped = {
            "type": "fairscale::with_wrapped_modules",
            "model": model,
            "modules_to_wrap": ["transformer\\.h\\.[0-9]+"],
            "fsdp_config": {},
        }
        config = train_config(
            engine="fairscale",
            model=wrapped,
            train_steps=steps,
            checkpoint_every=steps,
            callbacks=[],
            engine_extra={"backend": backend, "init_on_meta": True},
        )
    train = config["steps"]["train"]
    train["training_engine"]["optimizer"] = {
        "type": "torch::AdamW",
        "lr": lr,
        "weight_decay": 0.0 if lr == 0 else 0.01,
    }
    config["steps"]["data"] = {
        "type": "test::lm_data",
        "vocab_size": GPT2["vocab_size"],
        "length": GPT2["n_positions"],
    }
    return config


@pytest.fixture(scope="module")
def runs(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, torch.Tensor]]:
    """weights.pt of every run, trained in one start of the workers."""
    root = tmp_path_factory.mktemp("pretrained_runs")
    keys: List[str] = [f"{b}-unchanged" for b in BACKENDS] + [f"{b}-finetuned" for b in [*BACKENDS, "ddp"]]
    jobs = []
    for key in keys:
        backend, kind = key.split("-")
        lr, steps = (0.0, 1) if kind == "unchanged" else (0.01, STEPS)
        jobs.append(harness.Train(experiment(pretrained, backend, lr, steps), root / key))
    results = {}
    for key, job, result in zip(keys, jobs, harness.run(jobs, out=root / "harness")):
        result.check()
        results[key] = torch.load(job.work_dir / "weights.pt", weights_only=True)
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_model_starts_from_the_pretrained_weights_exactly(
    backend: str, pretrained: Path, runs: Dict[str, Dict[str, torch.Tensor]]
) -> None:
    # A step at learning rate 0 leaves every parameter as loaded: weights.pt is the saved model.
    saved = load_file(str(pretrained / "model.safetensors"))
    weights = runs[f"{backend}-unchanged"]
    for name, tensor in saved.items():
        assert torch.equal(weights[name], tensor), name
    # The LM head is the embedding (tied, not saved separately by save_pretrained).
    assert "lm_head.weight" not in saved
    assert torch.equal(weights["lm_head.weight"], saved["transformer.wte.weight"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fine_tuning_matches_ddp_from_pretrained(
    backend: str, pretrained: Path, runs: Dict[str, Dict[str, torch.Tensor]]
) -> None:
    fsdp, ddp = runs[f"{backend}-finetuned"], runs["ddp-finetuned"]
    saved = load_file(str(pretrained / "model.safetensors"))
    assert max_abs_difference({name: ddp[name] for name in saved}, saved) > 1e-3  # it trained
    difference = max_abs_difference(fsdp, ddp)
    print(f"[{backend}] max |FSDP - DDP| after {STEPS} fine-tuning steps: {difference:.3e}")
    assert difference <= TOLERANCE
    # Still tied after training: one parameter under two names.
    assert torch.equal(fsdp["lm_head.weight"], fsdp["transformer.wte.weight"])


def test_on_meta_nothing_is_read_until_materialised(pretrained: Path) -> None:
    with parameters_on_meta():
        model = from_pretrained(str(pretrained), config_overrides=NO_DROPOUT)
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight


def test_directory_without_the_models_tensors_is_refused(pretrained: Path, tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    # A base GPT2Model's files under a causal LM class: every name lacks the "transformer." prefix.
    GPT2LMHeadModel(GPT2Config(**GPT2)).transformer.save_pretrained(tmp_path / "base")
    with (
        parameters_on_meta(),
        pytest.raises(ConfigurationError, match=r"has no tensor for transformer\.wte\.weight"),
    ):
        from_pretrained(str(tmp_path / "base"))
    # Only the config: the weights saved some other way.
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text((pretrained / "config.json").read_text())
    with parameters_on_meta(), pytest.raises(ConfigurationError, match="has neither model.safetensors"):
        from_pretrained(str(tmp_path / "config_only"))
    with pytest.raises(ConfigurationError, match="auto_class 'AutoModelForNothing'"):
        from_pretrained(str(pretrained), auto_class="AutoModelForNothing")
