"""
A pretrained Hugging Face model as the step's model (``"fairscale::from_pretrained"``): with
either backend and ``init_on_meta`` each unit is read from the saved safetensors files as it is
sharded; the trained weights start from the pretrained ones exactly, fine-tune as Tango's DDP
engine fine-tunes ``from_pretrained``'s model, and a fine-tuning run with dropout killed after a
checkpoint and rerun ends as the uninterrupted run. In the test's own workers (:mod:`tests.harness`).
"""

import gc
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
from tango.common import Lazy, Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import Model

from tango_fairscale.finetune.pretrained import check_pretrained, from_pretrained
from tango_fairscale.materialize import parameters_on_meta
from tests import harness
from tests.helpers import (
    free_port,
    max_abs_difference,
    one_line_error,
    run_tango,
    tango_env,
    train_config,
    word_tokenizer,
)

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
    tokenizer().save_pretrained(directory)
    return directory


def tokenizer() -> Any:
    """A word-level tokenizer of the model's vocabulary (nothing to download)."""
    return word_tokenizer(GPT2["vocab_size"])


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
            engine_extra={"backend": backend, "init_on_meta": True, "export_hf": "hf"},
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
    WORK_DIRS.update({key: job.work_dir for key, job in zip(keys, jobs)})
    return results


#: The runs' work directories, by key (filled by the ``runs`` fixture).
WORK_DIRS: Dict[str, Path] = {}


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


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{key}:"))


