"""The configuration reference (docs/configuration.md) lists exactly the parameters the code takes."""

import inspect
import json
import re
from typing import Set

from tango.integrations.torch import TrainCallback

from tango_fairscale import FairScaleTrainingEngine, FSDPConfig, with_wrapped_modules
from tango_fairscale.finetune.lora import with_lora
from tests.helpers import REPO

#: The configuration reference, which the README points to.
REFERENCE = (REPO / "docs" / "configuration.md").read_text()
#: Watching a run: the metrics log and the callbacks.
MONITORING = (REPO / "docs" / "monitoring.md").read_text()


def section_fields(heading: str) -> Set[str]:
    start = REFERENCE.index(heading)
    end = REFERENCE.find("\n#", start + len(heading))
    return set(re.findall(r"^\| `(\w+)` \|", REFERENCE[start:end], flags=re.MULTILINE))


def test_fsdp_config_fields() -> None:
    assert section_fields("## `FSDPConfig`") == set(FSDPConfig.field_names())


def test_engine_parameters() -> None:
    taken = set(inspect.signature(FairScaleTrainingEngine.__init__).parameters) - {
        "self",
        "train_config",
        "model",
    }
    assert section_fields('## Training engine `"fairscale"`') == taken


def test_wrapper_parameters() -> None:
    taken = set(inspect.signature(with_wrapped_modules).parameters)
    assert section_fields('## Model constructor `"fairscale::with_wrapped_modules"`') == taken


def test_lora_parameters() -> None:
    taken = set(inspect.signature(with_lora).parameters)
    assert section_fields('## Model constructor `"fairscale::with_lora"`') == taken


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


def test_every_patch_has_a_row_in_the_one_patch_table() -> None:
    """Each patch ID compat.py names (F1, T2, ...) is a row of docs/architecture.md's table, the one list."""
    from tango_fairscale import compat

    table = set(
        re.findall(r"^\| ([A-Z]\d) \|", (REPO / "docs" / "architecture.md").read_text(), flags=re.MULTILINE)
    )
    named = set(re.findall(r"\b([FTWDPH]\d)\b", inspect.getsource(compat)))
    assert named and not named - table, f"patches without a row in docs/architecture.md: {named - table}"
    assert "docs/architecture.md" in (compat.__doc__ or "")


def test_watching_a_run_lists_each_callback_and_its_options() -> None:
    from rjsonnet import evaluate_snippet  # the jsonnet Tango reads configs with

    start = MONITORING.index("## Weights & Biases, TensorBoard and the profiler")
    end = MONITORING.find("\n## ", start + 1)
    section = MONITORING[start : end if end >= 0 else len(MONITORING)]
    block = re.search(r"```jsonnet\n(.*?)```", section, flags=re.S)
    assert block is not None
    callbacks = json.loads(evaluate_snippet("monitoring.md", "{" + block.group(1) + "}"))["callbacks"]
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
    # The last section is a list of its own, run by tests/test_failure_modes.py.
    text = (REPO / "docs" / "failure-modes.md").read_text().split("## Refused before any worker starts")[0]
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
