"""
The command line (``tango_fairscale.cli``): ``plan`` reads configs the way ``tango run`` does
(``-o`` overrides, ``tango.yml`` packages and environment), and every bad argument of ``plan``
and ``consolidate`` ends in one ``error:`` line with exit status 2.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from examples.toy.components import ToyRegressor
from tango_fairscale import checkpointing
from tango_fairscale.cli import default_prog, main
from tests import harness
from tests.conftest import TinyPretrained
from tests.helpers import REPO, tango_env, train_config

TOY = "examples.toy.components"


@pytest.fixture(autouse=True)
def restore_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tango's import_extra_module puts the current directory first on sys.path; keep that
    # from leaking out of each in-process call.
    monkeypatch.setattr(sys, "path", list(sys.path))


def fails(capsys: pytest.CaptureFixture, argv: List[str]) -> str:
    """Run ``main(argv)``, expect exit status 2 and one ``error:`` line on stderr; return that line."""
    try:
        status = main(argv)
    except SystemExit as stop:  # argparse's own usage errors exit instead of returning
        status = stop.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert status == 2, captured.out + captured.err
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def write_config(path: Path, config: Dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def plan_json(capsys: pytest.CaptureFixture, tmp_path: Path, argv: List[str]) -> Dict[str, Any]:
    out = tmp_path / "plan.json"
    assert main(["plan", *argv, "--json", str(out)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return json.loads(out.read_text())


# --- plan: reading configs like `tango run` ------------------------------------------------------


@pytest.mark.parametrize(
    "name, content",
    [
        ("weights.pt", b"PK\x03\x04 trained weights"),
        ("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "),
        ("COMPLETE.json", b'{"step": 4}'),
        ("metrics.jsonl", b'{"step": 1, "loss": 0.5}\n'),
        ("notes.json", b'{"mine": true}'),
    ],
)
def test_plan_json_replaces_only_its_own_file(
    capsys: pytest.CaptureFixture, tmp_path: Path, name: str, content: bytes
) -> None:
    """``plan --json`` over a file it did not write: refused before any work, the file unchanged."""
    config = str(write_config(tmp_path / "config.json", train_config()))
    target = tmp_path / "out" / name
    target.parent.mkdir()
    target.write_bytes(content)
    message = fails(capsys, ["plan", config, "-i", TOY, "--json", str(target)])
    # Named as what it is where the rule knows it (a checkpoint's marker, a metrics log).
    assert message.startswith("error: refusing to ") and f"{target} (--json)" in message, message
    assert target.read_bytes() == content
    # Its own earlier output is replaced, and what it writes is marked as its own.
    own = tmp_path / "elsewhere" / "plan.json"
    for _ in range(2):
        assert main(["plan", config, "-i", TOY, "--json", str(own)]) == 0, capsys.readouterr().err
    written = json.loads(own.read_text())
    assert written["written_by"] == "tango_fairscale" and written["output"] == "plan_json"
    assert [p.name for p in own.parent.iterdir()] == ["plan.json"]  # no temporary left


def test_overrides_change_the_world_size_and_bytes(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.json", train_config(wrap="nested"))
    default = plan_json(capsys, tmp_path, [str(config), "-i", TOY])
    overridden = plan_json(
        capsys, tmp_path, [str(config), "-i", TOY, "-o", '{"steps.train.device_count": 4}']
    )
    assert default["world_size"] == 2 and overridden["world_size"] == 4
    parameters = 321 + 4 * 1056  # the toy model of test_plan
    assert default["parameters"] == overridden["parameters"] == parameters
    # fp32 parameters, gradients and AdamW's two moments, each shard padded to whole elements.
    assert default["bytes_per_worker"]["total"] == 4 * 4 * sum(-(-u // 2) for u in [321] + [1056] * 4)
    assert overridden["bytes_per_worker"]["total"] == 4 * 4 * sum(-(-u // 4) for u in [321] + [1056] * 4)

    # A jsonnet override replacing a whole object, as `tango run -o` allows.
    model = {"type": "toy::regressor", "in_features": 8, "width": 16, "num_blocks": 2}
    replaced = plan_json(
        capsys, tmp_path, [str(config), "-i", TOY, "-o", json.dumps({"steps.train.model": model})]
    )
    assert replaced["parameters"] == (8 * 16 + 16) + 2 * (16 * 16 + 16) + (16 + 1)
    assert [unit["name"] for unit in replaced["units"]] == [""]


def test_settings_file_packages_and_environment(
    capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A jsonnet config reading its model width from the environment, as examples/train_gpt2's
    # reads `size`; tango.yml sets it and lists the package of the model.
    config = train_config(wrap="root")
    config["steps"]["train"]["model"]["width"] = "@WIDTH@"
    text = json.dumps(config).replace('"@WIDTH@"', 'std.parseInt(std.extVar("TF_PLAN_WIDTH"))')
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.jsonnet").write_text(text)
    settings = f"include_package:\n  - {TOY}\nenvironment:\n  TF_PLAN_WIDTH: '16'\n"
    (project / "tango.yml").write_text(settings)
    monkeypatch.delenv("TF_PLAN_WIDTH", raising=False)

    monkeypatch.chdir(project)  # found in the current directory, like `tango run`
    found = plan_json(capsys, tmp_path, ["config.jsonnet"])
    assert found["parameters"] == (8 * 16 + 16) + 4 * (16 * 16 + 16) + (16 + 1)
    assert "TF_PLAN_WIDTH" not in os.environ  # set for the command only

    # --ext-var wins over the settings' environment, as for `tango run`.
    wider = plan_json(capsys, tmp_path, ["config.jsonnet", "--ext-var", "TF_PLAN_WIDTH=32"])
    assert wider["parameters"] == 321 + 4 * 1056

    # --settings names the file from anywhere.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (project / "tango.yml").rename(elsewhere / "other.yml")
    monkeypatch.chdir(elsewhere)
    given = plan_json(capsys, tmp_path, [str(project / "config.jsonnet"), "--settings", "other.yml"])
    assert given["parameters"] == found["parameters"]
    # Without it, the variable is missing and jsonnet says so.
    message = fails(capsys, ["plan", str(project / "config.jsonnet")])
    assert "cannot read config" in message and "TF_PLAN_WIDTH" in message


def run_module(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tango_fairscale", *args],
        cwd=cwd,
        env=tango_env(),
        capture_output=True,
        text=True,
        check=False,
    )


# Extended: in make test, test_settings_file_packages_and_environment plans from a directory whose
# tango.yml sets the environment and includes packages, as this example's does.
@pytest.mark.extended
def test_the_gpt2_example_plans_from_its_directory() -> None:
    # Its tango.yml sets `size` in the environment, which the jsonnet reads with std.extVar,
    # and includes its `components` module by a name relative to that directory. A separate
    # process: that module registers the example's Tango components under its own name.
    example = REPO / "examples" / "train_gpt2"
    result = run_module("plan", "config.jsonnet", cwd=example)
    assert result.returncode == 0, result.stderr
    assert "external variable is not defined" not in result.stderr
    assert "GPT2LanguageModel, 834,432 parameters, world size 2" in result.stdout  # the default preset
    tiny = run_module(
        "plan", "config.jsonnet", "-D", "size=tiny", "-o", '{"steps.train.device_count": 3}', cwd=example
    )
    assert tiny.returncode == 0, tiny.stderr
    assert "world size 3" in tiny.stdout and "834,432 parameters" not in tiny.stdout


# --- plan: bad arguments -------------------------------------------------------------------------


def test_plan_config_errors(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert "config file" in (message := fails(capsys, ["plan", str(tmp_path / "missing.jsonnet")]))
    assert "missing.jsonnet does not exist" in message
    assert "is a directory, not a config file" in fails(capsys, ["plan", str(tmp_path)])

    binary = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(3)}, binary)
    assert f"cannot read config {binary}" in fails(capsys, ["plan", str(binary)])

    python_file = tmp_path / "model.py"
    python_file.write_text("def f():\n    return 1\n")
    assert f"cannot read config {python_file}: syntax error" in fails(capsys, ["plan", str(python_file)])

    not_an_experiment = write_config(tmp_path / "list.json", [1, 2])  # type: ignore[arg-type]
    assert "is not a Tango experiment config: it has no 'steps' object" in fails(
        capsys, ["plan", str(not_an_experiment)]
    )


def test_plan_step_and_package_errors(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config = str(write_config(tmp_path / "config.json", train_config()))
    message = fails(capsys, ["plan", config, "-i", TOY, "--step", "data"])
    assert "--step 'data' is a 'toy::regression_data' step, not a torch::train step" in message
    assert "the training steps of" in message and "['train']" in message
    message = fails(capsys, ["plan", config, "-i", TOY, "--step", "nope"])
    assert "--step 'nope': no such step" in message and "['data', 'train']" in message
    message = fails(capsys, ["plan", config, "-i", "no_such_package_tf"])
    assert (
        message
        == "error: cannot import package 'no_such_package_tf' (-i): No module named 'no_such_package_tf'"
    )

    two = train_config()
    two["steps"]["train2"] = two["steps"]["train"]
    two_path = str(write_config(tmp_path / "two.json", two))
    assert "has 2 torch::train steps (['train', 'train2']): choose one with --step" in fails(
        capsys, ["plan", two_path, "-i", TOY]
    )


def test_plan_option_errors(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    config = str(write_config(tmp_path / "config.json", train_config()))
    for value in ["0", "-3", "two"]:
        assert fails(capsys, ["plan", config, "-i", TOY, "--world-size", value]) == (
            f"error: argument --world-size: must be a whole number from 1 to 65536, got '{value}' "
            "(see tango-fairscale plan --help)"
        )
    assert f"output {tmp_path} (--json) is a directory" in fails(
        capsys, ["plan", config, "-i", TOY, "--json", str(tmp_path)]
    )
    message = fails(capsys, ["plan", config, "-i", TOY, "-o", '{"steps.nope.device_count": 4}'])
    assert "-o/--overrides" in message and "unused keys: ['steps.nope.device_count']" in message
    assert "-o/--overrides '{oops'" in fails(capsys, ["plan", config, "-i", TOY, "-o", "{oops"])
    assert f"--settings {tmp_path / 'none.yml'}: no such file" in fails(
        capsys, ["plan", config, "--settings", str(tmp_path / "none.yml")]
    )
    assert "--ext-var takes KEY=VALUE, got 'size'" in fails(capsys, ["plan", config, "--ext-var", "size"])
    assert "the following arguments are required: config" in fails(capsys, ["plan"])


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--sequence-length", "1e9", "must be a whole number from 1 to 1048576, got '1e9'"),
        ("--sequence-length", "1000000000", "must be a whole number from 1 to 1048576, got '1000000000'"),
        ("--sequence-length", "-5", "must be a whole number from 1 to 1048576, got '-5'"),
        ("--sequence-length", "2.5", "must be a whole number from 1 to 1048576, got '2.5'"),
        ("--world-size", "100000000000", "must be a whole number from 1 to 65536, got '100000000000'"),
        ("--optimizer-states", "nan", "must be a number from 0 to 64, got 'nan'"),
        ("--optimizer-states", "1e400", "must be a number from 0 to 64, got '1e400'"),
        ("--optimizer-states", "-1", "must be a number from 0 to 64, got '-1'"),
    ],
)
def test_plan_numbers_out_of_range_are_one_line(
    capsys: pytest.CaptureFixture, tmp_path: Path, flag: str, value: str, expected: str
) -> None:
    # Each of these drew a plan (1e9 tokens: 50 lines of overflow, exit 0) or a traceback.
    config = str(write_config(tmp_path / "config.json", train_config()))
    assert fails(capsys, ["plan", config, "-i", TOY, f"{flag}={value}"]) == (
        f"error: argument {flag}: {expected} (see tango-fairscale plan --help)"
    )


@pytest.mark.parametrize("value", ["-1", "0GiB", "512KiB", "2PiB", "lots"])
def test_plan_device_memory_out_of_range_is_one_line(
    capsys: pytest.CaptureFixture, tmp_path: Path, value: str
) -> None:
    config = str(write_config(tmp_path / "config.json", train_config()))
    message = fails(capsys, ["plan", config, "-i", TOY, f"--device-memory={value}"])
    assert message.startswith("error: argument --device-memory: ") and "from 1MiB to 1PiB" in message
    assert value in message


# --- plan: the run's pre-flight --------------------------------------------------------------------


def _tokenized_config(model: Dict[str, Any], **engine: Any) -> Dict[str, Any]:
    """A fairscale step of ``model`` on fairscale::tokenize_text's data (never run by plan)."""
    return {
        "steps": {
            "data": {
                "type": "fairscale::tokenize_text",
                "path": "corpus.txt",
                "tokenizer": "tok",
                "block_size": 16,
            },
            "train": {
                "type": "torch::train",
                "model": model,
                "training_engine": {
                    "type": "fairscale",
                    "optimizer": {"type": "torch::AdamW", "lr": 0.001},
                    **engine,
                },
                "dataset_dict": {"type": "ref", "ref": "data"},
                "train_dataloader": {
                    "batch_size": 2,
                    "sampler": {"type": "torch::DistributedSampler", "shuffle": True, "drop_last": True},
                },
                "train_steps": 4,
                "device_count": 2,
            },
        }
    }


