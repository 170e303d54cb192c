"""
Tango's own ``transformers`` integration next to the package: ``include_package`` of it imports on
the ``transformers`` the extras install (patch H1), its registered constructors work, and its
``transformers::AutoModelForCausalLM::from_pretrained`` inside ``fairscale::with_wrapped_modules``
starts from the pretrained weights exactly, with either backend, with and without ``init_on_meta``
(under which patch H2 routes ``from_pretrained`` to the unit-by-unit reading of the safetensors
files). Training in the test's own workers (:mod:`tests.harness`); one ``tango run`` for the CLI's
``-i`` path.
"""

from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
import torch
from tango.common import Lazy, Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import Model

from tango_fairscale import compat
from tango_fairscale.materialize import materialize_module, parameters_on_meta
from tests import harness
from tests.helpers import ConcurrentProcesses, load_weights, python_command, run_tango, train_config

pytest.importorskip("transformers")
pytest.importorskip("datasets")  # Tango's transformers integration imports it (the hf extra)
from safetensors.torch import load_file  # noqa: E402

from tests.test_pretrained import GPT2, NO_DROPOUT, pretrained  # noqa: E402,F401 - the saved tiny GPT-2

INTEGRATION = "tango.integrations.transformers"
TANGO_CAUSAL_LM = "transformers::AutoModelForCausalLM::from_pretrained"
BACKENDS = ["fairscale", "torch"]


def tango_model(directory: Path, **arguments: Any) -> Dict[str, Any]:
    """Tango's registered constructor for the saved model, as a config."""
    return {"type": TANGO_CAUSAL_LM, "pretrained_model_name_or_path": str(directory), **arguments}


def build(config: Dict[str, Any]) -> Any:
    return Lazy(Model, Params(dict(config))).construct()


def saved_tensors(directory: Path) -> Dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


# --- H1: the integration imports --------------------------------------------------------------------


# As `-i tango.integrations.transformers` imports it (every submodule), in a fresh process: first
# without the package (Tango's ia3 module fails on this transformers), then with it.
IMPORT_EVERY_SUBMODULE = f"""
from tango.common.util import import_module_and_submodules
try:
    import_module_and_submodules("{INTEGRATION}")
except ImportError as error:
    print("WITHOUT:", error)
import tango_fairscale
import_module_and_submodules("{INTEGRATION}")
from tango.integrations.transformers import ia3
from transformers import pytorch_utils
from transformers.models.gpt2 import modeling_gpt2
print("WITH:", ia3.Conv1D is pytorch_utils.Conv1D is modeling_gpt2.Conv1D)
"""

# Importing the package imports no transformers (seconds in every process); H2 is applied by the
# import hook when transformers' modeling_utils is imported later, which still loads as before.
IMPORT_TRANSFORMERS_LATER = """
import inspect, sys
import tango_fairscale
print("IMPORTED:", "transformers.modeling_utils" in sys.modules)
from transformers import PreTrainedModel, modeling_utils
print("ROUTED:", getattr(PreTrainedModel.from_pretrained.__func__, "_tango_fairscale", False))
print("SOURCE:", "class PreTrainedModel(" in inspect.getsource(modeling_utils))
"""


@pytest.fixture(scope="module")
def fresh_processes() -> Iterator[ConcurrentProcesses]:
    """The two import checks, each in its own fresh process, started together."""
    scripts = ConcurrentProcesses(
        {
            "submodules": python_command(IMPORT_EVERY_SUBMODULE),
            "later": python_command(IMPORT_TRANSFORMERS_LATER),
        }
    )
    yield scripts
    scripts.close()


def test_the_integration_imports_every_submodule_with_the_package_only(
    fresh_processes: ConcurrentProcesses,
) -> None:
    result = fresh_processes.result("submodules")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WITHOUT: cannot import name 'Conv1D' from 'transformers.modeling_utils'" in result.stdout
    assert "WITH: True" in result.stdout


def test_the_patches_wait_for_transformers_to_be_imported(fresh_processes: ConcurrentProcesses) -> None:
    result = fresh_processes.result("later")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == ["IMPORTED: False", "ROUTED: True", "SOURCE: True"]


