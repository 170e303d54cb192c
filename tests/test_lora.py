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
from tango.integrations.torch import Model

from tests import harness
from tests.conftest import TinyPretrained
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
    for key, job, result in zip(keys, jobs, harness.run(jobs, out=root / "harness", timeout=400)):
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
        ({"lora_alpha": "big"}, "fairscale::with_lora.lora_alpha: must be a finite number > 0, got 'big'"),
        (
            {"lora_alpha": float("inf")},
            "fairscale::with_lora.lora_alpha: must be a finite number > 0, got inf",
        ),
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
            {"target_modules": ["mlp"]},
            "fairscale::with_lora: target_modules ['mlp'] matches a LlamaMLP, which LoRA cannot adapt (it "
            "adapts linear, embedding and convolution layers). The model's layers that can take adapters "
            "are named: down_proj, embed_tokens,",
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


# --- modules_to_save, trained biases, a tied head: issue #44 -------------------------------------

#: peft's options beyond the adapters: a trained copy of the (tied) head, and every bias trained.
FULL_OPTIONS: Dict[str, Any] = {
    "r": 4,
    "target_modules": ["q_proj", "v_proj"],
    "modules_to_save": ["lm_head"],
    "bias": "all",
}


@pytest.fixture(scope="module")
def biased(tiny_pretrained: TinyPretrained) -> Path:
    """The tiny Llama (head tied to the embedding) with biases on its attention projections."""
    return tiny_pretrained({**LLAMA, "attention_bias": True}, seed=4)


def _logits_of(model: Any, seed: int) -> torch.Tensor:
    tokens = torch.randint(LLAMA["vocab_size"], (2, LENGTH), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits  # type: ignore[no-any-return]


def _with_lora(pretrained: Path, options: Dict[str, Any]) -> Any:
    from transformers import AutoModelForCausalLM

    from tango_fairscale import with_lora

    return with_lora(AutoModelForCausalLM.from_pretrained(pretrained), **options)


def _state_source(state: Dict[str, torch.Tensor]) -> Any:
    """A state dict as the export reads weights.pt: names with shapes and dtypes, and a reader."""
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}, state.__getitem__


