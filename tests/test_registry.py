"""Coexistence with ai2-tango's bundled tango.integrations.fairscale, in both import orders."""

import subprocess
from typing import Iterator

import pytest

from tests.helpers import ConcurrentProcesses, python_command

CHECK = """
import {first}, {second}
from tango.integrations.torch import Model, TrainingEngine
engine = TrainingEngine.by_name("fairscale")
constructor = Model.resolve_class_name("fairscale::with_wrapped_modules")[0]
print(engine.__module__, constructor.__module__)
"""


ORDERS = [
    ("tango_fairscale", "tango.integrations.fairscale"),
    ("tango.integrations.fairscale", "tango_fairscale"),
]

# Preambles of the typo checks: an unknown name makes Tango import every bundled integration.
# Its transformers integration needs the `datasets` package whenever `transformers` is installed
# (as with our examples extra), which is unrelated to the clash tested here: the first hides
# transformers. The second has transformers installed (the examples extra) without `datasets`
# (the hf extra), which Tango's transformers integration needs: the typo must still get Tango's
# own answer. `make` installs both, so datasets is hidden there.
TYPO_PREAMBLES = {
    "elsewhere": 'import sys\nsys.modules["transformers"] = None\n',
    "no datasets": (
        'import importlib.util, sys\nassert importlib.util.find_spec("transformers") is not None\n'
        'sys.modules["datasets"] = None\n'
    ),
}

TYPO_CHECK = """
import tango_fairscale
from tango.common.exceptions import RegistryKeyError
from tango.integrations.torch import Optimizer
try:
    Optimizer.resolve_class_name("torch::Adamm")
except RegistryKeyError as error:
    print("REGISTRY:", error)
"""


@pytest.fixture(scope="module")
def scripts() -> Iterator[ConcurrentProcesses]:
    """Every check of this module in its own fresh process, started together."""
    checks = ConcurrentProcesses(
        {
            **{
                f"order {first}": python_command(CHECK.format(first=first, second=second))
                for first, second in ORDERS
            },
            **{
                f"typo {name}": python_command(preamble + TYPO_CHECK)
                for name, preamble in TYPO_PREAMBLES.items()
            },
        }
    )
    yield checks
    checks.close()


@pytest.mark.parametrize("first, second", ORDERS)
def test_both_import_orders_resolve_to_ours(first: str, second: str, scripts: ConcurrentProcesses) -> None:
    result = scripts.result(f"order {first}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["tango_fairscale.engine", "tango_fairscale.wrapping"]


def test_misspelt_type_elsewhere_gets_tangos_not_registered_error(scripts: ConcurrentProcesses) -> None:
    assert_typo_gets_tango_answer(scripts.result("typo elsewhere"))


def test_misspelt_type_with_transformers_but_no_datasets(scripts: ConcurrentProcesses) -> None:
    assert_typo_gets_tango_answer(scripts.result("typo no datasets"))


def assert_typo_gets_tango_answer(result: subprocess.CompletedProcess) -> None:
    """In a fresh process, a misspelt optimizer gets Tango's registry error."""
    assert result.returncode == 0, result.stderr
    assert "REGISTRY: 'torch::Adamm' is not a registered name for 'Optimizer'" in result.stdout
