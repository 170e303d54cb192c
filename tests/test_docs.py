"""The configuration reference (docs/configuration.md) lists exactly the parameters the code takes."""

import inspect
import json
import re
from typing import Dict, Set

from tango.integrations.torch import TrainCallback

from scripts import import_graph
from tango_fairscale import FairScaleTrainingEngine, FSDPConfig, with_wrapped_modules
from tango_fairscale.finetune.lora import with_lora
from tango_fairscale.fsdp_options import FSDPOptions
from tests.helpers import REPO

#: The configuration reference, which the README points to.
REFERENCE = (REPO / "docs" / "configuration.md").read_text()
#: Watching a run: the metrics log and the callbacks.
MONITORING = (REPO / "docs" / "monitoring.md").read_text()
#: Which module owns what, the layers, and the one table of patches.
ARCHITECTURE = (REPO / "docs" / "architecture.md").read_text()


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
    source = inspect.getsource(FSDPOptions)
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
    """
    Each patch ID any module of compat/ names (F1, T2, S1, F10, ...) is a row of
    docs/architecture.md's table, the one list, and each row names its upstream issue (or says
    that none was found).
    """
    from tango_fairscale import compat

    rows = {}
    for line in ARCHITECTURE.splitlines():
        match = re.match(r"^\| ([A-Z]\d+) \|", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in line.strip().strip("|").split("|")]
    named = {
        patch
        for path in sorted((REPO / "tango_fairscale" / "compat").glob("*.py"))
        for patch in re.findall(r"\b([FTWDPHS]\d+)\b", path.read_text())
    }
    assert named and not named - set(rows), (
        f"patches without a row in docs/architecture.md: {named - set(rows)}"
    )
    for patch, cells in rows.items():
        assert len(cells) == 5, f"{patch}: patch | target | installed by | what and why | upstream"
        assert cells[-1], f"{patch}: the upstream cell is empty (write 'none found' if none was)"
    assert "docs/architecture.md" in (compat.__doc__ or "")


def test_the_layers_table_is_the_import_graph() -> None:
    """docs/architecture.md's "Layers" table lists exactly the folder-level imports of the package."""
    section = ARCHITECTURE[ARCHITECTURE.index("## Layers") :]
    section = section[: section.index("\n## ")]
    documented: Dict[str, Set[str]] = {}
    holds: Dict[str, str] = {}
    for line in section.splitlines():
        match = re.match(r"^\| `(\w+)` \|", line)
        if match:
            _, what, imports = [cell.strip() for cell in line.strip().strip("|").split("|")]
            documented[match.group(1)] = set(re.findall(r"`(\w+)`", imports))
            holds[match.group(1)] = what
    edges = import_graph.graph()
    actual: Dict[str, Set[str]] = {import_graph.group_of(name): set() for name in edges}
    for source, target in import_graph.layers(edges):
        actual[source].add(target)
    assert documented == actual, (
        "docs/architecture.md's Layers table differs from `python scripts/import_graph.py --layers`"
    )
    core = {
        name.rsplit(".", 1)[-1]
        for name in edges
        if name != import_graph.PACKAGE and import_graph.group_of(name) == import_graph.CORE
    }
    assert core == set(re.findall(r"`(\w+)`", holds[import_graph.CORE])), (
        "the core row lists each top-level module"
    )


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


def test_the_python_api_page_is_what_the_code_says() -> None:
    """
    docs/python-api.md, which scripts/api_reference.py writes: every public name it lists, with each
    parameter and the docstring's summary. Compared piece by piece, not as one text: Pythons print
    some annotations differently (``Optional`` on 3.11, ``| None`` later).
    """
    import tango_fairscale
    from scripts import api_reference

    page = (REPO / "docs" / "python-api.md").read_text()
    for _, names in api_reference.SECTIONS:
        for name in names:
            obj = getattr(tango_fairscale, name)
            assert f"### `{name}`" in page, name
            target = obj.__init__ if inspect.isclass(obj) and "__init__" in vars(obj) else obj
            for parameter in inspect.signature(target).parameters:
                if parameter != "self":
                    assert f"{parameter}" in page.split(f"### `{name}`")[1].split("\n### ")[0], (
                        name,
                        parameter,
                    )
            assert api_reference._summary(obj) in page, name
    assert [line for line in page.splitlines() if line.startswith("### ")] == [
        line for line in api_reference.render().splitlines() if line.startswith("### ")
    ]
