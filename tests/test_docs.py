"""The README's configuration reference lists exactly the parameters the code takes."""

import inspect
import json
import re
from typing import Set

from tango.integrations.torch import TrainCallback

from tango_fairscale import FairScaleTrainingEngine, FSDPConfig, with_wrapped_modules
from tests.helpers import REPO

README = (REPO / "README.md").read_text()


def section_fields(heading: str) -> Set[str]:
    start = README.index(heading)
    end = README.find("\n#", start + len(heading))
    return set(re.findall(r"^\| `(\w+)` \|", README[start:end], flags=re.MULTILINE))


def test_fsdp_config_fields() -> None:
    assert section_fields("### `FSDPConfig`") == set(FSDPConfig.field_names())


def test_engine_parameters() -> None:
    taken = set(inspect.signature(FairScaleTrainingEngine.__init__).parameters) - {
        "self",
        "train_config",
        "model",
    }
    assert section_fields('### Training engine `"fairscale"`') == taken


def test_wrapper_parameters() -> None:
    taken = set(inspect.signature(with_wrapped_modules).parameters)
    assert section_fields('### Model constructor `"fairscale::with_wrapped_modules"`') == taken


def test_every_config_field_has_a_docstring() -> None:
    source = inspect.getsource(FSDPConfig)
    for name in FSDPConfig.field_names():
        assert re.search(rf"^    {name}: .*\n    \"\"\"\n", source, flags=re.MULTILINE), name


def test_architecture_lists_every_module() -> None:
    package = REPO / "tango_fairscale"
    text = (REPO / "docs" / "architecture.md").read_text()
    modules = [
        path.relative_to(package).as_posix()
        for path in sorted(package.rglob("*.py"))
        if path.name not in ("__init__.py", "__main__.py", "version.py")
    ]
    missing = [module for module in modules if f"`{module}`" not in text]
    assert not missing, f"docs/architecture.md does not say what these modules own: {missing}"


def test_watching_a_run_lists_each_callback_and_its_options() -> None:
    from rjsonnet import evaluate_snippet  # the jsonnet Tango reads configs with

    section = README[README.index("## Watching a run") : README.index("## Checkpoints, resuming")]
    block = re.search(r"```jsonnet\n(.*?)```", section, flags=re.S)
    assert block is not None
    callbacks = json.loads(evaluate_snippet("README", "{" + block.group(1) + "}"))["callbacks"]
    assert [c["type"] for c in callbacks] == [
        "fairscale::wandb",
        "fairscale::tensorboard",
        "fairscale::profile",
        "fairscale::memory",
    ]
    for callback in callbacks:
        parameters = inspect.signature(TrainCallback.by_name(callback["type"]).__init__).parameters
        assert set(callback) - {"type"} <= set(parameters), callback
    # Each logger's bullet names every option it takes.
    for name in ("fairscale::wandb", "fairscale::tensorboard", "fairscale::profile"):
        bullet = section[section.index(f"- **`{name}`**") :].split("\n- ", 1)[0]
        named = set(re.findall(r"`(\w+)`", bullet.split("Options:", 1)[1]))
        taken = set(inspect.signature(TrainCallback.by_name(name).__init__).parameters)
        assert taken - {"self", "args", "kwargs"} <= named, name


def test_failure_modes_count_and_tests() -> None:
    """docs/failure-modes.md states how many cases it lists, and every test it names exists."""
    text = (REPO / "docs" / "failure-modes.md").read_text()
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| what happens") and not line.startswith("|---")
    ]
    stated = re.search(r"tables list (\d+) cases, one per row", text)
    assert stated is not None and int(stated.group(1)) == len(rows), (stated, len(rows))
    for row in rows:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        assert len(cells) == 3, row
        named = re.findall(r"`(test_\w+\.py)(?:::(\w+))?`", cells[2])
        assert named, f"names no test: {row[:100]}"
        for module, function in named:
            path = REPO / "tests" / module
            assert path.is_file(), module
            if function:
                assert re.search(rf"^def {function}\(", path.read_text(), flags=re.M), f"{module}::{function}"
