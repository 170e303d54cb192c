"""
``python -m tango_fairscale`` (also installed as ``tango-fairscale``).

Commands:

- ``consolidate CHECKPOINT_DIR OUT.pt [--optimizer]``: one full state dict from a sharded
  checkpoint, with no process group and no GPU.
"""

import argparse
import sys
from pathlib import Path
from typing import List, Optional

import torch
from tqdm import tqdm

from . import checkpointing
from .errors import CheckpointError


def consolidate(checkpoint_dir: Path, output: Path, *, with_optimizer: bool = False) -> None:
    """
    Write the full (unsharded) model state dict of ``checkpoint_dir`` to ``output``; with
    ``with_optimizer``, write ``{"model": ..., "optimizer": ...}`` instead, the optimizer state
    keyed by parameter name.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / "checkpoint_state_latest").exists():
        checkpoint_dir = (checkpoint_dir / "checkpoint_state_latest").resolve()
    marker = checkpointing.require_complete(checkpoint_dir)
    world_size = marker["world_size"]
    kinds = ["model", "optimizer"] if with_optimizer else ["model"]
    loaded = {kind: [] for kind in kinds}  # type: dict
    with tqdm(total=world_size * len(kinds), desc="Reading shards", unit="file") as progress:
        for kind in kinds:
            for worker in range(world_size):
                loaded[kind].append(checkpointing.safe_load(checkpointing.worker_file(checkpoint_dir, worker, kind)))
                progress.update()
    model = checkpointing.consolidate_model_state(loaded["model"])
    result = model
    if with_optimizer:
        result = {"model": model, "optimizer": checkpointing.consolidate_optimizer_state(loaded["model"], loaded["optimizer"])}
    output.parent.mkdir(parents=True, exist_ok=True)
    checkpointing.atomic_save(result, output)
    numel = sum(t.numel() for t in model.values())
    print(
        f"Wrote {output} from {world_size} shards of {checkpoint_dir}: {len(model)} tensors, "
        f"{numel:,} elements{', with optimizer state' if with_optimizer else ''}."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tango_fairscale", description="Tools for tango-fairscale runs and checkpoints."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    consolidate_parser = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint into one full state dict",
        description="Turn a sharded checkpoint (or a step's work directory: its latest checkpoint) "
        "into one full state dict that loads into the plain model. Needs no process group and no GPU.",
    )
    consolidate_parser.add_argument("checkpoint_dir", type=Path, help="checkpoint_state_step<N> directory or work dir")
    consolidate_parser.add_argument("output", type=Path, help="the .pt file to write")
    consolidate_parser.add_argument(
        "--optimizer",
        action="store_true",
        help='also consolidate the optimizer state; the file is then {"model": ..., "optimizer": ...}',
    )
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "consolidate":
            consolidate(args.checkpoint_dir, args.output, with_optimizer=args.optimizer)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
