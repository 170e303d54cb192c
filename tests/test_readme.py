"""
The README's commands and config snippets, run as written: the ``tango run`` line, the training
config snippet (with the one-line switch to the torch backend too), ``include_package`` and the
fine-tuning model (built by ``plan`` as the workers build it); every block of the README is one of
these or the quick start's ``make`` commands, which CI (``make test``) and the example tests run.
The snippets the README sends to ``docs/`` run from there: ``plan`` and the Python API excerpt of
``docs/configuration.md``, ``plot`` of ``docs/monitoring.md``; ``consolidate``'s command lines run
as written in ``tests/test_checkpoints.py`` (``docs/checkpoints.md``, either backend's checkpoint)
and ``tests/test_pretrained.py`` (``docs/pretrained.md``). Placeholders
(``WORKSPACE/cache/TorchTrainStep-.../work``, ``[--option VALUE]``) are filled in, and the
user's own pieces (``my_model``, the ``data`` step) come from the test components; ``-o``
shortens training to a few steps.
"""

import json
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tango_fairscale import cli
from tests.components import MyModel
from tests.conftest import TinyPretrained
from tests.helpers import (
    README,
    REPO,
    TANGO,
    TINY_LLAMA,
    Command,
    ConcurrentProcesses,
    free_port,
    max_abs_difference,
    readme_block_with,
    readme_command_lines,
    tango_env,
    train_work_dir,
)

#: The user's own pieces the README leaves to them: its ``my_model`` and the ``data`` step.
USER_PACKAGES = ["tests.components", "examples.toy.components"]
DATA_STEP = 'data: { type: "toy::regression_data", in_features: 8, train_size: 256, validation_size: 64 },'
TRAIN_STEPS = 6
#: Where the README sends the reference and its snippets.
CONFIGURATION = "docs/configuration.md"
MONITORING = "docs/monitoring.md"


def experiment(train_snippet: str) -> str:
    """The README's ``train: {...}`` snippet as the training step of a whole experiment."""
    return "{\n  steps: {\n    " + DATA_STEP + "\n" + train_snippet + "  },\n}\n"


