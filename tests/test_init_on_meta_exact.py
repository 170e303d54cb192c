"""
``init_on_meta`` gives every parameter the value an eager build of the same constructor gives it,
bit for bit, from the same seed: values a constructor set by hand (zeros, constants, writes
through views, ``orthogonal_`` and ``trunc_normal_``, which skip meta tensors), a model built from
its config, and peft's LoRA adapters on a pretrained model (``lora_B`` zero, ``lora_A`` the eager
draw, so the model's logits at step 0 are the pretrained model's). A value that cannot be known
(computed from other parameters while they are on meta, a parameter made on meta) is refused,
naming it, by materialisation and before any worker starts. Through the engine on 2 workers of
each backend, in the test's own workers (:mod:`tests.harness`).
"""

from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
from tango.common import Lazy, Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import Model

from tango_fairscale.materialize import (
    _TRACK,
    check_initialisable,
    materialize_module,
    parameters_on_meta,
)
from tests import harness
from tests.conftest import TinyPretrained
from tests.helpers import TINY_LLAMA, build_both, train_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

#: A tiny Llama with its LM head tied to the token embedding, narrower than the helpers' one.
LLAMA = {**TINY_LLAMA, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}
LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
SEED = 13


class HandInitialised(nn.Module):
    """Parameters a constructor sets by hand after building its modules, every way we know of."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16))
        self.embedding = nn.Embedding(10, 16, padding_idx=0)  # zeroes a row through a view
        self.head = nn.Linear(16, 3)
        nn.init.zeros_(self.head.weight)
        self.head.bias.data.fill_(1.0)
        self.gain = nn.Parameter(torch.ones(16))
        self.gain.data[3] = 5.0  # a scalar made on the parameter's device, copied into a view
        self.rotation = nn.Parameter(torch.empty(6, 4))
        nn.init.orthogonal_(self.rotation)  # returns at once on meta (P1 records it whole)
        self.truncated = nn.Parameter(torch.empty(5, 5))
        nn.init.trunc_normal_(self.truncated, std=0.02)  # the same
        self.identity = nn.Parameter(torch.empty(4, 4))
        nn.init.eye_(self.identity)
        self.table = nn.Linear(4, 4)
        with torch.no_grad():
            self.table.weight.copy_(torch.arange(16.0).view(4, 4))  # from a real tensor
        self.body[2].weight.data.mul_(0.5)  # in place, reading the recorded value
        self.float64 = nn.Linear(3, 3).to(torch.float64)  # data replaced by a cast
        self.last = nn.Linear(16, 4)  # drawn after all the above: the generator must be in step


def assert_same(eager: nn.Module, built: nn.Module) -> None:
    expected, got = eager.state_dict(), built.state_dict()
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("one_allocation", [False, True])
def test_values_set_by_hand_are_the_eager_ones(one_allocation: bool) -> None:
    eager, built = build_both(
        HandInitialised,
        lambda model: materialize_module(model, torch.device("cpu"), one_allocation=one_allocation),
    )
    assert_same(eager, built)
    assert isinstance(built, HandInitialised)
    assert torch.count_nonzero(built.head.weight) == 0
    assert torch.equal(built.head.bias, torch.ones(3))
    assert built.gain[3] == 5.0 and built.float64.weight.dtype == torch.float64
    # P1's stand-ins for torch.nn.init are gone with the build.
    assert torch.nn.init.orthogonal_.__module__ == "torch.nn.init"
    assert not hasattr(torch.nn.init.orthogonal_, "__wrapped__")


def units_then_root(layers: str) -> Callable[[nn.Module], None]:
    """Materialise as the backends do: each unit (``layers``' children) first, then the rest."""

    def materialize(model: nn.Module) -> None:
        for unit in model.get_submodule(layers):
            materialize_module(unit, torch.device("cpu"), root=model, one_allocation=True)
        materialize_module(model, torch.device("cpu"), root=model, one_allocation=True)

    return materialize


def test_a_model_built_from_its_config_is_the_eager_one() -> None:
    config = transformers.LlamaConfig(**LLAMA)
    eager, built = build_both(lambda: transformers.LlamaForCausalLM(config), units_then_root("model.layers"))
    assert_same(eager, built)
    assert built.lm_head.weight is built.model.embed_tokens.weight


def test_a_model_built_from_scratch_holds_no_parameter_values_before_it_is_materialised() -> None:
    # Every weight is created with torch.empty and overwritten whole by its initialiser: nothing
    # is kept for it between the build and materialisation (the constructed values of
    # nn.Parameter(torch.ones(n)) would be, until overwritten; Llama's norms are filled again).
    with parameters_on_meta():
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    tracks = [getattr(p, _TRACK) for p in model.parameters()]
    assert all(p.is_meta for p in model.parameters())
    assert all(track.base is None and track.read is None for track in tracks)
    assert all(len(track.log) <= 2 for track in tracks)  # a full overwrite, and padding_idx's row at most


@pytest.fixture(scope="module")
def pretrained(tiny_pretrained: TinyPretrained) -> Path:
    """A tiny Llama with tied embeddings, saved as transformers saves it."""
    return tiny_pretrained(LLAMA, seed=3)


def test_from_pretrained_draws_no_random_number(pretrained: Path) -> None:
    # What makes adapters exact: transformers' from_pretrained draws nothing (4.57), and neither
    # does its build on meta (H2's load_on_meta, fairscale::from_pretrained).
    from tango_fairscale.finetune.pretrained import from_pretrained

    for loading_on_meta in (False, True):
        for load in (
            lambda: transformers.AutoModelForCausalLM.from_pretrained(pretrained),
            lambda: from_pretrained(str(pretrained)),
        ):
            state = torch.random.get_rng_state()
            with parameters_on_meta() if loading_on_meta else torch.no_grad():
                load()
            assert torch.equal(torch.random.get_rng_state(), state), loading_on_meta


def lora_model(directory: Path) -> nn.Module:
    base = transformers.AutoModelForCausalLM.from_pretrained(directory)
    return peft.get_peft_model(base, peft.LoraConfig(**LORA))  # type: ignore[no-any-return]


def test_lora_on_a_pretrained_model_starts_as_the_eager_build(pretrained: Path) -> None:
    eager, built = build_both(
        lambda: lora_model(pretrained), units_then_root("base_model.model.model.layers")
    )
    assert_same(eager, built)
    adapters = {name: p for name, p in built.named_parameters() if "lora_" in name}
    assert len(adapters) == 2 * 2 * 2  # lora_A and lora_B of q_proj and v_proj in 2 layers
    for name, param in adapters.items():
        if "lora_B" in name:
            assert torch.count_nonzero(param) == 0, name
        else:  # kaiming-uniform, drawn where the eager build draws it
            assert param.abs().max() > 0, name
    # A unit's adapters are one allocation; its pretrained weights, which nothing wrote to, are
    # taken as read from the mapped file (no copy), as before adapters were recorded.
    layer = built.base_model.model.model.layers[0]
    storage = layer.self_attn.q_proj.lora_A.default.weight.untyped_storage().data_ptr()
    assert layer.self_attn.v_proj.lora_B.default.weight.untyped_storage().data_ptr() == storage
    base = [
        layer.self_attn.q_proj.base_layer.weight,
        layer.mlp.down_proj.weight,
        layer.input_layernorm.weight,
    ]
    assert len({p.untyped_storage().data_ptr() for p in base} | {storage}) == len(base) + 1
    # At step 0 the model is the pretrained one.
    tokens = torch.tensor([[1, 5, 9, 2, 7]])
    original = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    with torch.no_grad():
        assert torch.equal(built(input_ids=tokens).logits, original(input_ids=tokens).logits)


def test_changes_a_constructor_makes_to_pretrained_weights_are_kept(pretrained: Path) -> None:
    def build() -> nn.Module:
        model = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
        model.model.norm.weight.data.mul_(2.0)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight[0].zero_()
        return model  # type: ignore[no-any-return]

    eager, built = build_both(build, units_then_root("model.layers"))
    assert_same(eager, built)
    assert torch.count_nonzero(built.model.layers[0].mlp.down_proj.weight[0]) == 0


class ComputedFromAnother(nn.Module):
    """A parameter set from another's values, and a layer made on the meta device by its constructor."""

    def __init__(self) -> None:
        super().__init__()
        self.source = nn.Linear(4, 4)
        self.derived = nn.Parameter(torch.empty(4, 4))
        with torch.no_grad():
            self.derived.copy_(self.source.weight * 2)
        self.placed = nn.Linear(2, 2, device=self.source.weight.device)


REFUSAL = (
    r"init_on_meta cannot give these parameters the values an eager build of the model gives them: "
    r"{derived} \(set by aten\.copy_\.default from a value computed on meta by aten\.mul\.Tensor from a "
    r"parameter's values\); {placed}\.weight \(created on the meta device by the model's constructor\); "
    r"{placed}\.bias \(created on the meta device by the model's constructor\)\. .*init_on_meta: false\.$"
)


def test_values_that_cannot_be_known_are_refused_naming_them() -> None:
    with parameters_on_meta():
        model = ComputedFromAnother()
    with pytest.raises(ConfigurationError, match=REFUSAL.format(derived="derived", placed="placed")):
        check_initialisable(model)
    with pytest.raises(
        ConfigurationError, match=REFUSAL.format(derived="ComputedFromAnother.derived", placed="Linear")
    ):
        materialize_module(model, torch.device("cpu"))


def test_dora_magnitudes_computed_from_pretrained_weights_are_refused(pretrained: Path) -> None:
    with parameters_on_meta():
        model = peft.get_peft_model(
            transformers.AutoModelForCausalLM.from_pretrained(pretrained),
            peft.LoraConfig(**LORA, use_dora=True),
        )
    with pytest.raises(ConfigurationError) as raised:
        check_initialisable(model)
    named = [
        f"base_model.model.model.layers.{layer}.self_attn.{projection}.lora_magnitude_vector.default.weight"
        for layer in range(2)
        for projection in ("q_proj", "v_proj")
    ]
    assert all(f"{name} (computed on meta by " in str(raised.value) for name in named), str(raised.value)


@Model.register("test::computed_from_another")
class ComputedFromAnotherModel(Model):
    def __init__(self) -> None:
        super().__init__()
        self.inner = ComputedFromAnother()


def test_preflight_refuses_them_before_any_worker_starts() -> None:
    from tango_fairscale.preflight import check_init_on_meta

    model = Lazy(Model, Params({"type": "test::computed_from_another"}))
    with pytest.raises(
        ConfigurationError, match=REFUSAL.format(derived="inner.derived", placed="inner.placed")
    ):
        check_init_on_meta(model)


# --- Through the engine: both backends, 2 workers ------------------------------------------------------


class LoraWithValueHead(Model):
    """
    peft's LoRA on a pretrained causal LM, with a value head its constructor zero-initialises (and
    whose bias it sets to 1), as a fine-tuning constructor of a user's would. Named by its module
    path in configs, so that the harness's workers import it.
    """

    def __init__(self, pretrained: str) -> None:
        super().__init__()
        self.lm = lora_model(Path(pretrained))
        self.value = nn.Linear(LLAMA["hidden_size"], 1)  # type: ignore[arg-type]
        nn.init.zeros_(self.value.weight)
        self.value.bias.data.fill_(1.0)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        output = self.lm(input_ids=input_ids, labels=labels, output_hidden_states=True)
        value = self.value(output.hidden_states[-1]).squeeze(-1)
        return {"loss": output.loss + (value - 1.0).pow(2).mean()}


BACKENDS = ["fairscale", "torch"]


def engine_experiment(directory: Path, backend: str, init_on_meta: bool) -> Dict[str, Any]:
    """One step at learning rate 0 (weights.pt is the model as built), each decoder layer a unit."""
    wrapped = {
        "type": "fairscale::with_wrapped_modules",
        "model": {"type": f"{__name__}.LoraWithValueHead", "pretrained": str(directory)},
        "modules_to_wrap": [r"lm\.base_model\.model\.model\.layers\.[0-9]+"],
        "fsdp_config": {},
    }
    config = train_config(
        engine="fairscale",
        model=wrapped,
        train_steps=1,
        checkpoint_every=1,
        callbacks=[],
        seed=SEED,
        engine_extra={"backend": backend, "init_on_meta": init_on_meta},
    )
    config["steps"]["train"]["training_engine"]["optimizer"] = {
        "type": "torch::AdamW",
        "lr": 0.0,
        "weight_decay": 0.0,
    }
    config["steps"]["data"] = {"type": "test::lm_data", "vocab_size": LLAMA["vocab_size"], "length": 16}
    return config


@pytest.fixture(scope="module")
def engine_runs(
    pretrained: Path, tmp_path_factory: pytest.TempPathFactory
) -> Dict[Tuple[str, bool], Dict[str, Any]]:
    """weights.pt of each backend's run, with and without init_on_meta, in one start of the workers."""
    root = tmp_path_factory.mktemp("exact_runs")
    keys: List[Tuple[str, bool]] = [(backend, meta) for backend in BACKENDS for meta in (True, False)]
    jobs = [
        harness.Train(engine_experiment(pretrained, backend, meta), root / f"{backend}-{meta}")
        for backend, meta in keys
    ]
    weights = {}
    for key, job, result in zip(keys, jobs, harness.run(jobs, out=root / "harness")):
        result.check()
        weights[key] = torch.load(job.work_dir / "weights.pt", weights_only=True)
    return weights


@pytest.mark.parametrize("backend", BACKENDS)
def test_through_the_engine_lora_and_a_zeroed_head_start_as_built_eagerly(
    backend: str, pretrained: Path, engine_runs: Dict[Tuple[str, bool], Dict[str, Any]]
) -> None:
    on_meta, eager = engine_runs[(backend, True)], engine_runs[(backend, False)]
    assert list(on_meta) == list(eager)
    for name, tensor in eager.items():
        assert torch.equal(on_meta[name], tensor), name
    # The constructor's zeros and constant, the adapters' zeros.
    assert torch.count_nonzero(on_meta["value.weight"]) == 0
    assert torch.equal(on_meta["value.bias"], torch.ones(1))
    lora_b = [name for name in on_meta if ".lora_B." in name]
    assert len(lora_b) == 4 and all(torch.count_nonzero(on_meta[name]) == 0 for name in lora_b)
    # The model at step 0 is the pretrained one: its logits are the pretrained model's.
    model = LoraWithValueHead(str(pretrained))
    model.load_state_dict(on_meta, strict=True)
    original = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    tokens = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(model.lm(input_ids=tokens).logits, original(input_ids=tokens).logits)
    # Both backends start from the same values.
    other = engine_runs[(BACKENDS[1 - BACKENDS.index(backend)], True)]
    assert all(torch.equal(other[name], tensor) for name, tensor in on_meta.items())
