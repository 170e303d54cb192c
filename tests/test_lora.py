"""
LoRA under FSDP, the way most fine-tuning runs today: a user's own constructor returning peft's
``get_peft_model(AutoModelForCausalLM.from_pretrained(dir), LoraConfig(...))`` inside
``fairscale::with_wrapped_modules`` with one unit per decoder layer, so that every unit holds the
frozen base beside trainable adapters. On 2 CPU workers in the test's own workers
(:mod:`tests.harness`), with either backend, eagerly and with ``init_on_meta``, against Tango's DDP
engine on the same config.
"""

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from tests import harness
from tests.helpers import TINY_LLAMA, max_abs_difference, pretrained_name, train_config

pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402  (transformers brings safetensors)

LLAMA = TINY_LLAMA
LENGTH = 16
STEPS = 4
TOLERANCE = 1e-5
#: ``(backend, init_on_meta)`` of the sharded runs; ``"ddp"`` is Tango's DDP engine.
VARIANTS = [("fairscale", False), ("fairscale", True), ("torch", False), ("torch", True)]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with tied embeddings, moved off its initialisation, saved as transformers does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens = torch.randint(LLAMA["vocab_size"], (4, LENGTH))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    directory = tmp_path_factory.mktemp("pretrained") / "llama"
    model.save_pretrained(directory)
    return directory


def experiment(
    directory: Path,
    backend: str,
    init_on_meta: bool,
    lr: float,
    steps: int,
    first_class: bool = False,
    checkpointing: bool = False,
) -> Dict[str, Any]:
    model: Dict[str, Any] = {"type": "test::peft_lora", "pretrained": str(directory)}
    if first_class:
        # The same adapters from the config alone: fairscale::with_lora on fairscale::from_pretrained.
        model = {
            "type": "fairscale::with_lora",
            "model": {"type": "fairscale::from_pretrained", "pretrained_model_name_or_path": str(directory)},
            "r": 4,
            "target_modules": ["q_proj", "v_proj"],
        }
    if backend == "ddp":
        config = train_config(
            engine="torch", model=model, train_steps=steps, checkpoint_every=steps, callbacks=[]
        )
    else:
        wrapped = {
            "type": "fairscale::with_wrapped_modules",
            "model": model,
            "wrap_module_classes": ["LlamaDecoderLayer"],
            "fsdp_config": {},
            "activation_checkpointing": checkpointing,
        }
        config = train_config(
            engine="fairscale",
            model=wrapped,
            train_steps=steps,
            checkpoint_every=steps,
            callbacks=[],
            engine_extra={
                "backend": backend,
                "init_on_meta": init_on_meta,
                "export_hf": "adapter",
                "export_hf_merged": "merged",
            },
        )
    config["steps"]["train"]["training_engine"]["optimizer"] = {"type": "torch::AdamW", "lr": lr}
    config["steps"]["data"] = {"type": "test::lm_data", "vocab_size": LLAMA["vocab_size"], "length": LENGTH}
    return config


def _key(backend: str, init_on_meta: bool) -> str:
    return f"{backend}{'-meta' if init_on_meta else ''}"


@pytest.fixture(scope="module")
def runs(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, torch.Tensor]]:
    """weights.pt of every run (``KEY`` fine-tuned, ``KEY-start`` with a learning rate of 0), in one start."""
    root = tmp_path_factory.mktemp("lora_runs")
    settings = [(backend, meta) for backend, meta in VARIANTS] + [("ddp", False)]
    jobs: List[harness.Train] = []
    keys: List[str] = []
    for backend, meta in settings:
        for suffix, lr, steps in (("", 0.01, STEPS), ("-start", 0.0, 1)):
            keys.append(_key(backend, meta) + suffix)
            jobs.append(harness.Train(experiment(pretrained, backend, meta, lr, steps), root / keys[-1]))
    keys.append("fairscale-with_lora")
    jobs.append(harness.Train(experiment(pretrained, "fairscale", False, 0.01, STEPS, True), root / keys[-1]))
    # Checkpointed on the torch backend: on CPU workers FairScale's reentrant wrapper, whose first
    # layer's input (the frozen embedding's output) requires no gradient.
    keys.append("torch-meta-ckpt")
    jobs.append(
        harness.Train(experiment(pretrained, "torch", True, 0.01, STEPS, checkpointing=True), root / keys[-1])
    )
    results = {}
    for key, job, result in zip(keys, jobs, harness.run(jobs, out=root / "harness", timeout=600)):
        result.check()
        results[key] = torch.load(job.work_dir / "weights.pt", weights_only=True)
        WORK_DIRS[key] = job.work_dir
    return results


#: The runs' work directories, by key (filled by the ``runs`` fixture).
WORK_DIRS: Dict[str, Path] = {}