def run(command: List[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command, cwd=cwd, env=tango_env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def readme_tango_run(cwd: Path) -> Command:
    """The README's ``tango run`` line, with the user's packages and a short run, in ``cwd``."""
    (line,) = readme_command_lines("bash", "tango run config.jsonnet -i tango_fairscale -w workspace")
    command = shlex.split(line)
    assert command[0] == "tango" and "-w" in command
    overrides = f'{{"steps.train.train_steps": {TRAIN_STEPS}, "steps.train.distributed_port": {free_port()}}}'
    extra = [arg for package in USER_PACKAGES for arg in ("-i", package)]
    return Command([TANGO, *command[1:], *extra, "-o", overrides], cwd=cwd, env=tango_env())


TRAIN_SNIPPET = readme_block_with("jsonnet", 'type: "torch::train"')


def torch_backend_snippet() -> str:
    """The training snippet with its ``training_engine`` replaced by the README's backend example."""
    switched = readme_block_with("jsonnet", 'backend: "torch"')
    engine = re.search(r"^  training_engine: \{\n.*?^  \},\n", TRAIN_SNIPPET, re.M | re.S)
    assert engine is not None
    # One line apart: the example is the snippet's engine plus `backend: "torch"`.
    assert [line for line in switched.splitlines() if 'backend: "torch"' not in line] == engine.group(
        0
    ).splitlines()
    return TRAIN_SNIPPET.replace(engine.group(0), switched)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """Per backend, the directory the README's ``tango run`` ran in (its ``workspace`` inside)."""
    # Both started at once, each on its own port: most of a run is its processes' start-up, which
    # overlaps well on two cores.
    directories, commands = {}, {}
    for backend, snippet in (("fairscale", TRAIN_SNIPPET), ("torch", torch_backend_snippet())):
        cwd = directories[backend] = tmp_path_factory.mktemp(f"readme_{backend}")
        (cwd / "config.jsonnet").write_text(experiment(snippet))
        commands[backend] = readme_tango_run(cwd)
    runs = ConcurrentProcesses(commands)
    try:
        for backend, command in commands.items():
            result = runs.result(backend)
            assert result.returncode == 0, f"{command.argv}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    finally:
        runs.close()
    return directories


def test_snippet_trains_and_keeps_its_result(trained: Dict[str, Path]) -> None:
    weights = {}
    for backend, cwd in trained.items():
        # -w workspace: the trained weights outlive the command.
        weights[backend] = torch.load(train_work_dir(cwd / "workspace") / "weights.pt", weights_only=True)
        MyModel().load_state_dict(weights[backend], strict=True)
    # The one-line switch trains the same model to the same weights.
    assert max_abs_difference(weights["fairscale"], weights["torch"]) <= 1e-5
    checkpoint = train_work_dir(trained["torch"] / "workspace") / "checkpoint_state_latest"
    assert (checkpoint / "dcp").is_dir()


def test_include_package_in_tango_yml(tmp_path: Path) -> None:
    packages = readme_block_with("yaml", "include_package")
    assert "- tango_fairscale" in packages
    (tmp_path / "tango.yml").write_text(packages + "".join(f"  - {p}\n" for p in USER_PACKAGES))
    (tmp_path / "config.jsonnet").write_text(experiment(TRAIN_SNIPPET))
    # plan reads tango.yml as tango run does: no -i needed.
    result = run([sys.executable, "-m", "tango_fairscale", "plan", "config.jsonnet"], tmp_path)
    assert "transformer.h.2" in result.stdout


#: The README's fine-tuning model: LoRA adapters on a pretrained Llama, a unit per decoder layer.
FINETUNE_SNIPPET = readme_block_with("jsonnet", "fairscale::with_lora")


def test_finetune_snippet_builds_as_the_workers_build_it(
    tmp_path: Path, tiny_pretrained: TinyPretrained
) -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from rjsonnet import evaluate_snippet  # the jsonnet Tango reads configs with
    from transformers import LlamaConfig, LlamaForCausalLM

    my_llama = tiny_pretrained(TINY_LLAMA, seed=0)
    model = FINETUNE_SNIPPET.replace('"/models/my-llama"', json.dumps(str(my_llama)))
    assert model != FINETUNE_SNIPPET
    # The README's model in the README's training step, on the engine with init_on_meta as it says.
    snippet = re.sub(
        r"^  model: \{\n.*?^  \},\n", lambda _: textwrap.indent(model, "  "), TRAIN_SNIPPET, flags=re.M | re.S
    )
    assert snippet.count('    type: "fairscale",\n') == 1
    snippet = snippet.replace('    type: "fairscale",\n', '    type: "fairscale",\n    init_on_meta: true,\n')
    (tmp_path / "config.jsonnet").write_text(experiment(snippet))
    (tmp_path / "none.yml").write_text("include_package: []\n")
    # In this process (the model's libraries imported once): the same code as the command's.
    includes = [arg for package in USER_PACKAGES for arg in ("-i", package)]
    argv = [str(tmp_path / "config.jsonnet"), "--world-size", "2", "--settings", str(tmp_path / "none.yml")]
    assert cli.main(["plan", *argv, *includes, "--json", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())

    # What the workers build is peft's model with the snippet's options on the pretrained model.
    lora = json.loads(evaluate_snippet("README", "{" + FINETUNE_SNIPPET + "}"))["model"]["model"]
    expected = get_peft_model(
        LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)),
        LoraConfig(r=lora["r"], target_modules=lora["target_modules"]),
    )
    assert (plan["model"], plan["built_on"]) == ("PeftModel", "meta")
    assert plan["parameters"] == sum(p.numel() for p in expected.parameters())
    trainable = sum(p.numel() for p in expected.parameters() if p.requires_grad)
    assert 0 < plan["trainable_parameters"] == trainable < plan["parameters"]
    layers = [f"base_model.model.model.layers.{i}" for i in range(TINY_LLAMA["num_hidden_layers"])]
    assert [unit["name"] for unit in plan["units"]] == ["", *layers]


def test_every_readme_block_is_run() -> None:
    """Each code block of the README is one the tests above run, or the quick start that CI runs."""
    run_here = {
        "bash": ["tango run config.jsonnet -i tango_fairscale -w workspace", "make test"],
        "yaml": ["include_package"],
        "jsonnet": ['type: "torch::train"', 'backend: "torch"', "fairscale::with_lora"],
    }
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", README, re.M | re.S)
    assert len(blocks) == sum(len(markers) for markers in run_here.values())
    for language, block in blocks:
        markers = [marker for marker in run_here.get(language, []) if marker in block]
        assert len(markers) == 1, f"a README block that no test runs:\n{block}"
    # The quick start's test command is the one CI runs.
    assert "make test" in (REPO / ".ci" / "run").read_text().splitlines()
    assert "make demo" in readme_block_with("bash", "make test")


def test_plan_command(tmp_path: Path) -> None:
    (line,) = readme_command_lines("bash", "tango_fairscale plan", doc=CONFIGURATION)
    filled = (
        line.replace("[--step NAME]", "--step train")
        .replace("[--world-size N]", "--world-size 4")
        .replace("[-o OVERRIDES]", "-o '{\"steps.train.model.fsdp_config.reshard_after_forward\": false}'")
        .replace("[-D KEY=VALUE]", "-D unused=1")
        .replace("[-i PACKAGE]", " ".join(f"-i {p}" for p in USER_PACKAGES))
        .replace("[--settings FILE]", "--settings none.yml")
        .replace("[--json plan.json]", "--json plan.json")
    )
    assert "[" not in filled, filled
    (tmp_path / "none.yml").write_text("include_package: []\n")
    (tmp_path / "config.jsonnet").write_text(experiment(TRAIN_SNIPPET))
    result = run([sys.executable if word == "python" else word for word in shlex.split(filled)], tmp_path)
    assert "transformer.h.0" in result.stdout
    assert (tmp_path / "plan.json").is_file()


def test_plot_commands(trained: Dict[str, Path], tmp_path: Path) -> None:
    work_dir = train_work_dir(trained["fairscale"] / "workspace")
    first, second = readme_command_lines("bash", "tango_fairscale plot", doc=MONITORING)
    run(
        shlex.split(
            first.replace("WORKSPACE/cache/TorchTrainStep-.../work", str(work_dir)).replace(
                "python", sys.executable, 1
            )
        ),
        tmp_path,
    )
    assert (work_dir / "metrics.png").stat().st_size > 0
    run(shlex.split(second.replace("work/", f"{work_dir}/").replace("python", sys.executable, 1)), tmp_path)
    assert (tmp_path / "loss.png").stat().st_size > 0


EXAMPLE = REPO / "examples" / "python_api" / "train.py"


def test_python_api_excerpt_is_the_example() -> None:
    excerpt = readme_block_with("python", "TorchTrainStep(", doc=CONFIGURATION)
    source = EXAMPLE.read_text()
    # The reference shows the example's own lines (indented one level there), "..." for some left out,
    # comments its own.
    code = [line.split("  #")[0].strip() for line in excerpt.strip().splitlines()]
    assert len(code) > 10
    for line in code:
        assert line == "..." or line in source, line


def test_python_api_example_runs(tmp_path: Path) -> None:
    # As docs/configuration.md says: as a script, outside a git repository.
    example = EXAMPLE
    shutil.copy(example, tmp_path / "train.py")
    result = run(
        [sys.executable, "train.py", "--workspace", "workspace", "--steps", "6"], tmp_path, timeout=400
    )
    assert (tmp_path / "workspace").is_dir(), result.stdout
    # The training step's outputs found and read with the public API (train_outputs, read_weights,
    # read_checkpoint): the last step's checkpoint, consolidated, is weights.pt.
    assert "weights.pt vs checkpoint_state_step6: 4 tensors, max difference 0.0" in result.stdout, (
        result.stdout
    )
    assert "evaluate step, validation MSE of the trained model:" in result.stdout, result.stdout
