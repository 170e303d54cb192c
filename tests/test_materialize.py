"""Building on the meta device and materialising one unit at a time (the engine's init_on_meta)."""

from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError

from examples.toy.components import ToyRegressor
from tango_fairscale.materialize import (
    check_initialisable,
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


def storages_by_dtype(model: nn.Module) -> Dict[torch.dtype, int]:
    """How many storages the parameters of each dtype lie in."""
    storages: Dict[torch.dtype, set] = {p.dtype: set() for p in model.parameters()}
    for param in model.parameters():
        storages[param.dtype].add(param.untyped_storage().data_ptr())
    return {dtype: len(pointers) for dtype, pointers in storages.items()}


def test_a_units_parameters_are_one_allocation() -> None:
    # One buffer per dtype for the unit, so that sharding frees it as one mapping instead of
    # leaving a heap fragmented by parameters under the mmap threshold.
    models = []
    for one_allocation in (True, False):
        torch.manual_seed(0)
        with parameters_on_meta():
            model = ToyRegressor(in_features=4, width=8, num_blocks=2)
            model.register_parameter("steps", nn.Parameter(torch.zeros(3, dtype=torch.float64)))
        materialize_module(model, torch.device("cpu"), one_allocation=one_allocation)
        models.append(model)
    model, separate = models
    assert storages_by_dtype(model) == {torch.float32: 1, torch.float64: 1}
    # Without it (FairScale's unflattened sharding frees each parameter's storage): one each.
    assert storages_by_dtype(separate) == {torch.float32: len(list(model.parameters())) - 1, torch.float64: 1}
    # The same values either way.
    for (name, param), other in zip(model.named_parameters(), separate.parameters()):
        assert torch.equal(param, other), name
    float32 = [p for p in model.parameters() if p.dtype == torch.float32]
    assert float32[0].untyped_storage().nbytes() == 4 * sum(p.numel() for p in float32)
    # Separate parameters all the same: changing one changes no other.
    before = {name: p.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        model.blocks[0].linear.weight.add_(1.0)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]) == (name != "blocks.0.linear.weight"), name


def test_a_pretrained_value_of_another_shape_is_refused() -> None:
    from tango_fairscale.materialize import mark_pretrained

    with parameters_on_meta():
        model = nn.Linear(4, 3)
    mark_pretrained(model.weight, lambda: torch.ones(3, 4))
    mark_pretrained(model.bias, lambda: torch.ones(1, 3))  # broadcastable, but not the parameter's shape
    with pytest.raises(
        ConfigurationError, match=r"Linear\.bias: the value to load has shape \[1, 3\], the parameter \[3\]"
    ):
        materialize_module(model, torch.device("cpu"))


def test_bare_parameter_keeps_its_constructed_value() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.arange(3.0))

    with parameters_on_meta():
        model = Scale()
    assert model.gain.is_meta
    materialize_module(model, torch.device("cpu"))
    assert torch.equal(model.gain, torch.arange(3.0))


def test_without_recording_nothing_is_drawn_and_initialisers_run() -> None:
    # parameters_on_meta(record=False), for a build whose values are loaded afterwards: the build
    # draws no random number (a recorded one draws what an eager build draws), and materialising
    # runs the initialisers; a bare parameter keeps its constructed value.
    from tests.components import AttentionRegressor

    for record in (False, True):
        torch.manual_seed(0)
        with parameters_on_meta(record=record):
            model = AttentionRegressor(in_features=8, width=16)
        assert torch.equal(torch.random.get_rng_state(), torch.manual_seed(0).get_state()) is not record
        materialize_module(model, torch.device("cpu"))
        assert torch.equal(model.gain, torch.full((16,), 0.5))
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert model.attention.in_proj_weight.std() > 0


def test_multihead_attention_uses_its_private_initialiser() -> None:
    torch.manual_seed(0)
    with parameters_on_meta():
        attention = nn.MultiheadAttention(8, 2)
    materialize_module(attention, torch.device("cpu"))
    assert all(torch.isfinite(p).all() for p in attention.parameters())
    assert attention.in_proj_weight.std() > 0  # xavier-initialised, not left constant