@pytest.mark.parametrize(
    "backend, init_on_meta, suffix", [(b, m, "") for b, m in VARIANTS] + [("torch", True, "-ckpt")]
)
def test_lora_trains_as_ddp_with_the_base_bit_identical(
    runs: Dict[str, Dict[str, torch.Tensor]], pretrained: Path, backend: str, init_on_meta: bool, suffix: str
) -> None:
    weights, ddp = runs[_key(backend, init_on_meta) + suffix], runs["ddp"]
    assert set(weights) == set(ddp)
    adapters = [key for key in weights if "lora_" in key]
    assert adapters and all(
        not torch.equal(weights[k], runs["ddp-start"][k]) for k in adapters if "lora_B" in k
    )
    files = load_file(str(pretrained / "model.safetensors"))
    base = [key for key in weights if "lora_" not in key]
    for key in base:
        # The tied head is saved once, as the embedding.
        name = (
            pretrained_name(key) if pretrained_name(key) != "lm_head.weight" else "model.embed_tokens.weight"
        )
        assert torch.equal(weights[key], files[name]), key
    difference = max_abs_difference(weights, ddp)
    print(f"[{backend}{suffix}, init_on_meta={init_on_meta}] max |weights.pt - DDP| = {difference:.3e}")
    assert difference <= TOLERANCE


@pytest.mark.parametrize("backend, init_on_meta", VARIANTS)
def test_lora_starts_at_the_pretrained_model(
    runs: Dict[str, Dict[str, torch.Tensor]], pretrained: Path, backend: str, init_on_meta: bool
) -> None:
    # peft's own initialisation, kept: B is zero (so the model is the pretrained model) and A is what
    # the eager build drew.
    start, ddp_start = runs[f"{_key(backend, init_on_meta)}-start"], runs["ddp-start"]
    for key in start:
        if "lora_" in key:
            assert torch.equal(start[key], ddp_start[key]), key
            if "lora_B" in key:
                assert not start[key].any(), key
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(LLAMA["vocab_size"], (2, LENGTH), generator=torch.Generator().manual_seed(1))
    plain = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    model = PeftModel(AutoModelForCausalLM.from_pretrained(pretrained), _lora_config()).eval()
    model.load_state_dict(start)
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, plain(input_ids=tokens).logits)