def test_ia3_adapts_gpt2s_layers_and_keeps_its_outputs() -> None:
    from tango.common.util import import_module_and_submodules
    from transformers import GPT2Config, GPT2LMHeadModel

    import_module_and_submodules(INTEGRATION)
    from tango.integrations.transformers.ia3 import GPT_2_IA3_CONFIG, Conv1DWithIA3, modify_with_ia3

    torch.manual_seed(3)
    model = GPT2LMHeadModel(GPT2Config(**GPT2)).eval()
    tokens = torch.arange(GPT2["n_positions"]).remainder(GPT2["vocab_size"]).unsqueeze(0)
    with torch.no_grad():
        before = model(input_ids=tokens).logits
    adapted = modify_with_ia3(model, config=GPT_2_IA3_CONFIG)
    # The isinstance checks found GPT-2's Conv1D layers: the fused attention and MLP inputs adapted.
    assert all(isinstance(block.attn.c_attn, Conv1DWithIA3) for block in adapted.transformer.h)
    assert all(isinstance(block.mlp.c_fc, Conv1DWithIA3) for block in adapted.transformer.h)
    trainable = sorted(name for name, p in adapted.named_parameters() if p.requires_grad)
    assert trainable and all(name.endswith(".ia3") for name in trainable)
    with torch.no_grad():
        after = adapted(input_ids=tokens).logits
    assert torch.equal(after, before)  # IA3 scales start at one


def test_the_integrations_registered_constructors_build(pretrained: Path) -> None:  # noqa: F811
    from tango.common.util import import_module_and_submodules
    from tango.integrations.torch import DataCollator, LRScheduler, Optimizer
    from transformers import GPT2LMHeadModel, PretrainedConfig

    import_module_and_submodules(INTEGRATION)
    from tango.integrations.transformers import Config, Tokenizer

    model = build(tango_model(pretrained))
    assert isinstance(model, GPT2LMHeadModel)
    for name, tensor in saved_tensors(pretrained).items():
        assert torch.equal(model.state_dict()[name], tensor), name
    from_config = build(
        {
            "type": "transformers::AutoModelForCausalLM::from_config",
            "config": {"pretrained_model_name_or_path": str(pretrained)},
        }
    )
    assert isinstance(from_config, GPT2LMHeadModel)
    assert isinstance(
        Config.from_params(Params({"pretrained_model_name_or_path": str(pretrained)})), PretrainedConfig
    )
    tokenizer = Tokenizer.from_params(Params({"pretrained_model_name_or_path": str(pretrained)}))
    assert tokenizer("w3 w5")["input_ids"] == [3, 5]
    optimizer = Optimizer.from_params(Params({"type": "transformers::Adafactor"}), params=model.parameters())
    scheduler = LRScheduler.from_params(
        Params({"type": "transformers::linear", "num_warmup_steps": 2, "num_training_steps": 10}),
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
    )
    assert scheduler.get_last_lr() == [0.0] and type(optimizer).__name__ == "Adafactor"
    collator = DataCollator.from_params(
        Params(
            {
                "type": "transformers::DataCollatorForLanguageModeling",
                "mlm": False,
                "tokenizer": {"pretrained_model_name_or_path": str(pretrained)},
            }
        )
    )
    assert type(collator).__name__ == "DataCollatorForLanguageModeling"
    # transformers 4.57 has no AdamW of its own any more: the integration cannot register it.
    assert "transformers::AdamW" not in Optimizer.list_available()