def _exported_logits(pretrained: Path, adapter: Path, merged: Path, seed: int) -> Dict[str, torch.Tensor]:
    """The logits of the adapter directory loaded by peft onto the base, and of the merged export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), str(adapter))
    return {
        "adapter": _logits_of(loaded, seed),
        "merged": _logits_of(AutoModelForCausalLM.from_pretrained(merged), seed),
    }


@pytest.mark.parametrize(
    "options",
    [
        FULL_OPTIONS,
        {"r": 4, "target_modules": ["q_proj", "v_proj"], "bias": "lora_only"},
        # LoRA on the head tied to the embedding: merged into the one tensor, it changed the embedding.
        {"r": 4, "target_modules": ["q_proj", "lm_head"]},
    ],
    ids=["modules_to_save-bias_all", "bias_lora_only", "lora_on_the_tied_head"],
)
def test_the_adapter_and_merged_exports_hold_every_trained_tensor(
    biased: Path, tmp_path: Path, options: Dict[str, Any]
) -> None:
    from tango_fairscale.finetune.hf_export import export_merged_adapter, export_peft_adapter

    model = _with_lora(biased, options)
    # Training's stand-in: every trainable tensor moved off its start.
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.2)
    expected = _logits_of(model, seed=4)
    source = _state_source(dict(model.state_dict()))
    export_peft_adapter(source, tmp_path / "adapter", model, base_directory=biased)
    export_merged_adapter(tmp_path / "adapter", tmp_path / "merged")
    for kind, logits in _exported_logits(biased, tmp_path / "adapter", tmp_path / "merged", seed=4).items():
        difference = (logits - expected).abs().max().item()
        print(f"[{options}] {kind} export: max logit difference {difference:.3e}")
        assert difference <= TOLERANCE, kind


def _full_experiment(pretrained: Path, backend: str) -> Dict[str, Any]:
    """fairscale::with_lora with FULL_OPTIONS, under DDP or a backend with init_on_meta, exported."""
    model = {
        "type": "fairscale::with_lora",
        "model": {"type": "fairscale::from_pretrained", "pretrained_model_name_or_path": str(pretrained)},
        **FULL_OPTIONS,
    }
    config = experiment(pretrained, backend, True, 0.01, STEPS)
    train = config["steps"]["train"]
    if backend == "ddp":
        train["model"] = model
    else:
        train["model"]["model"] = model
    return config


@pytest.fixture(scope="module")
def full_runs(biased: Path, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """The work directories of FULL_OPTIONS runs: DDP, and each backend under init_on_meta."""
    root = tmp_path_factory.mktemp("full_runs")
    keys = ["ddp", "fairscale", "torch"]
    jobs = [harness.Train(_full_experiment(biased, key), root / key) for key in keys]
    for result in harness.run(jobs, out=root / "harness", timeout=400):
        result.check()
    return {key: job.work_dir for key, job in zip(keys, jobs)}


@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_modules_to_save_and_trained_biases_train_as_ddp_and_export_the_trained_model(
    full_runs: Dict[str, Path], biased: Path, backend: str
) -> None:
    """
    The head's modules_to_save copy starts from the pretrained head under init_on_meta (as
    eagerly), so the run ends as DDP's; the adapter export holds the trained biases and the
    head's copy: peft's PeftModel.from_pretrained and the merged export give the trained logits.
    """
    weights = torch.load(full_runs[backend] / "weights.pt", weights_only=True)
    ddp = torch.load(full_runs["ddp"] / "weights.pt", weights_only=True)
    assert set(weights) == set(ddp)
    head = "base_model.model.lm_head.modules_to_save.default.weight"
    biases = [key for key in weights if key.endswith(".bias")]
    assert biases and not torch.equal(
        weights[head], weights["base_model.model.lm_head.original_module.weight"]
    )
    difference = max_abs_difference(weights, ddp)
    print(f"[{backend}, init_on_meta] max |weights.pt - DDP| = {difference:.3e}")
    assert difference <= TOLERANCE
    trained = _with_lora(biased, FULL_OPTIONS)
    trained.load_state_dict(weights)
    expected = _logits_of(trained, seed=5)
    work_dir = full_runs[backend]
    exported = _exported_logits(biased, work_dir / "adapter", work_dir / "merged", seed=5)
    for kind, logits in exported.items():
        difference = (logits - expected).abs().max().item()
        print(f"[{backend}] {kind} export: max logit difference {difference:.3e}")
        assert difference <= TOLERANCE, kind


def _peft_method_config(method: str) -> Any:
    import peft

    if method == "IA3":
        return peft.IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
        )
    if method == "LOHA":
        return peft.LoHaConfig(r=4, target_modules=["q_proj", "v_proj"])
    if method == "VERA":
        return peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"])
    if method == "PREFIX_TUNING":
        return peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)


@Model.register("test::peft_method", exist_ok=True)
def peft_method(pretrained: str, method: str) -> Model:
    """A user's own constructor of a peft model of another method than LoRA."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(pretrained)
    return get_peft_model(base, _peft_method_config(method))  # type: ignore[no-any-return]


@pytest.mark.parametrize("method", ["IA3", "LOHA", "VERA", "PREFIX_TUNING", "PROMPT_TUNING"])
def test_peft_methods_other_than_lora_are_refused_before_training(pretrained: Path, method: str) -> None:
    """
    They trained and then exported nothing (IA3, LoHa), or failed in the export (prefix and
    prompt tuning) or in the first forward (VeRA under init_on_meta). Refused by pre-flight under
    init_on_meta (the model built on meta), and by each worker's build before it shards the model
    (the backends' note_model asks adapter_config_of), in one line naming the method.
    """
    from tango.common import Lazy, Params
    from tango.common.exceptions import ConfigurationError

    from tango_fairscale.finetune.lora import adapter_config_of
    from tango_fairscale.preflight import check_model

    model = {"type": "test::peft_method", "pretrained": str(pretrained), "method": method}
    wrapped = {
        "type": "fairscale::with_wrapped_modules",
        "model": model,
        "wrap_module_classes": ["LlamaDecoderLayer"],
        "fsdp_config": {},
    }
    expected = f"model: its peft adapter 'default' is peft's {method} ("
    supported = "it supports peft's LoRA only (LoraConfig, or fairscale::with_lora)"
    with pytest.raises(ConfigurationError) as error:
        check_model(Lazy(Model, Params(wrapped)), None, init_on_meta=True, export_hf="adapter")
    eager = peft_method(str(pretrained), method)
    with pytest.raises(ConfigurationError) as in_worker:
        adapter_config_of(eager)
    for message in (str(error.value), str(in_worker.value)):
        assert message.startswith(expected) and supported in message and "\n" not in message, message


