"""Building on the meta device and materialising one unit at a time (the engine's init_on_meta)."""

import pytest
import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError

from examples.toy.components import ToyRegressor
from tango_fairscale.materialize import (
    has_meta_parameters,
    materialize_module,
    parameters_on_meta,
    real_parameters,
)


def test_parameters_go_to_meta_buffers_stay_real() -> None:
    with parameters_on_meta():
        model = nn.BatchNorm1d(4)
        with real_parameters():
            real = nn.Linear(2, 2)
    assert model.weight.is_meta and model.bias.is_meta
    assert not model.running_mean.is_meta
    assert not real.weight.is_meta
    # The patch is gone afterwards.
    assert not nn.Linear(2, 2).weight.is_meta


def test_materialize_is_deterministic_and_initialised() -> None:
    values = []
    for _ in range(2):
        torch.manual_seed(0)
        with parameters_on_meta():
            model = ToyRegressor(in_features=4, width=8, num_blocks=2)
        assert has_meta_parameters(model)
        count = materialize_module(model, torch.device("cpu"))
        assert count == sum(p.numel() for p in model.parameters())
        assert not has_meta_parameters(model)
        values.append({k: v.clone() for k, v in model.state_dict().items()})
    for key in values[0]:
        assert torch.equal(values[0][key], values[1][key]), key
        assert torch.isfinite(values[0][key]).all()
    # Linear's reset_parameters: bias bounded by 1/sqrt(fan_in), weights not all equal.
    assert values[0]["blocks.0.linear.bias"].abs().max() <= 1 / 8**0.5
    assert values[0]["blocks.0.linear.weight"].std() > 0


def test_tied_parameters_stay_tied() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=32)
    with parameters_on_meta():
        model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    materialize_module(model, torch.device("cpu"))
    assert model.lm_head.weight is model.transformer.wte.weight
    # GPT-2's own init: N(0, 0.02) embeddings, LayerNorm ones.
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.005
    assert torch.equal(model.transformer.ln_f.weight, torch.ones(16))
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


def test_uninitialisable_parameter_is_named() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with parameters_on_meta():
        model = Scale()
    with pytest.raises(ConfigurationError, match=r"no initialiser set \['Scale.gain'\]"):
        materialize_module(model, torch.device("cpu"))


@pytest.mark.slow
def test_init_on_meta_trains_through_the_cli(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from tests.helpers import load_weights, run_tango, train_config, train_work_dir

    config = train_config(
        engine="fairscale",
        wrap="nested_ckpt",
        train_steps=12,
        checkpoint_every=6,
        engine_extra={"init_on_meta": True},
        callbacks=[{"type": "test::record_losses"}],
    )
    run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd")
    ToyRegressor(in_features=8, width=32, num_blocks=4).load_state_dict(
        load_weights(tmp_path / "ws"), strict=True
    )
    losses = json.loads((train_work_dir(tmp_path / "ws") / "losses.json").read_text())
    steps = sorted(losses, key=int)
    assert sum(losses[s] for s in steps[-3:]) < sum(losses[s] for s in steps[:3])
