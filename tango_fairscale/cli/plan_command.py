"""``plan``: the wrap plan of a training step and its memory per worker, without training."""

import argparse
import math
from pathlib import Path
from typing import Any, List, Optional

from .. import output_paths
from ..checkpointing.placing import identity, place
from ..errors import CheckpointError
from ..finetune.pretrained import shapes_only
from ..plan import make_plan, parse_memory, render
from ..plan.preflight import plan_preflight
from .common import UsageError
from .tango_config import (
    import_packages,
    load_settings,
    parse_ext_vars,
    read_config,
    select_step,
    settings_environment,
    settings_path,
)

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
    # What the check found there (nothing, or an earlier plan JSON): all the write may replace.
    checked = identity(json_path) if json_path is not None else None
    variables = parse_ext_vars(ext_vars)
    found = settings_path(settings)
    tango_settings = load_settings(found)
    with settings_environment(tango_settings.environment):
        data = read_config(config, overrides, variables)
        packages = [(package, "-i") for package in includes]
        packages += [(package, f"include_package of {config}") for package in data.pop("include_package", [])]
        packages += [
            (package, f"include_package of {found}") for package in tango_settings.include_package or []
        ]
        import_packages(packages)
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
                old = place(
                    temporary,
                    json_path,
                    checked,
                    still_replaceable=output_paths.is_plan_json,
                    what="the plan's JSON",
                )
                if old is not None:
                    old.unlink()
            finally:
                temporary.unlink(missing_ok=True)
        except CheckpointError as error:
            raise UsageError(str(error)) from None
        except OSError as error:
            raise UsageError(f"cannot write --json {json_path}: {error.strerror or error}") from None


def add_parser(commands: "argparse._SubParsersAction[Any]") -> None:
    """The ``plan`` command's arguments."""
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


def run(args: argparse.Namespace) -> None:
    """``plan`` with the parsed ``args``."""
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
