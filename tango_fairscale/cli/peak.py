"""``peak``: this machine's matmul FLOP/s, the peak that MFU on CPU workers is measured against."""

import argparse
from typing import Any, Optional

from tango.common.exceptions import ConfigurationError

from .common import UsageError


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


def add_parser(commands: "argparse._SubParsersAction[Any]") -> None:
    """The ``peak`` command's arguments."""
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


def run(args: argparse.Namespace) -> None:
    """``peak`` with the parsed ``args``."""
    peak_command(args.dtype, args.threads, args.seconds)
