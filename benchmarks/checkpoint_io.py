"""
What checkpoint integrity costs on the benchmark's GPT-2 (124 M parameters): one worker's files
of a 2-worker FSDP checkpoint (half the parameters, and AdamW's two moments for them), written
with and without the SHA-256 computed while writing, and verified (re-read and hashed) against
plain loading. Configurations alternate within each round, so both see the same machine state.

    python benchmarks/checkpoint_io.py [--world-size 2] [--rounds 3] [--json PATH]

The published run: ``--rounds 5 --json benchmarks/results/checkpoint_io.json`` (docs/benchmarks.md).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import host_environment  # noqa: E402
from tango_fairscale import checkpointing  # noqa: E402

#: GPT-2 small's parameter count (the benchmark's "full" model: 12 layers, width 768, 50257 tokens).
GPT2_SMALL_PARAMETERS = 124_439_808


def worker_states(world_size: int) -> Dict[str, Any]:
    """One worker's model and optimizer files: flat float32 shards, as FairScale's FSDP saves them."""
    shard = GPT2_SMALL_PARAMETERS // world_size
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(shard, generator=generator)
    return {
        "model": {"weights": {"flat_param_0": weights}, "metadata": {}},
        "optimizer": {
            "state": {
                0: {
                    "step": torch.tensor(10.0),
                    "exp_avg": torch.randn(shard),
                    "exp_avg_sq": torch.rand(shard),
                }
            },
            "param_groups": [{"lr": 1e-4, "params": [0]}],
        },
    }


def plain_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def timed(action: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    action(*args)
    return time.perf_counter() - start


def measure(world_size: int, rounds: int) -> Dict[str, Any]:
    states = worker_states(world_size)
    samples: Dict[str, List[float]] = {key: [] for key in ("save", "save_hashed", "load", "verify")}
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        paths = {name: directory / f"worker0_{name}.pt" for name in states}
        for _ in range(rounds):
            samples["save"].append(sum(timed(plain_save, s, paths[n]) for n, s in states.items()))
            samples["save_hashed"].append(
                sum(timed(checkpointing.atomic_save, s, paths[n]) for n, s in states.items())
            )
            samples["load"].append(sum(timed(checkpointing.safe_load, p) for p in paths.values()))
            samples["verify"].append(sum(timed(checkpointing.file_digest, p) for p in paths.values()))
        size = sum(path.stat().st_size for path in paths.values())
    median = {key: statistics.median(values) for key, values in samples.items()}
    return {
        "world_size": world_size,
        "bytes_per_worker": size,
        "seconds": median,
        "samples": samples,
        "save_hashed_vs_save": median["save_hashed"] / median["save"],
        "load_and_verify_vs_load": (median["load"] + median["verify"]) / median["load"],
        "environment": host_environment(),
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--json", type=Path, help="write the timings here (e.g. benchmarks/results/checkpoint_io.json)"
    )
    args = parser.parse_args(argv)
    result = measure(args.world_size, args.rounds)
    seconds = result["seconds"]
    gib = result["bytes_per_worker"] / 2**30
    print(f"one worker's files of a {args.world_size}-worker GPT-2 small checkpoint: {gib:.2f} GiB")
    print(
        f"save   plain {seconds['save']:.2f} s   with SHA-256 while writing {seconds['save_hashed']:.2f} s"
        f"   ratio {result['save_hashed_vs_save']:.3f}"
    )
    print(
        f"load   plain {seconds['load']:.2f} s   verify (re-read + SHA-256) {seconds['verify']:.2f} s"
        f"   load+verify / load {result['load_and_verify_vs_load']:.3f}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
