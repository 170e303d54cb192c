"""
Run the same ``tango run`` N times, each in a fresh workspace, and count the exit codes.

For failures that happen now and then (a worker aborting at exit, a race at start-up): one run
proves nothing, fifty in a row do. Each run gets a free ``distributed_port`` (``-o``), so runs do
not depend on the previous one's port being released. A run counts as good only when it exits 0
*and* wrote its ``weights.pt``; for each bad run the last lines of its output are kept.

    python scripts/repeat_run.py scripts/configs/tied_lm.jsonnet -n 50 -D backend=torch \\
        -i tango_fairscale -i tests.components

Prints one line per run and a summary (``exit codes: {0: 50}``); exits 1 if any run was bad.
Standard library only, so that it runs against any environment's ``tango`` (``--tango``).
"""

import argparse
import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="the experiment's config (jsonnet, json or yaml)")
    parser.add_argument("-n", "--runs", type=int, default=10, help="how many runs (default 10)")
    parser.add_argument("-i", "--include-package", action="append", default=[], help="passed to tango run")
    parser.add_argument("-D", "--ext-var", action="append", default=[], help="passed to tango run")
    parser.add_argument("--step", default="train", help="the torch::train step's name (default train)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run (default 300)")
    parser.add_argument(
        "--keep", type=Path, help="keep each bad run's workspace and output under this directory"
    )
    parser.add_argument(
        "--tango", default=str(Path(sys.executable).with_name("tango")), help="the tango command to run"
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if not args.config.is_file():
        parser.error(f"no config file at {args.config}")
    return args


@dataclass
class Outcome:
    """One run: its exit code (or ``"timeout"``), whether it wrote ``weights.pt``, and its output."""

    code: object
    weights: bool
    seconds: float
    output: str

    @property
    def good(self) -> bool:
        return self.code == 0 and self.weights


def one_run(args: argparse.Namespace, workspace: Path) -> Outcome:
    command = [args.tango, "run", str(args.config.resolve()), "-w", str(workspace)]
    command += ["-o", json.dumps({f"steps.{args.step}.distributed_port": free_port()})]
    for package in args.include_package:
        command += ["-i", package]
    for variable in args.ext_var:
        command += ["-D", variable]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    started = time.monotonic()
    try:
        result = subprocess.run(
            command, cwd=workspace, env=env, capture_output=True, text=True, timeout=args.timeout
        )
        code: object = result.returncode
        output = result.stdout + result.stderr
    except subprocess.TimeoutExpired as error:
        code = "timeout"
        output = (error.stdout or b"").decode(errors="replace") + (error.stderr or b"").decode(
            errors="replace"
        )
    weights = list(workspace.glob("cache/TorchTrainStep-*/work/weights.pt"))
    return Outcome(code, bool(weights), time.monotonic() - started, output)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    codes: collections.Counter = collections.Counter()
    bad: List[int] = []
    for index in range(1, args.runs + 1):
        workspace = Path(tempfile.mkdtemp(prefix="repeat_run_"))
        try:
            outcome = one_run(args, workspace)
            codes[outcome.code] += 1
            print(
                f"run {index}/{args.runs}: exit {outcome.code}, weights.pt "
                f"{'written' if outcome.weights else 'MISSING'}, {outcome.seconds:.1f} s",
                flush=True,
            )
            if not outcome.good:
                bad.append(index)
                for line in outcome.output.strip().splitlines()[-6:]:
                    print(f"    | {line}", flush=True)
                if args.keep is not None:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    shutil.copytree(workspace, args.keep / f"run{index}", symlinks=True)
                    (args.keep / f"run{index}" / "output.txt").write_text(outcome.output)
        finally:
            shutil.rmtree(workspace, ignore_errors=True)
    summary = ", ".join(f"{code}: {count}" for code, count in sorted(codes.items(), key=str))
    print(f"{args.runs} runs of {args.config}: exit codes {{{summary}}}; bad runs: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
