"""
``python -m tango_fairscale`` (also installed as ``tango-fairscale``).

Commands:

- ``consolidate CHECKPOINT_DIR OUT.pt [--optimizer] [--force]``: one full state dict from a
  sharded checkpoint, with no process group and no GPU; ``--format hf --hf-config DIR`` writes
  ``OUT`` as a directory ``transformers``' ``from_pretrained`` loads instead. ``--force``
  replaces an earlier output of ``consolidate`` only (:mod:`tango_fairscale.output_paths`).
- ``plan CONFIG [--step NAME] [--world-size N] [-o OVERRIDES] [--settings FILE]
  [--sequence-length N | --sample-data] [--device-memory 80GiB]``: the wrap plan of a training
  step, the model state each worker will hold and its peak in a training step (and whether it
  fits), without training.
- ``plot WORK_DIR_OR_METRICS_FILE [-o OUT.png] [--keys loss,...]``: a PNG of the metrics log
  that the ``fairscale::metrics`` callback wrote.
- ``peak [--dtype float32] [--threads N] [--seconds S]``: this machine's matmul FLOP/s, the peak
  that MFU on CPU workers is measured against.

A bad argument ends the command with one ``error: ...`` line on stderr and exit status 2.
"""

import argparse
import contextlib
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, NoReturn, Optional, Tuple

from tango.common.exceptions import ConfigurationError
from tqdm import tqdm

from .. import checkpointing, output_paths
from ..backends.base import ADAPTER_FIELD
from ..checkpointing import consolidation
from ..errors import CheckpointError
from ..finetune.hf_export import (
    export_hf,
    export_merged_adapter,
    export_peft_adapter,
    model_class_of,
    model_source_tensors,
)
from ..finetune.pretrained import shapes_only
from ..launch.signals import StopSignal, stop_signals_raise
from ..plan import make_plan, parse_memory, render
from ..plan.preflight import plan_preflight
from ..telemetry.metrics import METRIC_KINDS, METRICS_FILE_NAME, read_metrics
from ..telemetry.plotting import MAX_PANELS, metric_keys, panels_of, plot_metrics

TRAIN_STEP_TYPE = "torch::train"


class UsageError(Exception):
    """A bad command-line argument: reported as one ``error:`` line, with exit status 2."""


def _one_line(error: BaseException, lines: int = 2) -> str:
    # Parser errors (jsonnet, YAML) span several lines, the second usually the location: keep
    # both on one line, so the command's error stays a single line.
    parts = [line.strip() for line in str(error).splitlines() if line.strip()][:lines]
    return "; ".join(parts) or type(error).__name__


def check_output(
    output: Path, kind: str, checkpoint_dir: Path, given: Path, *, force: bool
) -> Optional[Path]:
    """
    Raise unless ``consolidate`` may write ``output`` (:func:`tango_fairscale.output_paths.check_output`:
    a new path, or with ``force`` an earlier output of the same kind) from ``checkpoint_dir``, the
    checkpoint ``given`` resolved to. Returns the work directory ``given`` was, if it was one.
    """
    work_dir = given if given.resolve() != checkpoint_dir.resolve() else None
    output_paths.check_output(
        output, kind, replace=force, work_dir=work_dir, sources=[checkpoint_dir], running_step=False
    )
    return work_dir


