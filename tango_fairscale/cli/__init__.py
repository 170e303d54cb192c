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

Each command is a module of this package (``consolidate``, ``plan_command``, ``plot``, ``peak``),
with its ``add_parser`` and ``run``; ``parser`` puts them together, and :func:`main` runs one.
"""

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

from tango.common.exceptions import ConfigurationError

from ..errors import CheckpointError
from ..launch.signals import StopSignal, stop_signals_raise
from . import consolidate, peak, plan_command, plot
from .common import UsageError, one_line
from .parser import build_parser, default_prog

__all__ = ["UsageError", "build_parser", "default_prog", "main"]

#: Each command's ``run``, by the name the parser gives it.
COMMANDS: Dict[str, Callable[[argparse.Namespace], None]] = {
    "consolidate": consolidate.run,
    "plan": plan_command.run,
    "plot": plot.run,
    "peak": peak.run,
}


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command of ``argv`` (default: ``sys.argv[1:]``); its exit status."""
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
        COMMANDS[args.command](args)
    except (UsageError, CheckpointError, ConfigurationError) as error:
        # Every line of the message, joined: some name the alternatives on a line of their own.
        print(f"error: {one_line(error, lines=50)}", file=sys.stderr)
        return 2
    return 0
