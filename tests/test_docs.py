"""The README's configuration reference lists exactly the parameters the code takes."""

import inspect
import re
from typing import Set

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
