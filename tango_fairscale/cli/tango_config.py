"""Reading an experiment config the way ``tango run`` does: its settings file, overrides and packages."""

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .common import UsageError, one_line

TRAIN_STEP_TYPE = "torch::train"


def settings_path(explicit: Optional[Path]) -> Optional[Path]:
    """
    The Tango settings file ``tango run`` would read: ``--settings``, else ``tango.yml`` (or
    ``.yaml``) in the current directory, else in ``~/.config`` (``TangoGlobalSettings.default``).
    """
    if explicit is not None:
        if not explicit.is_file():
            raise UsageError(f"--settings {explicit}: no such file")
        return explicit
    for directory in (Path("."), Path.home() / ".config"):
        for extension in ("yml", "yaml"):
            candidate = directory / f"tango.{extension}"
            if candidate.is_file():
                return candidate
    return None


def load_settings(path: Optional[Path]) -> Any:
    """The ``TangoGlobalSettings`` of ``path`` (the defaults when ``None``)."""
    from tango.settings import TangoGlobalSettings

    if path is None:
        return TangoGlobalSettings()
    try:
        return TangoGlobalSettings.from_file(path)
    except Exception as error:  # noqa: BLE001 - YAML and FromParams raise many kinds; all mean "bad file"
        raise UsageError(f"cannot read Tango settings {path}: {one_line(error)}") from None


@contextlib.contextmanager
def settings_environment(environment: Optional[Dict[str, str]]) -> Iterator[None]:
    """
    Set the settings' ``environment`` variables as ``tango run`` does (skipping, with the same
    warning, the names Tango reserves), and restore the previous values afterwards, so that
    calling :func:`main` in-process leaves the caller's environment as it was.
    """
    from tango.common.aliases import EnvVarNames

    blocked = EnvVarNames.values()
    previous: Dict[str, Optional[str]] = {}
    try:
        for key, value in (environment or {}).items():
            if key in blocked:
                warnings.warn(
                    f"Ignoring environment variable '{key}' from settings file. "
                    "Please use the corresponding settings field instead.",
                    UserWarning,
                    stacklevel=2,
                )
                continue
            previous.setdefault(key, os.environ.get(key))
            os.environ[key] = str(value)
        yield
    finally:
        for key, old in previous.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def parse_ext_vars(ext_vars: List[str]) -> Dict[str, str]:
    variables = {}
    for item in ext_vars:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--ext-var takes KEY=VALUE, got {item!r}")
        variables[key] = value
    return variables


def read_config(config: Path, overrides: Optional[str], ext_vars: Dict[str, str]) -> Dict[str, Any]:
    """The experiment config as a dict, with ``overrides`` applied as ``tango run -o`` applies them."""
    from tango.common import Params
    from tango.common.params import parse_overrides, with_overrides

    if not config.exists():
        raise UsageError(f"config file {config} does not exist")
    if config.is_dir():
        raise UsageError(f"{config} is a directory, not a config file")
    try:
        data = Params.from_file(config, ext_vars=ext_vars).as_dict(quiet=True)
    except Exception as error:  # noqa: BLE001 - jsonnet, JSON and YAML each raise their own errors
        raise UsageError(f"cannot read config {config}: {one_line(error)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("steps"), dict):
        raise UsageError(f"{config} is not a Tango experiment config: it has no 'steps' object")
    if overrides:
        # Tango's own functions, in the order Params.from_file uses them, so that an override
        # means exactly what it means to `tango run -o`.
        try:
            data = with_overrides(data, parse_overrides(overrides, ext_vars=ext_vars))
        except Exception as error:  # noqa: BLE001 - jsonnet syntax (RuntimeError) or unused keys (ValueError)
            raise UsageError(f"-o/--overrides {overrides!r}: {one_line(error)}") from None
    return data


def import_packages(packages: List[Tuple[str, str]]) -> None:
    from tango.common.util import import_extra_module

    for package, source in packages:
        try:
            import_extra_module(package)
        except (ImportError, ValueError) as error:  # ValueError: a path-like name that does not exist
            raise UsageError(f"cannot import package {package!r} ({source}): {one_line(error, 1)}") from None


def select_step(config: Path, steps: Dict[str, Any], step_name: Optional[str]) -> Tuple[str, Dict[str, Any]]:
    """The ``torch::train`` step to plan: ``step_name``, or the config's only one."""
    train_steps = {
        name: step
        for name, step in steps.items()
        if isinstance(step, dict) and step.get("type") == TRAIN_STEP_TYPE
    }
    if step_name is not None:
        if step_name not in steps:
            raise UsageError(f"--step {step_name!r}: no such step in {config}; its steps: {sorted(steps)}")
        if step_name not in train_steps:
            step = steps[step_name]
            kind = step.get("type") if isinstance(step, dict) else type(step).__name__
            raise UsageError(
                f"--step {step_name!r} is a {kind!r} step, not a {TRAIN_STEP_TYPE} step; "
                f"the training steps of {config}: {sorted(train_steps)}"
            )
        return step_name, train_steps[step_name]
    if len(train_steps) != 1:
        raise UsageError(
            f"{config} has {len(train_steps)} {TRAIN_STEP_TYPE} steps ({sorted(train_steps)}): "
            "choose one with --step"
        )
    return next(iter(train_steps.items()))