def test_unchecked_or_changed_transformers_is_refused_before_patching(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import modeling_utils, pytorch_utils

    monkeypatch.delenv(compat.SKIP_VERSION_CHECK_VARIABLE, raising=False)
    monkeypatch.delattr(modeling_utils, "Conv1D", raising=False)
    monkeypatch.setitem(compat.CHECKED_WHEN_USED, "transformers", ("4.99.",))
    with pytest.raises(compat.IncompatibleVersionError, match=r"supports transformers 4\.99\.x, but"):
        compat._alias_conv1d()
    assert not hasattr(modeling_utils, "Conv1D")
    monkeypatch.setitem(compat.CHECKED_WHEN_USED, "transformers", ("4.57.",))
    conv1d = pytorch_utils.Conv1D
    monkeypatch.delattr(pytorch_utils, "Conv1D")
    with pytest.raises(compat.IncompatibleVersionError, match=r"patch H1 .*transformers\.pytorch_utils"):
        compat._alias_conv1d()
    monkeypatch.setattr(pytorch_utils, "Conv1D", conv1d, raising=False)
    compat._alias_conv1d()
    assert modeling_utils.Conv1D is conv1d


# --- H2: from_pretrained under init_on_meta ---------------------------------------------------------


def test_from_pretrained_on_meta_reads_each_saved_tensor(pretrained: Path) -> None:  # noqa: F811
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = build(tango_model(pretrained, **NO_DROPOUT))
    # Nothing read yet: every parameter on meta, tied ones still one parameter.
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.config.resid_pdrop == 0.0 and not model.training  # as from_pretrained returns it
    materialize_module(model, torch.device("cpu"))
    weights = model.state_dict()
    for name, tensor in saved_tensors(pretrained).items():
        assert torch.equal(weights[name], tensor), name
    reference = AutoModelForCausalLM.from_pretrained(pretrained)  # not on meta: transformers' own
    assert not any(p.is_meta for p in reference.parameters())
    assert weights.keys() == reference.state_dict().keys()
    assert model.generation_config.to_dict() == reference.generation_config.to_dict()


def test_from_pretrained_on_meta_reads_persistent_buffers(tmp_path: Path) -> None:
    from transformers import AutoModelForImageClassification, ResNetConfig, ResNetForImageClassification

    torch.manual_seed(5)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    model = ResNetForImageClassification(config).train()
    model(pixel_values=torch.randn(4, 3, 16, 16))  # batch norm statistics away from their initial values
    model.save_pretrained(tmp_path / "resnet")
    saved = saved_tensors(tmp_path / "resnet")
    statistics = [name for name in saved if name.endswith("running_mean")]
    assert statistics and all(saved[name].abs().sum() > 0 for name in statistics)
    with parameters_on_meta():
        loaded = AutoModelForImageClassification.from_pretrained(tmp_path / "resnet")
    materialize_module(loaded, torch.device("cpu"))
    state = loaded.state_dict()
    assert state.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


def test_from_pretrained_on_meta_refuses_what_it_cannot_load(pretrained: Path, tmp_path: Path) -> None:  # noqa: F811
    from transformers import AutoModelForCausalLM

    from tango_fairscale.preflight import check_model

    # An argument that changes how transformers loads: refused in pre-flight, naming it and the fix.
    model = Lazy(Model, Params(tango_model(pretrained, dtype="bfloat16")))
    with pytest.raises(
        ConfigurationError, match=r"dtype='bfloat16' cannot be applied .*training_engine\.init_on_meta: false"
    ):
        check_model(model, None, init_on_meta=True)
    # Weights saved as pytorch_model.bin: nothing to read unit by unit.
    AutoModelForCausalLM.from_pretrained(pretrained).save_pretrained(
        tmp_path / "bin", safe_serialization=False
    )
    with parameters_on_meta(), pytest.raises(ConfigurationError, match="has neither model.safetensors"):
        build(tango_model(tmp_path / "bin"))


def test_preflight_checks_the_wrapping_of_a_pretrained_model_under_init_on_meta(
    pretrained: Path,  # noqa: F811
) -> None:
    from tango_fairscale.preflight import check_model

    wrapped = {
        "type": "fairscale::with_wrapped_modules",
        "model": tango_model(pretrained),
        "modules_to_wrap": ["transformer\\.blocks\\.[0-9]+"],  # GPT-2's are transformer.h.N
        "fsdp_config": {},
    }
    # Built as the workers build it (transformers' own from_pretrained refuses the meta device
    # pre-flight builds on, which skipped these checks): the mistake is found before they start.
    with pytest.raises(ConfigurationError, match=r"matches no submodule"):
        check_model(Lazy(Model, Params(wrapped)), None, init_on_meta=True)


def test_routing_checks_the_transformers_version(
    pretrained: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(compat.SKIP_VERSION_CHECK_VARIABLE, raising=False)
    monkeypatch.setitem(compat.CHECKED_WHEN_USED, "transformers", ("4.99.",))
    with parameters_on_meta(), pytest.raises(compat.IncompatibleVersionError, match="transformers 4.99.x"):
        build(tango_model(pretrained))
    # Outside a build on meta, transformers' own from_pretrained runs, whatever its version.
    assert not any(p.is_meta for p in build(tango_model(pretrained)).parameters())


# --- Training from Tango's constructor, each backend, with and without init_on_meta ---------------------


def experiment(directory: Path, backend: str, init_on_meta: bool) -> Dict[str, Any]:
    """One step at learning rate 0 of Tango's constructor wrapped one unit per block: the loaded weights."""
    wrapped = {
        "type": "fairscale::with_wrapped_modules",
        "model": tango_model(directory, **NO_DROPOUT),
        "modules_to_wrap": ["transformer\\.h\\.[0-9]+"],
        "fsdp_config": {},
    }
    config = train_config(
        engine="fairscale",
        model=wrapped,
        train_steps=1,
        checkpoint_every=1,
        callbacks=[],
        engine_extra={"backend": backend, "init_on_meta": init_on_meta},
    )
    config["steps"]["train"]["training_engine"]["optimizer"] = {
        "type": "torch::AdamW",
        "lr": 0.0,
        "weight_decay": 0.0,
    }
    config["steps"]["data"] = {
        "type": "test::lm_data",
        "vocab_size": GPT2["vocab_size"],
        "length": GPT2["n_positions"],
    }
    return config


VARIANTS = [(backend, on_meta) for backend in BACKENDS for on_meta in (True, False)]


@pytest.fixture(scope="module")
def loaded(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> Dict[Any, Dict[str, torch.Tensor]]:  # noqa: F811
    """weights.pt of every variant, trained in one start of the workers."""
    root = tmp_path_factory.mktemp("hf_integration")
    jobs = [
        harness.Train(experiment(pretrained, backend, on_meta), root / f"{backend}-{on_meta}")
        for backend, on_meta in VARIANTS
    ]
    results = {}
    for variant, job, result in zip(VARIANTS, jobs, harness.run(jobs, out=root / "harness")):
        result.check()
        results[variant] = torch.load(job.work_dir / "weights.pt", weights_only=True)
    return results


@pytest.mark.parametrize("backend, init_on_meta", VARIANTS)
def test_tangos_from_pretrained_starts_from_the_pretrained_weights_exactly(
    backend: str,
    init_on_meta: bool,
    pretrained: Path,  # noqa: F811
    loaded: Dict[Any, Dict[str, torch.Tensor]],
) -> None:
    weights = loaded[(backend, init_on_meta)]
    saved = saved_tensors(pretrained)
    for name, tensor in saved.items():
        assert torch.equal(weights[name], tensor), name
    assert torch.equal(weights["lm_head.weight"], saved["transformer.wte.weight"])  # tied


# make test imports the integration as include_package does in a fresh process
# (test_the_integration_imports_every_submodule_with_the_package_only) and trains Tango's
# from_pretrained in the test's own workers: this run adds the CLI's workers around them.
@pytest.mark.extended
def test_tango_run_with_the_integration_included(pretrained: Path, tmp_path: Path) -> None:  # noqa: F811
    # The user's includes, the package first: `-i tango_fairscale -i tango.integrations.transformers`
    # (the test's data step comes from the config's include_package). Main process and workers
    # import the whole integration; the model loads on meta, unit by unit.
    config = experiment(pretrained, "fairscale", init_on_meta=True)
    config["include_package"] = ["tests.components"]
    run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd", includes=["tango_fairscale", INTEGRATION])
    weights = load_weights(tmp_path / "ws")
    for name, tensor in saved_tensors(pretrained).items():
        assert torch.equal(weights[name], tensor), name