#: A 2-layer Llama wider than the shared tiny one, its LM head its own (transformers' default).
SMALL_LLAMA: Dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def small_llama(tiny_pretrained: TinyPretrained) -> Path:
    """A 2-layer Llama saved with save_pretrained (config.json and model.safetensors)."""
    return tiny_pretrained(SMALL_LLAMA, seed=0)


def _wrapped_pretrained(directory: Path) -> Dict[str, Any]:
    return {
        "type": "fairscale::with_wrapped_modules",
        "model": {"type": "fairscale::from_pretrained", "pretrained_model_name_or_path": str(directory)},
        "wrap_module_classes": ["LlamaDecoderLayer"],
        "activation_checkpointing": True,
        "fsdp_config": {},
    }


@pytest.mark.parametrize("init_on_meta", [True, False])
def test_plan_from_config_json_alone_equals_the_plan_with_weights(
    capsys: pytest.CaptureFixture, tmp_path: Path, small_llama: Path, init_on_meta: bool
) -> None:
    # A directory with only the config.json (no weights, no tokenizer): refused before ("has
    # neither model.safetensors ..."), init_on_meta or not; planned from its shapes now.
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((small_llama / "config.json").read_text())
    plans = {}
    for name, directory in (("weights", small_llama), ("config", config_only)):
        config = write_config(
            tmp_path / name / "config.json",
            _tokenized_config(_wrapped_pretrained(directory), init_on_meta=init_on_meta),
        )
        out = tmp_path / name / "plan.json"
        argv = ["plan", str(config), "--sequence-length", "32", "--device", "cpu", "--json", str(out)]
        assert main(argv) == 0, capsys.readouterr().err
        plans[name] = (capsys.readouterr().out, json.loads(out.read_text()))
    (with_weights, with_weights_json), (alone, alone_json) = plans["weights"], plans["config"]
    assert with_weights_json.pop("from_config_only") == []
    assert alone_json.pop("from_config_only") == [str(config_only)]
    assert alone_json == with_weights_json  # the same numbers, every one
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(small_llama)
    assert alone_json["parameters"] == sum(p.numel() for p in loaded.parameters())
    peak = alone_json["peak_bytes_per_worker"]
    assert peak["total"] > peak["activations"] > 0
    note = f"Planned from {config_only}/config.json alone (it holds no model.safetensors)"
    assert note in alone and "Planned from" not in with_weights


