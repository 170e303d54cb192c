"""
The releases this package runs on, and the one place behaviour is switched on torch's version.

The supported range is ``pyproject.toml``'s (torch 2.11 to 2.15): pip's resolver enforces it, so
the import adds no refusal of its own for a release inside it. Each patch in
:mod:`tango_fairscale.compat` checks its own target (the attributes and signatures it rebinds) on
the installed release; where a release differs, the patch picks its variant by one of the flags
below, and a feature whose target a release lacks is turned off with one line naming the feature,
the patch and the release (:func:`feature_unavailable`).
"""

import logging
import threading
from typing import Set, Tuple

import torch
from torch.torch_version import TorchVersion

__all__ = [
    "TORCH_RANGE",
    "TORCH_VERSION",
    "TorchVersion",
    "_TORCH_GREATER_EQUAL_2_15",
    "feature_unavailable",
    "torch_release",
]

logger = logging.getLogger(__name__)

#: The installed torch, comparable with strings (``TORCH_VERSION >= "2.14"``).
TORCH_VERSION = TorchVersion(torch.__version__)

#: The supported range, ``pyproject.toml``'s ``torch>=2.11,<2.16``: (lowest, first excluded). CI
#: tests the lowest and the newest release in it (``scripts/test_matrix.sh``).
TORCH_RANGE: Tuple[str, str] = ("2.11", "2.16")


def _at_least(release: str) -> bool:
    # Pre-releases and local builds of a release count as that release ("2.14.0a0+git..." is 2.14).
    return TorchVersion(TORCH_VERSION.split("+")[0].split("a")[0].split("rc")[0]) >= release


#: ``FlopCounterMode`` looks an op up in its mapping by overload packet before decomposing it, not
#: by overload (:func:`tango_fairscale.telemetry.flops.flop_counter`).
_TORCH_GREATER_EQUAL_2_15 = _at_least("2.15")


def torch_release() -> str:
    """The installed torch's ``major.minor.patch`` (``2.15.0``), for messages."""
    return str(TORCH_VERSION).split("+")[0]


_told: Set[str] = set()
_told_lock = threading.Lock()


def feature_unavailable(feature: str, patch: str, missing: str, consequence: str) -> None:
    """
    Say once per process, in one line, that ``feature`` is off on this torch because the target of
    ``patch`` (``missing``) is not there, and what runs instead (``consequence``).
    """
    with _told_lock:
        if feature in _told:
            return
        _told.add(feature)
    # Info, not a warning: nothing in the config asked for the feature, and the run's results do
    # not depend on it (each feature turned off here is a memory layout, not a value).
    logger.info(
        "%s is off on torch %s: patch %s needs %s, which this release lacks; %s.",
        feature,
        torch_release(),
        patch,
        missing,
        consequence,
    )