def _lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def test_with_lora_from_the_config_trains_as_the_users_own_constructor(
    runs: Dict[str, Dict[str, torch.Tensor]],
) -> None:
    weights, ddp = runs["fairscale-with_lora"], runs["ddp"]
    assert set(weights) == set(ddp)
    difference = max_abs_difference(weights, ddp)
    print(f"fairscale::with_lora vs the user's get_peft_model under DDP: max difference {difference:.3e}")
    assert difference <= TOLERANCE


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"r": 0}, "fairscale::with_lora.r: must be a positive integer, got 0"),
        ({"lora_dropout": 1.5}, "fairscale::with_lora.lora_dropout: must be in [0, 1), got 1.5"),
        ({"bias": "some"}, "fairscale::with_lora.bias: must be one of ['none', 'all', 'lora_only']"),
        ({"modules_to_save": "score"}, "modules_to_save: expected a list of module names"),
        ({"lora_alpha": "big"}, "fairscale::with_lora.lora_alpha: must be a number > 0, got 'big'"),
        ({"lora_dropout": "0.1"}, "fairscale::with_lora.lora_dropout: must be in [0, 1), got '0.1'"),
        (
            {"target_modules": "q_proj("},
            "fairscale::with_lora.target_modules: 'q_proj(' is not a valid regular",
        ),
        (
            {"target_modules": ["q_proj"], "modules_to_save": ["lm_haed"]},
            "modules_to_save: 'lm_haed' names no module of LlamaForCausalLM (it must be the end of a "
            "module's dotted name, e.g. 'lm_head'). Did you mean 'lm_head'?",
        ),
        (
            {"target_modules": ["no_such_proj"]},
            "fairscale::with_lora: Target modules {'no_such_proj'} not found",
        ),
        (
            {"target_modules": ["c_attn"]},
            "The model's layers that can take adapters are named: down_proj, embed_tokens, gate_proj, "
            "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj (target_modules as a name in the list matches "
            "the end of a module's dotted name)",
        ),
    ],
)
def test_bad_lora_options_are_one_line(pretrained: Path, options: Dict[str, Any], fragment: str) -> None:
    from tango.common.exceptions import ConfigurationError
    from transformers import AutoModelForCausalLM

    from tango_fairscale import with_lora

    with pytest.raises(ConfigurationError) as error:
        with_lora(AutoModelForCausalLM.from_pretrained(pretrained), **options)
    assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_options_from_a_config_as_peft_takes_them(pretrained: Path) -> None:
    """
    From a config, a single string in target_modules is peft's regex (not a list of its
    characters), and modules_to_save as a string is refused in one line.
    """
    from tango.common import Lazy, Params
    from tango.common.exceptions import ConfigurationError
    from tango.integrations.torch import Model

    from tango_fairscale.preflight import check_model_keys

    base = {"type": "fairscale::from_pretrained", "pretrained_model_name_or_path": str(pretrained)}
    regex = r"model\.layers\.0\.self_attn\.(q|v)_proj"
    built = Lazy(
        Model, Params({"type": "fairscale::with_lora", "model": base, "target_modules": regex})
    ).construct()
    adapted = sorted(name for name, _ in built.named_modules() if name.endswith(".lora_A"))
    assert adapted == [
        f"base_model.model.model.layers.0.self_attn.{name}.lora_A" for name in ("q_proj", "v_proj")
    ]
    # A regex matching nothing: the hint says how a regex matches.
    with pytest.raises(ConfigurationError) as error:
        Lazy(
            Model, Params({"type": "fairscale::with_lora", "model": base, "target_modules": "q_proj"})
        ).construct()
    assert "(target_modules as a regex, it must match a module's whole dotted name" in str(error.value)
    # A misspelt option, named before anything is built (pre-flight).
    misspelt = {"type": "fairscale::with_lora", "model": base, "target_module": ["q_proj"]}
    with pytest.raises(ConfigurationError) as error:
        check_model_keys(Lazy(Model, Params(misspelt)))
    assert str(error.value) == (
        "model.target_module: not an option of 'fairscale::with_lora': did you mean 'target_modules'?"
    )
    # A config override holding a "type" key (Llama's rope_scaling) reaches the model's config.
    scaled = {**base, "config_overrides": {"rope_scaling": {"type": "linear", "factor": 2.0}}}
    assert Lazy(Model, Params(scaled)).construct().config.rope_scaling["factor"] == 2.0
    with pytest.raises(ConfigurationError) as error:
        Lazy(
            Model, Params({"type": "fairscale::with_lora", "model": base, "modules_to_save": "lm_head"})
        ).construct()
    message = "modules_to_save: expected a list of module names, got the string 'lm_head': write ['lm_head']."
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_gpt2s_conv1d_layers_take_adapters_quietly() -> None:
    """
    peft's fan_in_fan_out for transformers' Conv1D layers is set without its warning, and the
    model starts where the base is.
    """
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    from tango_fairscale import with_lora

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)).eval()
    tokens = torch.randint(32, (2, 8))
    expected = base(input_ids=tokens).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = with_lora(base, r=4, target_modules=["c_attn"])
    assert not [w for w in caught if "fan_in_fan_out" in str(w.message)], [str(w.message) for w in caught]
    assert model.peft_config["default"].fan_in_fan_out is True
    assert torch.equal(model(input_ids=tokens).logits, expected)


@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_the_exported_adapter_loads_with_peft_and_gives_the_trained_logits(
    runs: Dict[str, Dict[str, torch.Tensor]], pretrained: Path, backend: str
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = WORK_DIRS[backend] / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    tokens = torch.randint(LLAMA["vocab_size"], (2, LENGTH), generator=torch.Generator().manual_seed(2))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), str(adapter)).eval()
    trained = PeftModel(AutoModelForCausalLM.from_pretrained(pretrained), _lora_config()).eval()
    trained.load_state_dict(runs[backend])
    with torch.no_grad():
        expected = trained(input_ids=tokens).logits
        difference = (loaded(input_ids=tokens).logits - expected).abs().max().item()
        untrained = AutoModelForCausalLM.from_pretrained(pretrained)(input_ids=tokens).logits - expected
    print(f"[{backend}] adapter from PeftModel.from_pretrained: max logit difference {difference:.3e}")
    assert difference <= TOLERANCE and untrained.abs().max().item() > 100 * TOLERANCE


def test_the_merged_export_loads_with_from_pretrained_and_gives_the_trained_logits(
    runs: Dict[str, Dict[str, torch.Tensor]], pretrained: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(WORK_DIRS["fairscale"] / "merged").eval()
    trained = PeftModel(AutoModelForCausalLM.from_pretrained(pretrained), _lora_config()).eval()
    trained.load_state_dict(runs["fairscale"])
    tokens = torch.randint(LLAMA["vocab_size"], (2, LENGTH), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        difference = (merged(input_ids=tokens).logits - trained(input_ids=tokens).logits).abs().max().item()
    print(f"merged export from from_pretrained: max logit difference {difference:.3e}")
    assert difference <= TOLERANCE