#: A process that exports a LoRA adapter into sys.argv[2] from the model of sys.argv[1] and is
#: killed (SIGKILL) in the middle: "early" while filling the temporary directory, "late" after a
#: second export put its directory in place, before it removed the previous one.
_KILLED_EXPORT = """
import os, shutil, signal, sys
from pathlib import Path
from transformers import AutoModelForCausalLM
from tango_fairscale import with_lora
from tango_fairscale.finetune import hf_export

model = with_lora(AutoModelForCausalLM.from_pretrained(sys.argv[1]), r=4, target_modules=["q_proj"])
state = dict(model.state_dict())
source = ({name: (tuple(t.shape), t.dtype) for name, t in state.items()}, state.__getitem__)
die = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[3] == "early":
    hf_export._copy_tokenizer = die
else:
    hf_export.export_peft_adapter(source, Path(sys.argv[2]), model)
    hf_export.shutil = type("Shutil", (), {"rmtree": staticmethod(die), "copyfile": shutil.copyfile})
hf_export.export_peft_adapter(source, Path(sys.argv[2]), model)
"""


@pytest.mark.parametrize("when", ["early", "late"])
def test_the_next_export_removes_what_a_killed_adapter_export_left(
    pretrained: Path, tmp_path: Path, when: str
) -> None:
    import signal
    import subprocess
    import sys

    from tango_fairscale.finetune.hf_export import export_peft_adapter

    adapter = tmp_path / "adapter"
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, str(pretrained), str(adapter), when],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    left = [path for path in tmp_path.iterdir() if path.name.startswith(".adapter.")]
    # "late": the earlier export, swapped out (RENAME_EXCHANGE) under the temporary's name.
    assert len(left) == 1 and left[0].name.endswith(".tmp"), left
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in left[0].iterdir()}
    # A directory named as the killed export's temporaries were that holds something an export
    # does not write: not ours, kept.
    _, _, host, pid, _, _ = left[0].name.split(".")
    foreign = tmp_path / f".adapter.{host}.{pid}.0123abcd.tmp"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")

    from transformers import AutoModelForCausalLM

    from tango_fairscale import with_lora

    model = with_lora(AutoModelForCausalLM.from_pretrained(pretrained), r=4, target_modules=["q_proj"])
    export_peft_adapter(_state_source(dict(model.state_dict())), adapter, model)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(["adapter", foreign.name])
    assert (foreign / "notes.txt").read_text() == "mine"


def test_with_lora_around_a_wrapped_model_is_refused_in_one_line(pretrained: Path) -> None:
    """peft's wrapper hid the plan recorded on the model under it: the run trained one unit, silently."""
    from tango.common.exceptions import ConfigurationError
    from transformers import AutoModelForCausalLM

    from tango_fairscale import with_lora, with_wrapped_modules

    wrapped = with_wrapped_modules(
        AutoModelForCausalLM.from_pretrained(pretrained),
        wrap_module_classes=["LlamaDecoderLayer"],
        fsdp_config=None,
    )
    with pytest.raises(ConfigurationError) as error:
        with_lora(wrapped, target_modules=["q_proj"])
    message = str(error.value)
    assert (
        "is a fairscale::with_wrapped_modules model" in message
        and "Put fairscale::with_lora inside" in message
    )
    assert "\n" not in message


def test_export_hf_merged_of_a_model_without_adapters_is_refused_by_the_engine(
    pretrained: Path, tmp_path: Path
) -> None:
    """Pre-flight cannot build every model on meta without init_on_meta: the engine says it, first."""
    config = experiment(pretrained, "fairscale", False, 0.01, 2)
    config["steps"]["train"]["model"]["model"] = {
        "type": "fairscale::from_pretrained",
        "pretrained_model_name_or_path": str(pretrained),
    }
    config["steps"]["train"]["training_engine"].update(export_hf="hf", export_hf_merged="merged")
    (result,) = harness.run([harness.Train(config, tmp_path / "work")], out=tmp_path / "harness")
    for error in result.errors:
        assert error is not None and "export_hf_merged: the model has no LoRA adapters to merge" in error
    assert not (tmp_path / "work" / "weights.pt").exists() and not (tmp_path / "work" / "merged").exists()


def test_export_paths_expand_the_home_directory(tmp_path: Path) -> None:
    from tango_fairscale.output_paths import export_hf_path

    assert export_hf_path("~/exports/hf", tmp_path) == Path.home() / "exports" / "hf"
    assert export_hf_path("hf", tmp_path) == tmp_path / "hf"
    assert export_hf_path(str(tmp_path / "abs"), Path("/elsewhere")) == tmp_path / "abs"
