"""
One line for a mistake in the config of one of this package's steps (``fairscale::tokenize_text``,
``fairscale::evaluate``) that Tango finds while it constructs the step: an option that is not one
(with the nearest one), or a value of the wrong type. Tango raised both from its ``FromParams``
machinery inside a 38-42-line traceback; patch T8 of :mod:`tango_fairscale.compat` routes them here.
"""

import inspect
import re
from typing import Any, Iterable, List, Optional

from tango.common.exceptions import ConfigurationError
from tango.step import Step

from .errors import Refused, did_you_mean

__all__ = ["PREFIX", "step_config_error", "wrong_type"]

#: The steps whose construction errors are told in one line: this package's own.
PREFIX = "fairscale::"

# Tango's FromParams messages (tango.common.from_params.construct_arg): "Expected block_size to be
# int, found 8 (<class 'str'>)." and "Expected path to be a str or Path, found ...".
_EXPECTED = re.compile(
    r"^Expected (?P<field>\w+) to be (?P<kind>.+?), found (?P<value>.*) \(<class '(?P<cls>[\w.]+)'>\)\.?$",
    re.S,
)
_NUMERIC = re.compile(r"^Expected (?P<field>\w+) to be numeric\.?$")
_KINDS = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "a string"}


def _options(step_class: Any) -> List[str]:
    """What a step of ``step_class`` takes in a config: its ``run()`` arguments and Tango's own ``step_*``."""
    names = [name for name in inspect.signature(step_class.run).parameters if name != "self"]
    names += [name for name in inspect.signature(Step.__init__).parameters if name not in ("self", "kwargs")]
    return names


def wrong_type(error: BaseException) -> Optional[str]:
    """
    "FIELD must be a whole number, got '8' (a str) ..." for Tango's ``FromParams`` error of an
    option of the wrong type ("Expected block_size to be int, found 8 (<class 'str'>)."), in the
    config of a step or of a model; ``None`` for any other error.
    """
    if not isinstance(error, TypeError):
        return None
    numeric = _NUMERIC.match(str(error).strip())
    if numeric is not None:
        return f"{numeric['field']} must be a number"
    match = _EXPECTED.match(str(error).strip())
    if match is None:
        return None
    kind, found = match["kind"], match["cls"].rpartition(".")[2]
    wanted = _KINDS.get(kind, kind)
    quoted = " (write it without quotes)" if found == "str" and kind in ("int", "float") else ""
    value = repr(match["value"]) if found == "str" else match["value"]
    return f"{match['field']} must be {wanted}, got {value} (a {found}){quoted}"


def step_config_error(type_name: Any, keys: Iterable[str], error: BaseException) -> Optional[Refused]:
    """
    The one line for ``error``, raised while Tango constructed a step of type ``type_name`` from a
    config with ``keys``; ``None`` for another package's step or an error this does not recognise.
    """
    if not isinstance(type_name, str) or not type_name.startswith(PREFIX):
        return None
    try:
        step_class: Any = Step.resolve_class_name(type_name)[0]
    except ConfigurationError:
        return None
    options = _options(step_class)
    unknown = [key for key in keys if key != "type" and key not in options]
    if unknown:
        key = unknown[0]
        hint = did_you_mean(key, options) or f"its options are {', '.join(sorted(options))}"
        return Refused(f"ConfigurationError: {type_name}: {key} is not one of its options: {hint}")
    text = str(error).strip()
    typed = wrong_type(error)
    if typed is not None:
        return Refused(f"ConfigurationError: {type_name}: {typed}")
    if isinstance(error, ConfigurationError):
        lines = text.splitlines()
        return Refused(f"ConfigurationError: {type_name}: {lines[0] if lines else type(error).__name__}")
    return None