def test_the_run_without_weights_names_a_fix_that_works(tmp_path: Path, small_llama: Path) -> None:
    # The old hint, "or load it without init_on_meta", led to the same error: with no weights at all
    # it is not given; with weights in PyTorch's format it is, and names them.
    from tango.common.exceptions import ConfigurationError

    from tango_fairscale.finetune.pretrained import from_pretrained
    from tango_fairscale.materialize import parameters_on_meta

    (tmp_path / "config.json").write_text((small_llama / "config.json").read_text())
    with parameters_on_meta(), pytest.raises(ConfigurationError) as raised:
        from_pretrained(str(tmp_path))
    message = str(raised.value)
    assert "it holds no weights at all" in message and "without init_on_meta" not in message
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with parameters_on_meta(), pytest.raises(ConfigurationError) as raised:
        from_pretrained(str(tmp_path))
    assert "or load it without init_on_meta (transformers then reads pytorch_model.bin)" in str(raised.value)


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            lambda e, t: e.update(optimiser=e.pop("optimizer")),
            "training_engine.optimiser: not an option of the 'fairscale' engine: did you mean 'optimizer'?",
        ),
        (
            lambda e, t: e.update(hybrid_sharding=True),
            'training_engine.hybrid_sharding: true needs backend: "torch" (the fairscale backend shards '
            'across all workers only). Set backend: "torch", or remove hybrid_sharding.',
        ),
        (
            lambda e, t: e.update(export_hf="."),
            "training_engine.export_hf: refusing to write /WORKSPACE/cache/STEP/work: it is the step's work "
            "directory /WORKSPACE/cache/STEP/work; choose a new path (or one this package wrote a "
            "from_pretrained directory to before)",
        ),
        (
            lambda e, t: t.update(validation_split="validation"),
            "validation_split: the dataset has no split 'validation'; its splits are ['train']. Set "
            "validation_split to one of them.",
        ),
        (
            lambda e, t: t.update(train_steps=0),
            "train_steps: must be a positive whole number, got 0.",
        ),
    ],
    ids=["optimiser", "hybrid-on-fairscale", "export-hf-dot", "no-validation-split", "train-steps-0"],
)
def test_plan_refuses_what_the_runs_preflight_refuses(
    capsys: pytest.CaptureFixture, tmp_path: Path, small_llama: Path, change: Any, expected: str
) -> None:
    # Each drew a full plan with exit status 0; tango run refuses each in pre-flight, with this line.
    config = _tokenized_config(_wrapped_pretrained(small_llama))
    change(config["steps"]["train"]["training_engine"], config["steps"]["train"])
    path = write_config(tmp_path / "config.json", config)
    line = fails(capsys, ["plan", str(path), "--sequence-length", "32"])
    assert line == f"error: ConfigurationError: {expected}"