def consolidate_hf(
    checkpoint_dir: Path,
    output: Path,
    hf_config: Optional[Path],
    *,
    force: bool = False,
    merge: bool = False,
) -> None:
    """
    Write the model of ``checkpoint_dir`` as a directory ``from_pretrained`` loads, with the
    config (and tokenizer files) of ``hf_config``: one tensor at a time, atomically. A checkpoint
    of a peft model (its marker records the adapter's config) is written as the adapter directory
    ``PeftModel.from_pretrained(base, output)`` loads, ``hf_config`` being the base model's
    directory; with ``merge``, as the base model with the adapter merged into it.
    """
    checkpoint_dir, output = Path(checkpoint_dir), Path(output)
    if hf_config is None:
        raise UsageError(
            "--format hf needs --hf-config DIR, a directory with the model's config.json "
            "(e.g. the pretrained model it was fine-tuned from)"
        )
    if not (Path(hf_config) / "config.json").is_file():
        given = Path(hf_config)
        found = (
            "does not exist"
            if not given.exists()
            else "is a file"
            if given.is_file()
            else "holds no config.json"
        )
        raise UsageError(
            f"--hf-config {hf_config} {found}: give the directory of the model's config.json "
            "(e.g. the pretrained model it was fine-tuned from)"
        )
    if not checkpoint_dir.exists():
        raise UsageError(f"checkpoint directory {checkpoint_dir} does not exist")
    given, checkpoint_dir = checkpoint_dir, checkpointing.resolve_checkpoint(checkpoint_dir)
    work_dir = check_output(output, output_paths.HF_EXPORT, checkpoint_dir, given, force=force)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_config))
    source = model_source_tensors(consolidation.model_source(checkpoint_dir))
    adapter = (checkpointing.read_marker(checkpoint_dir) or {}).get(ADAPTER_FIELD)
    if merge and adapter is None:
        raise UsageError(f"--merge is for the checkpoint of a peft model; {checkpoint_dir} is not one")
    try:
        if adapter is not None:
            _consolidate_adapter(
                source, output, config, adapter, Path(hf_config), merge, work_dir, checkpoint_dir
            )
            return
        export_hf(
            source,
            output,
            config,
            tokenizer_from=Path(hf_config),
            work_dir=work_dir,
            sources=[checkpoint_dir],
        )
    except OSError as error:
        raise UsageError(f"cannot write {output}: {error.strerror or error}") from None
    except Exception as error:  # noqa: BLE001 - a base of another model: peft's or the export's words, one line
        mismatch = type(error).__module__.startswith("peft") or "not of this model class" in str(error)
        if not mismatch:
            raise
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UsageError(
            f"--hf-config {hf_config} is not the model the checkpoint trained ({type(error).__name__}: "
            f"{first}): give the directory of its base model's config.json"
        ) from None
    print(f"Wrote {output} (from_pretrained loads it)")


def _consolidate_adapter(
    source: Any,
    output: Path,
    config: Any,
    adapter: Dict[str, Any],
    base_directory: Path,
    merge: bool,
    work_dir: Optional[Path],
    checkpoint_dir: Path,
) -> None:
    """:func:`consolidate_hf` of a peft model's checkpoint: the adapter directory, or the merged model."""
    import tempfile

    import torch
    from peft import PeftConfig, get_peft_model

    # The adapter's names come from peft, asked with the model's skeleton (on meta: no memory).
    with torch.device("meta"):
        skeleton = get_peft_model(model_class_of(config)(config), PeftConfig.from_peft_type(**adapter))
    try:
        if not merge:
            export_peft_adapter(
                source,
                output,
                skeleton,
                base_directory=base_directory,
                work_dir=work_dir,
                sources=[checkpoint_dir],
            )
            print(f"Wrote {output} (PeftModel.from_pretrained(base, {output}) loads it)")
            return
        output_paths.check_output(
            output, output_paths.HF_EXPORT, work_dir=work_dir, sources=[checkpoint_dir], running_step=False
        )
        with tempfile.TemporaryDirectory(prefix=".adapter-", dir=Path(output).resolve().parent) as scratch:
            adapter_dir = Path(scratch) / "adapter"
            export_peft_adapter(source, adapter_dir, skeleton, base_directory=base_directory)
            export_merged_adapter(adapter_dir, output, work_dir=work_dir, sources=[checkpoint_dir])
    except OSError as error:
        raise UsageError(f"cannot write {output}: {error.strerror or error}") from None
    print(f"Wrote {output} (the base with the adapter merged; from_pretrained loads it)")