def test_pretrained_files_are_read_through_a_mapping_that_is_not_private_memory(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from tango_fairscale.finetune.pretrained import SafetensorsFiles

    # 64 MiB of float32 and a bfloat16 tensor behind it, as save_pretrained lays them out.
    tensors = {"big": torch.randn(4096, 4096), "small": torch.randn(3, 5).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    files = SafetensorsFiles(tmp_path)
    assert sorted(files.names()) == ["big", "small"]
    before = _status_kib("VmData")
    read = {name: files.read(name) for name in files.names()}
    grown = _status_kib("VmData") - before
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    # Private writable mappings count in VmData, and against RLIMIT_DATA and cgroups, in full: a
    # file mapped that way would count the whole pretrained model in every worker while it loads.
    # Mapped read-only and shared, its pages are the page cache's.
    print(f"VmData grew by {grown} KiB reading a 64 MiB file")
    assert grown < 8 * 1024
    # This file's mappings only: another test in the same process may have mapped a file of that name.
    maps = _mappings_under(tmp_path)
    assert maps and all(line.split()[1] == "r--s" for line in maps), maps
    del read
    assert _mappings_under(tmp_path) == [], "a tensor read and dropped left its file mapped"


def _mappings_under(directory: Path) -> List[str]:
    """This process's memory mappings of files under ``directory`` (lines of ``/proc/self/maps``)."""
    root = str(directory.resolve()) + "/"
    return [
        line for line in Path("/proc/self/maps").read_text().splitlines() if line.split()[-1].startswith(root)
    ]


@pytest.mark.parametrize("one_allocation", [True, False])
def test_reading_a_pretrained_directory_leaves_none_of_its_files_mapped_once_done(
    pretrained: Path, tmp_path: Path, one_allocation: bool
) -> None:
    """
    Pre-flight's check, a build on meta and its materialisation read the files; once the values
    are copied out (or the model dropped) nothing of the directory stays mapped, by reference
    count alone: the cyclic garbage collector is off, as it may not run for a long while in a
    worker or in a ``plan``.
    """
    from tango_fairscale.materialize import materialize_module

    directory = tmp_path / "gpt2"
    shutil.copytree(pretrained, directory)
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        check_pretrained(str(directory), init_on_meta=False)
        check_pretrained(str(directory), init_on_meta=True)
        assert _mappings_under(directory) == [], "pre-flight's check"
        with parameters_on_meta():
            model = from_pretrained(str(directory), config_overrides=NO_DROPOUT)
        materialize_module(model, torch.device("cpu"), root=model, one_allocation=one_allocation)
        if one_allocation:
            # The unit's parameters are views of the files until it is sharded: copied out here.
            for param in model.parameters():
                param.data = param.data.clone()
        assert _mappings_under(directory) == [], "the materialised model, its values copied out"
        saved = load_file(str(pretrained / "model.safetensors"))  # the original's: safetensors maps it
        assert all(torch.equal(param, saved[name]) for name, param in model.named_parameters())
        del model
        assert _mappings_under(directory) == [], "the model dropped"
    finally:
        if gc_was_enabled:
            gc.enable()


def _in_mapping_of(tensor: torch.Tensor, file_name: str) -> bool:
    """Whether ``tensor``'s memory lies in this process's mapping of a file named ``file_name``."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        if fields[-1].endswith(file_name) and start <= address < end:
            return True
    return False


def test_a_unit_sharded_right_after_takes_the_mapped_pretrained_tensors_as_they_are(pretrained: Path) -> None:
    from tango_fairscale.materialize import materialize_module

    saved = load_file(str(pretrained / "model.safetensors"))
    for one_allocation in (True, False):
        with parameters_on_meta():
            model = from_pretrained(str(pretrained), config_overrides=NO_DROPOUT)
        materialize_module(model, torch.device("cpu"), root=model, one_allocation=one_allocation)
        for name, param in model.named_parameters():
            assert torch.equal(param, saved[name]), name
            # Sharding copies every parameter out of the unit: no private copy of it before that.
            assert _in_mapping_of(param, "model.safetensors") == one_allocation, name
        assert model.lm_head.weight is model.transformer.wte.weight


def test_a_damaged_safetensors_file_is_refused_naming_it(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from tango_fairscale.finetune.pretrained import SafetensorsFiles

    save_file({"weight": torch.ones(16)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])  # the last two floats cut off
    with pytest.raises(ConfigurationError, match=r"model\.safetensors.*weight.*past the end of the file"):
        SafetensorsFiles(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ConfigurationError, match=r"model\.safetensors is not a safetensors file"):
        SafetensorsFiles(tmp_path)


# --- Its inputs, refused before any worker starts (pre-flight's check_pretrained) ---------------------


def copy_of(pretrained: Path, to: Path, **config_changes: Any) -> Path:
    """A copy of the saved model, its config.json changed."""
    shutil.copytree(pretrained, to)
    if config_changes:
        config = json.loads((to / "config.json").read_text())
        (to / "config.json").write_text(json.dumps({**config, **config_changes}))
    return to


def sharded_copy(pretrained: Path, to: Path) -> Path:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(pretrained).save_pretrained(to, max_shard_size="40KB")
    return to


def _nowhere(pretrained: Path, tmp: Path) -> Tuple[Dict[str, Any], str]:
    return (
        {"pretrained_model_name_or_path": str(tmp / "nowhere")},
        f"fairscale::from_pretrained: pretrained_model_name_or_path '{tmp / 'nowhere'}': no such directory. "
        "Give the directory save_pretrained wrote",
    )


def _a_file(pretrained: Path, tmp: Path) -> Tuple[Dict[str, Any], str]:
    return (
        {"pretrained_model_name_or_path": str(pretrained / "config.json")},
        f"pretrained_model_name_or_path '{pretrained / 'config.json'}' is a file, not a directory",
    )


def _missing_shard(pretrained: Path, tmp: Path) -> Tuple[Dict[str, Any], str]:
    directory = sharded_copy(pretrained, tmp / "sharded")
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    return (
        {"pretrained_model_name_or_path": str(directory)},
        f"{directory / 'model.safetensors.index.json'} names shard(s) that are not in {directory}: "
        f"{shards[1].name}. Copy every shard the index lists into the directory",
    )


def _no_config(pretrained: Path, tmp: Path) -> Tuple[Dict[str, Any], str]:
    directory = copy_of(pretrained, tmp / "no_config")
    (directory / "config.json").unlink()
    return (
        {"pretrained_model_name_or_path": str(directory)},
        f"fairscale::from_pretrained: {directory} has no config.json, so which model its weights are of is "
        "unknown",
    )


def _auto_class(pretrained: Path, tmp: Path) -> Tuple[Dict[str, Any], str]:
    return (
        {"pretrained_model_name_or_path": str(pretrained), "auto_class": "AutoModelForSeq2SeqLM"},
        f"auto_class 'AutoModelForSeq2SeqLM' does not build the model of {pretrained / 'config.json'} "
        "(GPT2Config, model_type 'gpt2'): use one of 'AutoModel', 'AutoModelForCausalLM',",
    )


def _other_shapes(pretrained: Path, tmp: Path) -> Tuple[Dict[str, Any], str]:
    directory = copy_of(pretrained, tmp / "wider", n_embd=64)
    return (
        {"pretrained_model_name_or_path": str(directory)},
        f"fairscale::from_pretrained: the model {directory / 'config.json'} describes does not fit the "
        f"weights beside it: transformer.h.0.attn.c_attn.bias is [96] in {directory / 'model.safetensors'}, "
        "[192] in the model;",
    )


def _damaged(pretrained: Path, tmp: Path) -> Tuple[Dict[str, Any], str]:
    directory = copy_of(pretrained, tmp / "damaged")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # cut short, as by a full disk or a broken copy
    return (
        {"pretrained_model_name_or_path": str(directory)},
        f"fairscale::from_pretrained: {weights}: ",
    )


def _misspelt_override(pretrained: Path, tmp: Path) -> Tuple[Dict[str, Any], str]:
    return (
        {"pretrained_model_name_or_path": str(pretrained), "config_overrides": {"resid_pdropp": 0.0}},
        f"config_overrides.resid_pdropp is not a field of GPT2Config ({pretrained / 'config.json'}), so it "
        "would change nothing: did you mean 'resid_pdrop'?",
    )


def _override_of_another_type(pretrained: Path, tmp: Path) -> Tuple[Dict[str, Any], str]:
    return (
        {"pretrained_model_name_or_path": str(pretrained), "config_overrides": {"n_embd": "big"}},
        "config_overrides.n_embd: 'big' is of type str, where GPT2Config's n_embd is of type int (",
    )


#: A bad input of fairscale::from_pretrained, and the start of its one line (after any prefix).
BAD_INPUTS = {
    "a directory that does not exist": _nowhere,
    "a file": _a_file,
    "a shard missing": _missing_shard,
    "no config.json": _no_config,
    "an auto_class that does not fit": _auto_class,
    "a config.json of other shapes": _other_shapes,
    "a damaged safetensors file": _damaged,
    "a misspelt config_overrides field": _misspelt_override,
    "a config_overrides value of another type": _override_of_another_type,
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_are_refused_in_preflight_in_one_line(case: str, pretrained: Path, tmp_path: Path) -> None:
    """
    Each was found only inside every worker, as a 75-412-line traceback (a missing path as an
    HFValidationError about repo ids; a damaged file without init_on_meta not named), or not at all
    (a misspelt override did nothing).
    """
    from tango_fairscale.preflight import check_pretrained_models

    options, message = BAD_INPUTS[case](pretrained, tmp_path)
    model = Lazy(Model, Params({"type": "fairscale::from_pretrained", **options}))
    with pytest.raises(ConfigurationError) as raised:
        check_pretrained_models(model, init_on_meta=False)
    text = str(raised.value)
    assert "\n" not in text and message in text, text
    print(f"{case}: {text}")


def test_good_inputs_pass_preflight(pretrained: Path, tmp_path: Path) -> None:
    sharded = sharded_copy(pretrained, tmp_path / "sharded")
    for directory, init_on_meta in (
        (pretrained, False),
        (pretrained, True),
        (sharded, False),
        (sharded, True),
    ):
        check_pretrained(str(directory), init_on_meta=init_on_meta)
    # A field by its alias, and transformers' own argument for the attention.
    check_pretrained(
        str(pretrained), config_overrides={"num_hidden_layers": 3, "attn_implementation": "eager"}
    )
    check_pretrained(str(pretrained), auto_class="GPT2LMHeadModel")


def test_the_workers_loading_under_init_on_meta_applies_the_same_rules(
    pretrained: Path, tmp_path: Path
) -> None:
    """Under init_on_meta the loading itself (pre-flight's build on meta, each worker's) refuses them."""
    for make in (_missing_shard, _other_shapes, _misspelt_override):
        options, message = make(pretrained, tmp_path)
        with parameters_on_meta(), pytest.raises(ConfigurationError) as raised:
            from_pretrained(**options)
        assert message in str(raised.value), str(raised.value)


def test_fewer_layers_in_config_json_under_init_on_meta_is_refused(pretrained: Path, tmp_path: Path) -> None:
    """
    The model built from a config.json of 2 layers took the 3-layer weights' first 2 layers and
    trained without the third's, without a word (loading without init_on_meta, transformers warns).
    """
    from tests.test_validation import run_preflight

    directory = copy_of(pretrained, tmp_path / "two_layers", n_layer=2)
    expected = (
        "fairscale::from_pretrained: transformer.h.2.attn.c_attn.bias, transformer.h.2.attn.c_attn.weight, "
        "transformer.h.2.attn.c_proj.bias, transformer.h.2.attn.c_proj.weight, transformer.h.2.ln_1.bias and "
        f"7 more in {directory / 'model.safetensors'} have no place in the GPT2LMHeadModel that "
        f"{directory / 'config.json'} describes (fewer layers than the weights?), and under init_on_meta "
        "they would be dropped without a word."
    )
    with parameters_on_meta(), pytest.raises(ConfigurationError) as raised:
        from_pretrained(str(directory))
    assert str(raised.value).startswith(expected), str(raised.value)
    # Before any worker starts: pre-flight builds the model on meta as the workers do.
    config = experiment(directory, "fairscale", lr=0.01)
    with pytest.raises(ConfigurationError) as raised:
        run_preflight(config)
    assert str(raised.value).startswith(f"ConfigurationError: {expected}"), str(raised.value)
    # Without init_on_meta it is transformers' to warn about: pre-flight lets it through.
    check_pretrained(str(directory), init_on_meta=False)


def test_a_hub_name_is_read_from_the_cache_or_refused_at_once_offline(
    pretrained: Path, tmp_path: Path
) -> None:
    """
    With HF_HUB_OFFLINE set, a hub name the Hugging Face cache lacks is refused at once, and one it
    holds passes and loads from it (in a process of its own: huggingface_hub and transformers read
    the variables when imported).
    """
    # The cache's layout: a snapshot per commit, and the commit of the branch.
    repo = tmp_path / "hub" / "models--nobody--cached"
    shutil.copytree(pretrained, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    script = """
import time
import huggingface_hub, transformers.utils  # imported first: the check's own time is measured
from tango.common.exceptions import ConfigurationError
from tango_fairscale.finetune.pretrained import check_pretrained, from_pretrained
start = time.monotonic()
try:
    check_pretrained("nobody/not-cached")
except ConfigurationError as error:
    print("refused", round(time.monotonic() - start, 1), error)
check_pretrained("nobody/cached")
print("loaded", from_pretrained("nobody/cached").lm_head.weight.sum().item())
"""
    environment = {**tango_env(), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    refused, loaded = result.stdout.strip().splitlines()[-2:]
    assert refused.startswith("refused "), result.stdout
    seconds, message = refused.split(" ", 2)[1:]
    assert float(seconds) < 5
    assert message == (
        "fairscale::from_pretrained: pretrained_model_name_or_path 'nobody/not-cached' is not a local "
        "directory, and HF_HUB_OFFLINE is set while the Hugging Face cache does not hold it. Give a local "
        "directory save_pretrained wrote, or download the model into the Hugging Face cache "
        f"({tmp_path / 'hub'}) first (huggingface-cli download nobody/not-cached)."
    )
    saved = load_file(str(pretrained / "model.safetensors"))["transformer.wte.weight"]
    assert loaded == f"loaded {saved.sum().item()}"


# The one end-to-end proof: the one line of a real `tango run`, at once (it was 207-412 lines, after
# 104 s of retries). The hub is a closed local port, so that the test does not depend on the network.
# Extended: make test refuses the name at once in a fresh process
# (test_a_hub_name_is_read_from_the_cache_or_refused_at_once_offline).
@pytest.mark.extended
def test_a_hub_name_without_a_hub_is_one_line_at_once_through_tango_run(
    pretrained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    config = experiment(pretrained, "fairscale", lr=0.01)
    config["steps"]["train"]["model"]["model"]["pretrained_model_name_or_path"] = "nobody/no-such-model"
    start = time.monotonic()
    result = run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd", check=False, timeout=300)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    error = one_line_error(output)
    assert error.startswith(
        "ConfigurationError: fairscale::from_pretrained: pretrained_model_name_or_path "
        "'nobody/no-such-model' is not a local directory, and the Hugging Face hub (http://127.0.0.1:"
    ), error
    assert "cannot be reached (ConnectionError)" in error and "set HF_HUB_OFFLINE=1" in error, error
    assert "[rank " not in output and "Retrying" not in output, output[-3000:]
    print(f"tango run ended after {elapsed:.1f}s: {error}")


# --- Through a kill: SIGKILL after a checkpoint, then the same run again ------------------------------

#: GPT2Config's own dropout, spelled out: with it on, every training step draws from each worker's
#: generator, so a rerun matches only if the checkpoint restored the random state too.
DROPOUT = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
#: Checkpoint after this step; the killed run dies right after writing it, before the next step.
KILL_AFTER = 2


def dropout_experiment(directory: Path, backend: str, killed: bool) -> Dict[str, Any]:
    """:func:`experiment`'s fine-tuning with dropout on, checkpointed every 2 steps; killed once or not."""
    config = experiment(directory, backend, lr=0.01)
    train = config["steps"]["train"]
    train["model"]["model"]["config_overrides"] = DROPOUT
    train["checkpoint_every"] = KILL_AFTER
    if killed:
        # Every worker SIGKILLed before step index 2, right after checkpoint_state_step2 is complete.
        train["callbacks"] = [{"type": "test::kill_once", "step": KILL_AFTER}]
    return config


def test_dropout_is_on_in_the_fine_tuned_model(pretrained: Path) -> None:
    # What makes the kill test below depend on the random state: two training-mode passes differ.
    model = from_pretrained(str(pretrained), config_overrides=DROPOUT).train()
    tokens = torch.arange(GPT2["n_positions"]).unsqueeze(0)
    assert not torch.equal(model(input_ids=tokens).logits, model(input_ids=tokens).logits)


# Extended: make test kills and reruns a run after a checkpoint through the CLI with either backend
# (test_checkpoints.py) and a model with dropout in the test's own workers (test_integrity.py); this
# adds a pretrained model loaded under init_on_meta, whose resume restores the same checkpoint.
@pytest.mark.extended
def test_killed_after_a_checkpoint_and_rerun_ends_as_the_uninterrupted_run(
    pretrained: Path, runs: Dict[str, Dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    plain = {
        b: harness.Train(dropout_experiment(pretrained, b, False), tmp_path / f"{b}-plain") for b in BACKENDS
    }
    killed = {
        b: harness.Train(dropout_experiment(pretrained, b, True), tmp_path / f"{b}-killed") for b in BACKENDS
    }
    reruns = harness.killed_and_rerun(plain, killed, tmp_path)
    for backend, rerun in reruns.items():
        work_dir = killed[backend].work_dir
        assert "Recovering from previous run at " + str(work_dir / "checkpoint_state_step2") in rerun.logs
        uninterrupted = torch.load(plain[backend].work_dir / "weights.pt", weights_only=True)
        resumed = torch.load(work_dir / "weights.pt", weights_only=True)
        # Dropout changed the training: the same fine-tuning without it ends elsewhere.
        assert max_abs_difference(uninterrupted, runs[f"{backend}-finetuned"]) > 1e-4
        difference = max_abs_difference(resumed, uninterrupted)
        print(f"[{backend}] dropout on, max |killed and rerun - uninterrupted|: {difference:.3e}")
        # Exactly: the rerun computes the same steps in the same order from the checkpoint's
        # parameters, optimizer state and random generators; any lost state shows as a difference.
        assert difference == 0.0
        # And the exported directory is the uninterrupted run's, byte for byte.
        hf = "hf/model.safetensors"
        assert (work_dir / hf).read_bytes() == (plain[backend].work_dir / hf).read_bytes()


# --- Out: the trained weights as a directory from_pretrained loads -----------------------------------


def logits(model: Any) -> torch.Tensor:
    tokens = torch.arange(GPT2["n_positions"]).remainder(GPT2["vocab_size"]).unsqueeze(0)
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unchanged_export_is_the_pretrained_directory_bit_for_bit(
    backend: str, pretrained: Path, runs: Dict[str, Dict[str, torch.Tensor]]
) -> None:
    exported = WORK_DIRS[f"{backend}-unchanged"] / "hf"
    assert (exported / "model.safetensors").read_bytes() == (pretrained / "model.safetensors").read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (exported / name).read_bytes() == (pretrained / name).read_bytes(), name
    assert not list(exported.parent.glob(".hf.*"))  # no temporary left


@pytest.mark.parametrize("backend", BACKENDS)
def test_fine_tuned_export_loads_with_from_pretrained(
    backend: str, runs: Dict[str, Dict[str, torch.Tensor]]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    exported = WORK_DIRS[f"{backend}-finetuned"] / "hf"
    loaded = AutoModelForCausalLM.from_pretrained(exported)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied
    trained = GPT2LMHeadModel(GPT2Config(**GPT2, **NO_DROPOUT))
    trained.load_state_dict(runs[f"{backend}-finetuned"])
    difference = (logits(loaded) - logits(trained)).abs().max().item()
    print(f"[{backend}] max |logits(from_pretrained(export)) - logits(weights.pt)|: {difference:.3e}")
    assert difference <= 1e-6
    assert AutoTokenizer.from_pretrained(exported)("w3 w5")["input_ids"] == [3, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_consolidate_format_hf_writes_the_engines_export(
    backend: str, pretrained: Path, runs: Dict[str, Dict[str, torch.Tensor]], tmp_path: Path, capsys: Any
) -> None:
    from tango_fairscale import cli

    work_dir = WORK_DIRS[f"{backend}-finetuned"]
    out = tmp_path / "consolidated"
    assert (
        cli.main(["consolidate", str(work_dir), str(out), "--format", "hf", "--hf-config", str(pretrained)])
        == 0
    )
    # The same weights and tokenizer; the config is --hf-config's (the run's had its dropout overridden).
    for name in ("model.safetensors", "tokenizer.json"):
        assert (out / name).read_bytes() == (work_dir / "hf" / name).read_bytes(), name
    assert (out / "config.json").read_text() == (pretrained / "config.json").read_text()
    # Refused: an existing output without --force, and --format hf without a config.
    assert (
        cli.main(["consolidate", str(work_dir), str(out), "--format", "hf", "--hf-config", str(pretrained)])
        == 2
    )
    assert "already exists: pass --force" in capsys.readouterr().err
    assert cli.main(["consolidate", str(work_dir), str(tmp_path / "other"), "--format", "hf"]) == 2
    assert "--format hf needs --hf-config DIR" in capsys.readouterr().err
    # A --hf-config that is not there, or is not a model's directory, is named.
    for bad, said in (
        (tmp_path / "nope", "does not exist"),
        (work_dir, "holds no config.json"),
        (pretrained / "config.json", "is a file"),
    ):
        argv = [
            "consolidate",
            str(work_dir),
            str(tmp_path / "other"),
            "--format",
            "hf",
            "--hf-config",
            str(bad),
        ]
        assert cli.main(argv) == 2
        assert f"--hf-config {bad} {said}: give the directory" in capsys.readouterr().err


def test_docs_consolidate_format_hf_command_as_written(
    pretrained: Path, runs: Dict[str, Dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    import shlex

    from tango_fairscale import cli
    from tests.helpers import readme_command_lines

    (line,) = readme_command_lines(
        "bash", "--format hf --hf-config /models/my-gpt2", doc="docs/pretrained.md"
    )
    filled = line.replace("WORK_DIR", str(WORK_DIRS["fairscale-finetuned"])).replace(
        "/models/my-gpt2", str(pretrained)
    )
    command = shlex.split(filled)
    assert command[:4] == ["python", "-m", "tango_fairscale", "consolidate"], command
    out = tmp_path / command[5]
    assert cli.main([*command[3:5], str(out), *command[6:]]) == 0
    exported = WORK_DIRS["fairscale-finetuned"] / "hf" / "model.safetensors"
    assert (out / "model.safetensors").read_bytes() == exported.read_bytes()


def test_export_in_shards_with_an_index_loads_the_same(pretrained: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tango_fairscale.finetune.hf_export import export_hf, weights_file

    original = AutoModelForCausalLM.from_pretrained(pretrained)
    torch.save(original.state_dict(), tmp_path / "weights.pt")
    config = AutoConfig.from_pretrained(pretrained)
    export_hf(weights_file(tmp_path / "weights.pt"), tmp_path / "sharded", config, max_shard_bytes=40_000)
    index = (tmp_path / "sharded" / "model.safetensors.index.json").read_text()
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and all(name in index for name in shards)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")), logits(original))


def test_a_crash_while_exporting_leaves_the_previous_directory(pretrained: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    from tango_fairscale.finetune.hf_export import export_hf, weights_file

    config = AutoConfig.from_pretrained(pretrained)
    original = load_file(str(pretrained / "model.safetensors"))
    torch.save(original, tmp_path / "weights.pt")
    target = export_hf(weights_file(tmp_path / "weights.pt"), tmp_path / "out", config)
    before = (target / "model.safetensors").read_bytes()
    shapes, read = weights_file(tmp_path / "weights.pt")
    calls = []

    def failing(name: str) -> torch.Tensor:
        calls.append(name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return read(name)

    with pytest.raises(OSError, match="No space left"):
        export_hf((shapes, failing), target, config)
    assert (target / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "weights.pt"]  # no half directory
