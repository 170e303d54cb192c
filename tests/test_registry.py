"""Coexistence with ai2-tango's bundled tango.integrations.fairscale, in both import orders."""

import subprocess
import sys

import pytest

from tests.helpers import REPO

CHECK = """
import {first}, {second}
from tango.integrations.torch import Model, TrainingEngine
engine = TrainingEngine.by_name("fairscale")
constructor = Model.resolve_class_name("fairscale::with_wrapped_modules")[0]
print(engine.__module__, constructor.__module__)
"""


@pytest.mark.parametrize(
    "first, second",
    [
        ("tango_fairscale", "tango.integrations.fairscale"),
        ("tango.integrations.fairscale", "tango_fairscale"),
    ],
)
def test_both_import_orders_resolve_to_ours(first: str, second: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK.format(first=first, second=second)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["tango_fairscale.engine", "tango_fairscale.wrapping"]


def test_misspelt_type_elsewhere_gets_tangos_not_registered_error() -> None:
    # An unknown name makes Tango import every bundled integration. Its transformers
    # integration needs the `datasets` package whenever `transformers` is installed (as with
    # our examples extra), which is unrelated to the clash tested here: hide transformers.
    assert_typo_gets_tango_answer('import sys\nsys.modules["transformers"] = None\n')


def test_misspelt_type_with_transformers_but_no_datasets() -> None:
    # transformers installed (the examples extra) without `datasets` (the hf extra), which Tango's
    # transformers integration needs: the typo must still get Tango's own answer. `make` installs
    # both, so datasets is hidden here.
    assert_typo_gets_tango_answer(
        'import importlib.util, sys\nassert importlib.util.find_spec("transformers") is not None\n'
        'sys.modules["datasets"] = None\n'
    )


def assert_typo_gets_tango_answer(preamble: str) -> None:
    """In a fresh process that runs ``preamble`` first, a misspelt optimizer gets Tango's registry error."""
    script = (
        preamble
        + """
import tango_fairscale
from tango.common.exceptions import RegistryKeyError
from tango.integrations.torch import Optimizer
try:
    Optimizer.resolve_class_name("torch::Adamm")
except RegistryKeyError as error:
    print("REGISTRY:", error)
"""
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "REGISTRY: 'torch::Adamm' is not a registered name for 'Optimizer'" in result.stdout