class Partial(nn.Module):
    """An initialiser that forgets a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.set_here = nn.Parameter(torch.empty(2))
        self.forgotten = nn.Parameter(torch.empty(2))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.set_here)


def test_uninitialised_parameter_is_named() -> None:
    with parameters_on_meta():
        model = Partial()
    with pytest.raises(ConfigurationError, match=r"no initialiser sets \['Partial.forgotten'\]"):
        materialize_module(model, torch.device("cpu"))


def test_every_unset_parameter_is_listed_at_once() -> None:
    with parameters_on_meta():
        model = nn.Sequential(Partial(), nn.Linear(2, 2), Partial(), nn.Linear(2, 2))
    with pytest.raises(ConfigurationError, match=r"\['0.forgotten', '2.forgotten'\]"):
        check_initialisable(model)
    # Nothing beyond one module per class was allocated.
    assert model[2].set_here.is_meta and model[3].weight.is_meta


@pytest.fixture(scope="module")
def init_on_meta_runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """
    Work directories of two init_on_meta runs, trained in the test's own workers (tests.harness,
    Tango's worker loop): the toy model with nested units and activation checkpointing, and stock
    attention with a bare parameter on the root.
    """
    from tests import harness
    from tests.helpers import train_config

    root = tmp_path_factory.mktemp("init_on_meta")
    experiments = {
        "nested": train_config(
            engine="fairscale",
            wrap="nested_ckpt",
            train_steps=12,
            checkpoint_every=6,
            engine_extra={"init_on_meta": True},
            callbacks=[{"type": "test::record_losses"}],
        ),
        "attention": train_config(
            engine="fairscale",
            wrap="root",
            train_steps=12,
            checkpoint_every=12,
            engine_extra={"init_on_meta": True},
            model={"type": "test::attention_regressor", "in_features": 8, "width": 16},
            callbacks=[{"type": "test::record_losses"}],
        ),
        # Each unit one allocation under flattening; without it, FairScale frees each parameter's
        # storage as it shards it, so every parameter is allocated on its own.
        **{
            name: train_config(
                engine="fairscale",
                wrap="nested",
                train_steps=6,
                checkpoint_every=6,
                fsdp_config={"flatten_parameters": flatten},
                engine_extra={"init_on_meta": True},
                callbacks=[],
            )
            for name, flatten in (("flattened", True), ("unflattened", False))
        },
    }
    jobs = [harness.Train(experiment, root / name) for name, experiment in experiments.items()]
    for result in harness.run(jobs, out=root / "harness"):
        result.check()
    return {name: root / name for name in experiments}


def losses_fell(work_dir: Path) -> bool:
    import json

    losses = json.loads((work_dir / "losses.json").read_text())
    steps = sorted(losses, key=int)
    return sum(losses[s] for s in steps[-3:]) < sum(losses[s] for s in steps[:3])


def test_init_on_meta_trains(init_on_meta_runs: Dict[str, Path]) -> None:
    work_dir = init_on_meta_runs["nested"]
    ToyRegressor(in_features=8, width=32, num_blocks=4).load_state_dict(
        torch.load(work_dir / "weights.pt", weights_only=True), strict=True
    )
    assert losses_fell(work_dir)


def test_init_on_meta_trains_stock_attention_and_a_bare_parameter(init_on_meta_runs: Dict[str, Path]) -> None:
    from tests.components import AttentionRegressor

    work_dir = init_on_meta_runs["attention"]
    weights = torch.load(work_dir / "weights.pt", weights_only=True)
    AttentionRegressor(in_features=8, width=16).load_state_dict(weights, strict=True)
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    assert losses_fell(work_dir)


def test_init_on_meta_trains_the_same_with_and_without_flattening(init_on_meta_runs: Dict[str, Path]) -> None:
    from tests.helpers import max_abs_difference

    flattened, unflattened = (
        torch.load(init_on_meta_runs[name] / "weights.pt", weights_only=True)
        for name in ("flattened", "unflattened")
    )
    difference = max_abs_difference(flattened, unflattened)
    print(f"init_on_meta, max |flatten_parameters true - false| after 6 steps: {difference:.3e}")
    assert difference <= 1e-5
    assert all(torch.isfinite(tensor).all() for tensor in unflattened.values())


def forgetful_step() -> Dict[str, Any]:
    import tests.components  # noqa: F401 - registers the model
    from tests.helpers import train_config

    config = train_config(
        engine="fairscale",
        wrap="root",
        engine_extra={"init_on_meta": True},
        model={"type": "test::forgetful_init", "width": 8},
    )
    return config["steps"]["train"]


def test_plan_lists_every_unset_parameter_at_once() -> None:
    from tango_fairscale.plan import make_plan

    with pytest.raises(ConfigurationError, match=r"no initialiser sets \['first.shift', 'second.shift'\]"):
        make_plan("train", forgetful_step())


def test_preflight_lists_every_unset_parameter_at_once() -> None:
    from tango.common import Lazy, Params
    from tango.integrations.torch import Model

    from tango_fairscale.preflight import check_model

    step = forgetful_step()
    with pytest.raises(ConfigurationError, match=r"no initialiser sets \['first.shift', 'second.shift'\]"):
        check_model(Lazy(Model, Params(step["model"])), None, init_on_meta=True)