def consolidate(
    checkpoint_dir: Path, output: Path, *, with_optimizer: bool = False, force: bool = False
) -> None:
    """
    Write the full (unsharded) model state dict of ``checkpoint_dir`` to ``output``; with
    ``with_optimizer``, write ``{"model": ..., "optimizer": ...}`` instead, the optimizer state
    keyed by parameter name. ``output`` must be a new path, or with ``force`` a file an earlier
    ``consolidate`` wrote (:mod:`tango_fairscale.output_paths`).
    """
    checkpoint_dir, output = Path(checkpoint_dir), Path(output)
    if not checkpoint_dir.exists():
        raise UsageError(f"checkpoint directory {checkpoint_dir} does not exist")
    given, checkpoint_dir = checkpoint_dir, checkpointing.resolve_checkpoint(checkpoint_dir)
    check_output(output, output_paths.CONSOLIDATED, checkpoint_dir, given, force=force)
    marker = checkpointing.read_marker(checkpoint_dir)
    assert marker is not None  # resolve_checkpoint checked that the checkpoint is complete
    world_size = marker["world_size"]
    if with_optimizer:
        # The optimizer state is consolidated whole (it is only read offline, for inspection).
        total = consolidation.files_to_read(marker, with_optimizer)
        with tqdm(total=total, desc="Reading shards", unit="file") as progress:
            result = consolidation.consolidate(
                checkpoint_dir, with_optimizer=with_optimizer, progress=lambda: progress.update()
            )
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            consolidation.save_consolidated(result, output)
        except OSError as error:
            raise UsageError(f"cannot write {output}: {error.strerror or error}") from None
        shapes = [tuple(t.shape) for t in result["model"].values()]
    else:
        # The model one tensor at a time: no more memory than its largest tensor.
        source = consolidation.model_source(checkpoint_dir)
        tensors = [entry for entry in source.entries if entry.alias_of is None]
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            with tqdm(total=len(tensors), desc="Writing tensors", unit="tensor") as progress:
                consolidation.save_model(source, output, progress=lambda: progress.update())
        except OSError as error:
            raise UsageError(f"cannot write {output}: {error.strerror or error}") from None
        shapes = [entry.shape for entry in source.entries]
    numel = sum(math.prod(shape) for shape in shapes)
    print(
        f"Wrote {output} from {world_size} shards of {checkpoint_dir}: {len(shapes)} tensors, "
        f"{numel:,} elements{', with optimizer state' if with_optimizer else ''}."
    )


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
        raise UsageError(f"cannot read Tango settings {path}: {_one_line(error)}") from None


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