# --- consolidate ---------------------------------------------------------------------------------


def fake_checkpoint(directory: Path) -> Path:
    """
    A complete checkpoint's layout (marker and worker files) with empty contents: enough for
    the checks that run before any shard is read.
    """
    directory.mkdir(parents=True)
    for worker in range(2):
        torch.save({}, checkpointing.worker_file(directory, worker, "model"))
    checkpointing.write_marker(directory, world_size=2, extra={"files": ["model"]})
    return directory


def test_consolidate_argument_errors(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    # In a work directory of its own: the outputs below go beside it, not into it (refused).
    checkpoint = fake_checkpoint(tmp_path / "work" / "checkpoint_state_step4")
    missing = tmp_path / "gone"
    assert fails(capsys, ["consolidate", str(missing), str(tmp_path / "out.pt")]) == (
        f"error: checkpoint directory {missing} does not exist"
    )
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert f"output {out_dir} is a directory" in fails(capsys, ["consolidate", str(checkpoint), str(out_dir)])

    # A file consolidate did not write: refused, --force or not (it replaces only its own outputs).
    existing = tmp_path / "full.pt"
    existing.write_bytes(b"keep me")
    for force in ([], ["--force"]):
        assert f"error: refusing to replace {existing}: it is a file this package did not write" in fails(
            capsys, ["consolidate", str(checkpoint), str(existing), *force]
        )
    assert existing.read_bytes() == b"keep me"


@pytest.mark.parametrize(
    "relative",
    ["full.pt", "sub/dir/full.pt", "worker0_model.pt", "COMPLETE.json"],
    ids=["in-it", "below-it", "its-model-file", "its-marker"],
)
def test_consolidate_refuses_to_write_inside_a_checkpoint(
    capsys: pytest.CaptureFixture, tmp_path: Path, relative: str
) -> None:
    checkpoint = fake_checkpoint(tmp_path / "checkpoint_state_step4")
    before = {path.name: path.read_bytes() for path in checkpoint.iterdir()}
    output = checkpoint / relative
    for force in ([], ["--force"]):
        message = fails(capsys, ["consolidate", str(checkpoint), str(output), *force])
        assert f"refusing to write {output} inside the checkpoint directory {checkpoint.resolve()}" in message
    assert {path.name: path.read_bytes() for path in checkpoint.iterdir()} == before
    assert not (checkpoint / "sub").exists()


def test_consolidate_refuses_an_interrupted_checkpoint_as_destination(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    # Worker files without a marker: an interrupted save, still a checkpoint directory.
    source = fake_checkpoint(tmp_path / "checkpoint_state_step4")
    interrupted = tmp_path / "checkpoint_state_step8"
    interrupted.mkdir()
    torch.save({}, checkpointing.worker_file(interrupted, 0, "model"))
    output = interrupted / "full.pt"
    assert "inside the checkpoint directory" in fails(capsys, ["consolidate", str(source), str(output)])
    assert not output.exists()


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """
    The work directory of a real (short) 2-worker training, in the test's own workers
    (:mod:`tests.harness`, Tango's worker loop): two checkpoints and weights.pt.
    """
    work_dir = tmp_path_factory.mktemp("cli_run") / "work"
    harness.train(train_config(wrap="nested", train_steps=4, checkpoint_every=2), work_dir)
    return work_dir


def test_consolidate_force_replaces_its_earlier_output(
    capsys: pytest.CaptureFixture, work_dir: Path, tmp_path: Path
) -> None:
    output = tmp_path / "full.pt"
    # An earlier consolidate's output (with the optimizer state): kept without --force.
    assert main(["consolidate", str(work_dir), str(output), "--optimizer"]) == 0
    earlier = output.read_bytes()
    capsys.readouterr()
    assert f"error: output {output} already exists: pass --force to replace it" == fails(
        capsys, ["consolidate", str(work_dir), str(output)]
    )
    assert output.read_bytes() == earlier

    assert main(["consolidate", str(work_dir), str(output), "--force"]) == 0
    assert "from 2 shards" in capsys.readouterr().out
    assert output.read_bytes() != earlier
    full = torch.load(output, weights_only=True)
    ToyRegressor(in_features=8, width=32, num_blocks=4).load_state_dict(full, strict=True)
    weights = torch.load(work_dir / "weights.pt", weights_only=True)
    assert all(torch.equal(full[key], weights[key]) for key in weights)

    # The latest checkpoint reached through the work dir's link is still a checkpoint.
    inside = work_dir / "checkpoint_state_latest" / "full.pt"
    assert "inside the checkpoint directory" in fails(capsys, ["consolidate", str(work_dir), str(inside)])
    assert not inside.exists()


# --- program name --------------------------------------------------------------------------------


def test_usage_names_the_command_as_it_was_run() -> None:
    assert default_prog("/venv/lib/python3.11/site-packages/tango_fairscale/__main__.py") == (
        "python -m tango_fairscale"
    )
    assert default_prog("/venv/bin/tango-fairscale") == "tango-fairscale"
    assert default_prog("/venv/bin/pytest") == "tango-fairscale"

    as_module = run_module("--help", cwd=REPO)
    assert as_module.stdout.startswith("usage: python -m tango_fairscale ")
    script = Path(sys.executable).with_name("tango-fairscale")
    if not script.exists():
        pytest.skip("the tango-fairscale console script is not installed next to this Python")
    as_script = subprocess.run([str(script), "plan"], capture_output=True, text=True, check=False)
    assert as_script.returncode == 2
    assert as_script.stderr == (
        "error: the following arguments are required: config (see tango-fairscale plan --help)\n"
    )
