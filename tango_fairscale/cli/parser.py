"""The command line's parser: one subcommand per module of this package."""

import argparse
import sys
from pathlib import Path
from typing import NoReturn, Optional

from . import consolidate, peak, plan_command, plot


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
    """The parser of every command, ``prog`` (default: :func:`default_prog`) named in its usage."""
    parser = _Parser(
        prog=prog or default_prog(sys.argv[0] if sys.argv else ""),
        description="Tools for tango-fairscale runs and checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    consolidate.add_parser(commands)
    plan_command.add_parser(commands)
    plot.add_parser(commands)
    peak.add_parser(commands)
    return parser