def _parse_ext_vars(ext_vars: List[str]) -> Dict[str, str]:
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
        raise UsageError(f"cannot read config {config}: {_one_line(error)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("steps"), dict):
        raise UsageError(f"{config} is not a Tango experiment config: it has no 'steps' object")
    if overrides:
        # Tango's own functions, in the order Params.from_file uses them, so that an override
        # means exactly what it means to `tango run -o`.
        try:
            data = with_overrides(data, parse_overrides(overrides, ext_vars=ext_vars))
        except Exception as error:  # noqa: BLE001 - jsonnet syntax (RuntimeError) or unused keys (ValueError)
            raise UsageError(f"-o/--overrides {overrides!r}: {_one_line(error)}") from None
    return data


def _import_packages(packages: List[Tuple[str, str]]) -> None:
    from tango.common.util import import_extra_module

    for package, source in packages:
        try:
            import_extra_module(package)
        except (ImportError, ValueError) as error:  # ValueError: a path-like name that does not exist
            raise UsageError(f"cannot import package {package!r} ({source}): {_one_line(error, 1)}") from None


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


#: The plan's numeric options, their ranges: beyond them an estimate means nothing (a world larger
#: than any the suggestions try) or overflows (a sequence of 10^9 tokens).
MAX_WORLD_SIZE = 65_536
MAX_SEQUENCE_LENGTH = 1 << 20
MAX_OPTIMIZER_STATES = 64
#: ``--device-memory``'s range: 1 MiB to 1 PiB.
DEVICE_MEMORY_RANGE = (1 << 20, 1 << 50)


def whole_number(low: int, high: int) -> Any:
    """An argparse ``type``: a whole number from ``low`` to ``high``, else one line saying so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a whole number from {low} to {high}, got {text!r}")
        return value

    return parse


def check_plan_numbers(
    world_size: Optional[int], sequence_length: Optional[int], optimizer_states: Optional[float]
) -> None:
    """``plan``'s numeric options within their ranges (the parser checks them too, for the command line)."""
    for flag, value, high in (
        ("--world-size", world_size, MAX_WORLD_SIZE),
        ("--sequence-length", sequence_length, MAX_SEQUENCE_LENGTH),
    ):
        if value is not None and not (isinstance(value, int) and 1 <= value <= high):
            raise UsageError(f"argument {flag}: must be a whole number from 1 to {high}, got {str(value)!r}")
    if optimizer_states is not None and not (0 <= optimizer_states <= MAX_OPTIMIZER_STATES):
        raise UsageError(
            f"argument --optimizer-states: must be a number from 0 to {MAX_OPTIMIZER_STATES}, "
            f"got {str(optimizer_states)!r}"
        )


def optimizer_states_number(text: str) -> float:
    """An argparse ``type`` for ``--optimizer-states``: a number from 0 to :data:`MAX_OPTIMIZER_STATES`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_OPTIMIZER_STATES:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number from 0 to {MAX_OPTIMIZER_STATES}, got {text!r}")
    return value


def device_memory_bytes(text: str) -> int:
    """``--device-memory`` in bytes, within :data:`DEVICE_MEMORY_RANGE`; else one line saying so."""
    low, high = DEVICE_MEMORY_RANGE
    try:
        memory = parse_memory(text)
    except ValueError as error:
        raise UsageError(f"argument --device-memory: {error}, from 1MiB to 1PiB") from None
    if not low <= memory <= high:
        raise UsageError(f"argument --device-memory: must be from 1MiB to 1PiB, got {text!r}")
    return memory


def plan_command(
    config: Path,
    step_name: Optional[str],
    world_size: Optional[int],
    includes: List[str],
    ext_vars: List[str],
    json_path: Optional[Path],
    overrides: Optional[str] = None,
    settings: Optional[Path] = None,
    *,
    sequence_length: Optional[int] = None,
    sample_data: bool = False,
    device_memory: Optional[str] = None,
    optimizer_states: Optional[float] = None,
    device: Optional[str] = None,
) -> None:
    """
    Print the wrap plan of a training step and its estimated peak per worker (and write it as
    JSON with ``json_path``). The config is read the way ``tango run`` reads it: the settings
    file's ``environment`` is set first (jsonnet sees it through ``std.extVar``), then the config
    with ``--ext-var`` and ``-o`` overrides, then the packages of ``-i``, the config and the
    settings are imported. The other arguments are :func:`~tango_fairscale.plan.make_plan`'s.
    """
    # The arguments that need nothing loaded are checked first: a typo costs no model build.
    check_plan_numbers(world_size, sequence_length, optimizer_states)
    memory = device_memory_bytes(device_memory) if device_memory is not None else None
    if json_path is not None:
        # Before any work: it replaces only a plan JSON of its own (output_paths' one rule).
        try:
            output_paths.check_output(json_path, output_paths.PLAN_JSON, label="--json")
        except CheckpointError as error:
            raise UsageError(str(error)) from None
    variables = _parse_ext_vars(ext_vars)
    found = settings_path(settings)
    tango_settings = load_settings(found)
    with settings_environment(tango_settings.environment):
        data = read_config(config, overrides, variables)
        packages = [(package, "-i") for package in includes]
        packages += [(package, f"include_package of {config}") for package in data.pop("include_package", [])]
        packages += [
            (package, f"include_package of {found}") for package in tango_settings.include_package or []
        ]
        _import_packages(packages)
        name, step = select_step(config, data["steps"], step_name)
        # What `tango run` refuses before its workers start, refused here with the same line; a
        # pretrained directory of a config.json alone is what plan is for, and passes (shapes_only).
        with shapes_only():
            plan_preflight(name, data["steps"], world_size, device=device, sample_data=sample_data)
        plan = make_plan(
            name,
            step,
            world_size,
            steps=data["steps"],
            sequence_length=sequence_length,
            sample_data=sample_data,
            device_memory=memory,
            optimizer_states=optimizer_states,
            device=device,
        )
    print(render(plan))
    if json_path is not None:
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            output_paths.check_output(
                json_path, output_paths.PLAN_JSON, label="--json"
            )  # again: the plan took a while
            output_paths.remove_stale_temporaries(json_path)
            temporary = output_paths.temporary_sibling(json_path)
            try:
                temporary.write_text(output_paths.plan_json(plan.as_dict()))
                os.replace(temporary, json_path)
            finally:
                temporary.unlink(missing_ok=True)
        except CheckpointError as error:
            raise UsageError(str(error)) from None
        except OSError as error:
            raise UsageError(f"cannot write --json {json_path}: {error.strerror or error}") from None


def find_metrics_file(source: Path) -> Path:
    """
    The metrics file of ``source``: the file itself, or ``metrics.jsonl`` in a work directory
    (or in its ``work`` subdirectory, for a step's directory such as ``WORKSPACE/latest/train``).
    """
    if not source.exists():
        raise UsageError(f"{source} does not exist")
    if source.is_file():
        return source
    for candidate in (source / METRICS_FILE_NAME, source / "work" / METRICS_FILE_NAME):
        if candidate.is_file():
            return candidate
    raise UsageError(
        f"no {METRICS_FILE_NAME} in {source}: add the callback to the torch::train step "
        '(callbacks: [{type: "fairscale::metrics"}]) and give its work directory'
    )


def _short_name(metrics_file: Path) -> str:
    # The plot's title: the step's directory and the file, not a long absolute path that the
    # figure would cut off.
    parts = metrics_file.resolve().parts
    return "/".join(parts[-3:] if len(parts) >= 3 and parts[-2] == "work" else parts[-2:])


def plot_command(
    source: Path, output: Optional[Path], keys: Optional[str], max_panels: int = MAX_PANELS
) -> None:
    """Draw the metrics log of ``source`` (a work directory or a metrics file) into a PNG file."""
    # The arguments that need no file read are checked first.
    if output is not None:
        if output.is_dir():
            raise UsageError(f"-o {output} is a directory: give the path of the .png file to write")
        if output.suffix.lower() != ".png":
            raise UsageError(f"-o {output}: the plot is a PNG image, give a file name ending in .png")
    wanted: Optional[List[str]] = None
    if max_panels < 1:
        raise UsageError(f"--max-panels must be at least 1, got {max_panels}")
    if keys is not None:
        wanted = [key.strip() for key in keys.split(",") if key.strip()]
        if not wanted:
            raise UsageError(f"--keys {keys!r} names no metric: give a comma-separated list, e.g. loss,lr")
    metrics_file = find_metrics_file(source)
    try:
        lines, skipped = read_metrics(metrics_file)
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {metrics_file}: {getattr(error, 'strerror', None) or error}") from None
    available = metric_keys(lines)
    if not available:
        raise UsageError(
            f"{metrics_file} has no metrics lines{f' ({skipped} unreadable)' if skipped else ''}"
        )
    if wanted is None:
        wanted = available
    else:
        unknown = [key for key in wanted if key not in available]
        if unknown:
            raise UsageError(
                f"--keys: no metric {', '.join(unknown)} in {metrics_file}; it has: {', '.join(available)}"
            )
    output = output if output is not None else metrics_file.with_suffix(".png")
    steps = [line["step"] for line in lines if line.get("kind", "train") in METRIC_KINDS]
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        panels = plot_metrics(
            lines,
            wanted,
            output,
            title=f"{_short_name(metrics_file)}, steps {min(steps)}-{max(steps)}",
            max_panels=max_panels,
        )
    except ImportError:
        raise UsageError(
            "plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or install tango-fairscale with its [benchmarks] extra)"
        ) from None
    except OSError as error:
        raise UsageError(f"cannot write {output}: {error.strerror or error}") from None
    note = f"; skipped {skipped} unreadable line{'s' if skipped != 1 else ''}" if skipped else ""
    left_out = [name for name in panels_of(wanted) if name not in panels]
    if left_out:
        shown = ", ".join(left_out[:10]) + (f" and {len(left_out) - 10} more" if len(left_out) > 10 else "")
        note += (
            f"; left out {len(left_out)} panel{'s' if len(left_out) != 1 else ''} past --max-panels "
            f"{max_panels} ({shown}): choose with --keys"
        )
    summary = f"{len(panels)} panels ({', '.join(panels)}) from {len(lines)} lines of {metrics_file}"
    print(f"Wrote {output}: {summary}{note}.")


def peak_command(dtype_name: str, threads: Optional[int], seconds: float) -> None:
    """Print the FLOP/s of a square matmul on this process's threads (what CPU workers measure)."""
    import torch

    from ..config import parse_dtype
    from ..telemetry.peaks import measure_cpu_peak

    if threads is not None:
        if threads < 1:
            raise UsageError(f"--threads must be 1 or more, got {threads}")
        torch.set_num_threads(threads)
    if not seconds > 0:
        raise UsageError(f"--seconds must be positive, got {seconds}")
    try:
        dtype = parse_dtype("--dtype", dtype_name)
    except ConfigurationError:
        dtype = None
    if dtype is None:
        raise UsageError(f"--dtype {dtype_name!r} is not a dtype: use e.g. float32, bfloat16 or float16")
    peak = measure_cpu_peak(dtype, seconds=seconds)
    if peak.flops_per_second is None:
        raise UsageError(peak.source)
    print(f"peak: {peak.flops_per_second / 1e9:.1f} GFLOP/s ({peak.source})")


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors as the one ``error:`` line every other bad argument gets."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def default_prog(argv0: str) -> str:
    """``python -m tango_fairscale`` when run as a module, else the console script's name."""
    path = Path(argv0)
    if path.name == "__main__.py" and path.parent.name == "tango_fairscale":
        return "python -m tango_fairscale"
    # The console script (tango-fairscale, tango-fairscale.exe); any other caller of main(),
    # e.g. a test runner, gets the installed command's name rather than its own.
    return path.name if path.name.startswith("tango-fairscale") else "tango-fairscale"


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog or default_prog(sys.argv[0] if sys.argv else ""),
        description="Tools for tango-fairscale runs and checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    consolidate_parser = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint into one full state dict",
        description="Turn a sharded checkpoint (or a step's work directory: its latest checkpoint) "
        "into one full state dict that loads into the plain model. Needs no process group and no GPU.",
    )
    consolidate_parser.add_argument(
        "checkpoint_dir", type=Path, help="checkpoint_state_step<N> directory or work dir"
    )
    consolidate_parser.add_argument(
        "output",
        type=Path,
        help="the .pt file to write, or with --format hf the directory (not inside a checkpoint directory)",
    )
    consolidate_parser.add_argument(
        "--optimizer",
        action="store_true",
        help='also consolidate the optimizer state; the file is then {"model": ..., "optimizer": ...}',
    )
    consolidate_parser.add_argument(
        "--force",
        action="store_true",
        help="replace an output an earlier consolidate wrote (of the same --format); any other existing "
        "path is refused",
    )
    consolidate_parser.add_argument(
        "--format",
        choices=["pt", "hf"],
        default="pt",
        help="pt: one torch.save'd state dict (default); hf: OUTPUT is a directory that transformers' "
        "from_pretrained loads (config.json, safetensors, tokenizer files), with --hf-config",
    )
    consolidate_parser.add_argument(
        "--hf-config",
        type=Path,
        default=None,
        help="with --format hf: the directory of the model's config.json (e.g. the pretrained model "
        "it was fine-tuned from); its tokenizer files are copied too. For a peft (LoRA) model's "
        "checkpoint OUTPUT is the adapter directory, and this is the base model's directory",
    )
    consolidate_parser.add_argument(
        "--merge",
        action="store_true",
        help="with --format hf, for a peft (LoRA) model's checkpoint: write the base model with the "
        "adapter merged into it (from_pretrained loads it) instead of the adapter directory",
    )

    plan_parser = commands.add_parser(
        "plan",
        help="show the FSDP wrap plan of a training step and its memory per worker, without training",
        description="Build the model of a torch::train step (on the meta device where possible, else on the "
        "CPU) and print each FSDP unit with its parameter count, whether it is checkpointed, and the "
        "estimated per-worker bytes of parameters, gradients and optimizer state beside DDP's; then one "
        "worker's peak in a training step, measured by running the model on fake tensors (no memory) on "
        "a batch of the config's shape, with and without activation checkpointing, and, with "
        "--device-memory, whether it fits and what to change if not. "
        "Needs no process group and no GPU. The config is read as `tango run` reads it, with the "
        "tango.yml of the current directory (or ~/.config, or --settings).",
    )
    plan_parser.add_argument(
        "config", type=Path, help="the Tango experiment config (.jsonnet, .json or .yml)"
    )
    plan_parser.add_argument("--step", help="the step to plan (default: the config's only torch::train step)")
    plan_parser.add_argument(
        "--world-size",
        type=whole_number(1, MAX_WORLD_SIZE),
        help=f"number of workers, 1 to {MAX_WORLD_SIZE} (default: the step's device_count)",
    )
    plan_parser.add_argument(
        "-i", "--include-package", action="append", default=[], help="a module to import (repeatable)"
    )
    plan_parser.add_argument(
        "-o",
        "--overrides",
        help="a JSON(NET) string overriding fields of the config, dotted keys for nested fields, "
        "as for `tango run -o`, e.g. '{\"steps.train.device_count\": 4}'",
    )
    plan_parser.add_argument(
        "-D", "--ext-var", action="append", default=[], help="a jsonnet external variable KEY=VALUE"
    )
    plan_parser.add_argument(
        "--settings", type=Path, help="the Tango settings file (default: tango.yml as `tango run` finds it)"
    )
    plan_parser.add_argument(
        "--json", type=Path, dest="json_path", help="also write the plan as JSON to this file"
    )
    plan_parser.add_argument(
        "--sequence-length",
        type=whole_number(1, MAX_SEQUENCE_LENGTH),
        help=f"tokens per example of a language model's batch, 1 to {MAX_SEQUENCE_LENGTH} "
        "(default: tokenize_text's block_size)",
    )
    plan_parser.add_argument(
        "--sample-data",
        action="store_true",
        help="run the data step (and the steps it reads) here for one batch's shapes",
    )
    plan_parser.add_argument(
        "--device-memory",
        help="judge the peak per worker against this memory per device, e.g. 80GiB (or 80G), 80GB, 24000MiB "
        "(1MiB to 1PiB)",
    )
    plan_parser.add_argument(
        "--optimizer-states",
        type=optimizer_states_number,
        help=f"optimizer state tensors per parameter (0 to {MAX_OPTIMIZER_STATES}), for an optimizer whose "
        "state cannot be measured",
    )
    plan_parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="the workers' device (default: cuda where this machine has a GPU): which optimizer and AMP "
        "implementations run",
    )

    plot_parser = commands.add_parser(
        "plot",
        help="draw the metrics log of a training step (the fairscale::metrics callback) as a PNG",
        description="Draw the metrics.jsonl that the fairscale::metrics callback writes into a training "
        "step's work directory: one panel per metric over the steps, a metric's validation values in its "
        "panel. Needs matplotlib.",
    )
    plot_parser.add_argument("source", type=Path, help="the step's work directory, or a metrics .jsonl file")
    plot_parser.add_argument(
        "-o",
        "--output",
        type=Path,
        help="the .png file to write (default: the metrics file's path with .png, e.g. metrics.png)",
    )
    plot_parser.add_argument(
        "--keys", help="comma-separated metrics to draw, in this order (default: all), e.g. loss,val_loss,lr"
    )
    plot_parser.add_argument(
        "--max-panels",
        type=int,
        default=MAX_PANELS,
        help=f"the most panels to draw (default {MAX_PANELS}); the output says which were left out",
    )

    peak_parser = commands.add_parser(
        "peak",
        help="measure this machine's matmul FLOP/s, the peak of MFU on CPU workers",
        description="Time a square matmul on this process's threads and print the best FLOP/s, as CPU "
        "training workers measure their peak for MFU once per run (the metrics log's run line).",
    )
    peak_parser.add_argument("--dtype", default="float32", help="the matmul's dtype (default float32)")
    peak_parser.add_argument("--threads", type=int, help="torch threads (default: torch's, all cores)")
    peak_parser.add_argument(
        "--seconds", type=float, default=2.0, help="how long to repeat the matmul (default 2)"
    )
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    output = Path(args.output) if args.command == "consolidate" else None
    try:
        with stop_signals_raise(), _new_directories_removed_on_failure(output):
            return _run_command(args)
    except StopSignal as stopped:
        # One line and 128 + the signal, as a shell reports it; the writers removed their
        # temporaries (and the directories made for the output are gone), so nothing is left.
        written = f": nothing written at {output}; run the same command again" if output else ""
        print(f"error: {args.command} stopped by {stopped.describe()}{written}.", file=sys.stderr)
        return stopped.exit_status


