"""
What every patch checks before it rebinds anything: that the library it patches is a release
inside the range ``pyproject.toml`` supports (:func:`check_version`), and that each attribute it
rebinds, and each signature it wraps, is still there as it was (refused otherwise with an
:class:`IncompatibleVersionError` naming the patch).
"""

import logging
import os
from typing import Any, Dict, Sequence, Tuple

import torch

from .. import versions

logger = logging.getLogger(__name__)


#: The releases of the libraries patched in every process, as ``pyproject.toml`` pins them: a
#: release prefix (``"1.3."``) or an exact one. torch is checked against its range instead
#: (:data:`TORCH_RANGE`). pip's resolver keeps an installation inside these; the import refuses
#: only what is outside them (``TANGO_FAIRSCALE_SKIP_VERSION_CHECK=1`` runs it anyway), and each
#: patch checks its own target on the release installed.
CHECKED_VERSIONS: Dict[str, Tuple[str, ...]] = {
    "fairscale": ("0.4.13",),
    "ai2-tango": ("1.3.",),
}
#: torch's supported range (kept in :mod:`tango_fairscale.versions`).
TORCH_RANGE = versions.TORCH_RANGE
#: Libraries patched only in processes that use them (H1, H2): checked when the patch is applied
#: or used, so that another release installed for something else does not refuse the package.
CHECKED_WHEN_USED: Dict[str, Tuple[str, ...]] = {
    "transformers": ("4.57.",),
}
SKIP_VERSION_CHECK_VARIABLE = "TANGO_FAIRSCALE_SKIP_VERSION_CHECK"


class IncompatibleVersionError(ImportError):
    """A patched library is a version, or lacks an attribute, that this package was not checked against."""


def _installed_version(distribution: str) -> str:
    if distribution == "torch":
        return torch.__version__
    from importlib.metadata import version

    return version(distribution)


def _in_checked_range(distribution: str, found: str) -> bool:
    if distribution == "torch":
        release = versions.TorchVersion(found.split("+")[0])
        return bool(release >= TORCH_RANGE[0]) and not bool(release >= TORCH_RANGE[1])
    checked = CHECKED_VERSIONS.get(distribution) or CHECKED_WHEN_USED[distribution]
    return any(found == v or (v.endswith(".") and found.startswith(v)) for v in checked)


def _describe_checked(distribution: str) -> str:
    if distribution == "torch":
        return f"torch >= {TORCH_RANGE[0]}, < {TORCH_RANGE[1]}"
    checked = CHECKED_VERSIONS.get(distribution) or CHECKED_WHEN_USED[distribution]
    return f"{distribution} " + " / ".join(v + ("x" if v.endswith(".") else "") for v in checked)


def check_version(distribution: str) -> None:
    """Refuse a release of ``distribution`` outside the range ``pyproject.toml`` requires."""
    found = _installed_version(distribution)
    if _in_checked_range(distribution, found):
        return
    if os.environ.get(SKIP_VERSION_CHECK_VARIABLE) == "1":
        logger.warning(
            "%s %s is outside the releases tango-fairscale supports (%s)",
            distribution,
            found,
            _describe_checked(distribution),
        )
        return
    quoted_extra = "'.[hf]'" if distribution in CHECKED_WHEN_USED else "."
    raise IncompatibleVersionError(
        f"tango-fairscale patches {distribution} and supports {_describe_checked(distribution)}, but "
        f"{found} is installed. Install a supported release (pip install -e {quoted_extra} resolves "
        f"them), or set {SKIP_VERSION_CHECK_VARIABLE}=1 to run unsupported at your own risk."
    )


def _require_attributes(module: Any, names: Sequence[str], patch: str) -> None:
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise IncompatibleVersionError(
            f"tango-fairscale patch {patch} rebinds {module.__name__}.{missing}, which this installation "
            "lacks: the library changed. Install the versions in pyproject.toml."
        )


def _require_signature(function: Any, parameters: Sequence[str], patch: str) -> None:
    """
    ``function`` (which ``patch`` wraps, calling it with these arguments) takes exactly
    ``parameters``, in order: a release that added or renamed one is refused, naming the patch.
    """
    import inspect

    found = list(inspect.signature(function).parameters)
    if found != list(parameters):
        raise IncompatibleVersionError(
            f"tango-fairscale patch {patch} wraps {function.__qualname__}, whose parameters are {found} "
            f"on this installation, not {list(parameters)}: the library changed."
        )


def signature_matches(function: Any, parameters: Sequence[str]) -> bool:
    """Whether :func:`_require_signature` would accept ``function``."""
    try:
        _require_signature(function, parameters, "")
    except IncompatibleVersionError:
        return False
    return True
