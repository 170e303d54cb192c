"""``plot``: the metrics log of a training step (the ``fairscale::metrics`` callback) as a PNG."""

import argparse
from pathlib import Path
from typing import Any, List, Optional

from ..telemetry.metrics import METRIC_KINDS, METRICS_FILE_NAME, read_metrics
from ..telemetry.plotting import MAX_PANELS, metric_keys, panels_of, plot_metrics
from .common import UsageError


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


def add_parser(commands: "argparse._SubParsersAction[Any]") -> None:
    """The ``plot`` command's arguments."""
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


def run(args: argparse.Namespace) -> None:
    """``plot`` with the parsed ``args``."""
    plot_command(args.source, args.output, args.keys, args.max_panels)