@contextlib.contextmanager
def _new_directories_removed_on_failure(output: Optional[Path]) -> Iterator[None]:
    """
    The directories above ``output`` that writing it creates (``consolidate`` makes them), removed
    again, innermost first and only while empty, if the command stops or fails before it wrote.
    """
    missing: List[Path] = []
    parent = output.absolute().parent if output is not None else None
    while parent is not None and not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    try:
        yield
    except BaseException:
        for directory in missing:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


def _run_command(args: argparse.Namespace) -> int:
    """The command ``args`` names; its errors are one ``error:`` line and exit status 2."""
    try:
        if args.command == "consolidate" and args.format == "hf":
            if args.optimizer:
                raise UsageError("--optimizer has no place in a --format hf directory: leave one of them out")
            consolidate_hf(
                args.checkpoint_dir, args.output, args.hf_config, force=args.force, merge=args.merge
            )
        elif args.command == "consolidate":
            if args.hf_config is not None or args.merge:
                raise UsageError(
                    f"{'--hf-config' if args.hf_config is not None else '--merge'} goes with --format hf"
                )
            consolidate(args.checkpoint_dir, args.output, with_optimizer=args.optimizer, force=args.force)
        elif args.command == "plan":
            plan_command(
                args.config,
                args.step,
                args.world_size,
                args.include_package,
                args.ext_var,
                args.json_path,
                overrides=args.overrides,
                settings=args.settings,
                sequence_length=args.sequence_length,
                sample_data=args.sample_data,
                device_memory=args.device_memory,
                optimizer_states=args.optimizer_states,
                device=args.device,
            )
        elif args.command == "plot":
            plot_command(args.source, args.output, args.keys, args.max_panels)
        elif args.command == "peak":
            peak_command(args.dtype, args.threads, args.seconds)
    except (UsageError, CheckpointError, ConfigurationError) as error:
        # Every line of the message, joined: some name the alternatives on a line of their own.
        print(f"error: {_one_line(error, lines=50)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
