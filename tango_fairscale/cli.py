"""
``python -m tango_fairscale`` (also installed as ``tango-fairscale``).

Commands:

- ``consolidate CHECKPOINT_DIR OUT.pt [--optimizer]``: one full state dict from a sharded
  checkpoint, with no process group and no GPU.
- ``plan CONFIG [--step NAME] [--world-size N]``: the wrap plan of a training step and the
  model state each worker will hold, without training.
"""

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from tango.common.exceptions import ConfigurationError
from tqdm import tqdm

from . import checkpointing
from .errors import CheckpointError


def consolidate(checkpoint_dir: Path, output: Path, *, with_optimizer: bool = False) -> None:
    """
    Write the full (unsharded) model state dict of ``checkpoint_dir`` to ``output``; with
    ``with_optimizer``, write ``{"model": ..., "optimizer": ...}`` instead, the optimizer state
    keyed by parameter name.
    """
    checkpoint_dir = checkpointing.resolve_checkpoint(Path(checkpoint_dir))
    marker = checkpointing.read_marker(checkpoint_dir)
    assert marker is not None  # resolve_checkpoint checked that the checkpoint is complete
    world_size = marker["world_size"]
    kinds = ["model", "optimizer"] if with_optimizer else ["model"]
    loaded = {kind: [] for kind in kinds}  # type: dict
    with tqdm(total=world_size * len(kinds), desc="Reading shards", unit="file") as progress:
        for kind in kinds:
            for worker in range(world_size):
                loaded[kind].append(
                    checkpointing.safe_load(checkpointing.worker_file(checkpoint_dir, worker, kind))
                )
                progress.update()
    model = checkpointing.consolidate_model_state(loaded["model"])
    result: Dict[str, Any] = dict(model)
    if with_optimizer:
        result = {
            "model": model,
            "optimizer": checkpointing.consolidate_optimizer_state(loaded["model"], loaded["optimizer"]),
        }
    output.parent.mkdir(parents=True, exist_ok=True)
    checkpointing.atomic_save(result, output)
    numel = sum(t.numel() for t in model.values())
    print(
        f"Wrote {output} from {world_size} shards of {checkpoint_dir}: {len(model)} tensors, "
        f"{numel:,} elements{', with optimizer state' if with_optimizer else ''}."
    )


def _load_step(
    config: Path, step_name: Optional[str], includes: List[str], ext_vars: List[str]
) -> "tuple[str, dict]":
    from tango.common import Params
    from tango.common.exceptions import ConfigurationError
    from tango.common.util import import_extra_module

    variables = {}
    for item in ext_vars:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigurationError(f"--ext-var takes KEY=VALUE, got {item!r}")
        variables[key] = value
    params = Params.from_file(config, ext_vars=variables).as_dict(quiet=True)
    packages = list(includes) + list(params.pop("include_package", []))
    settings = Path("tango.yml")
    if settings.is_file():
        import yaml

        packages += list((yaml.safe_load(settings.read_text()) or {}).get("include_package", []))
    for package in packages:
        import_extra_module(package)
    steps = params.get("steps", {})
    train_steps = {
        name: step
        for name, step in steps.items()
        if isinstance(step, dict) and step.get("type") == "torch::train"
    }
    if step_name is not None:
        if step_name not in steps:
            raise ConfigurationError(f"No step {step_name!r} in {config}; its steps: {sorted(steps)}")
        return step_name, steps[step_name]
    if len(train_steps) != 1:
        raise ConfigurationError(
            f"{config} has {len(train_steps)} torch::train steps ({sorted(train_steps)}): "
            "choose one with --step."
        )
    return next(iter(train_steps.items()))


def plan_command(
    config: Path,
    step_name: Optional[str],
    world_size: Optional[int],
    includes: List[str],
    ext_vars: List[str],
    json_path: Optional[Path],
) -> None:
    """Print the wrap plan of a training step (and write it as JSON with ``json_path``)."""
    import json

    from .plan import make_plan, render

    name, step = _load_step(config, step_name, includes, ext_vars)
    plan = make_plan(name, step, world_size)
    print(render(plan))
    if json_path is not None:
        json_path.write_text(json.dumps(plan.as_dict(), indent=2))


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
    consolidate_parser.add_argument(
        "checkpoint_dir", type=Path, help="checkpoint_state_step<N> directory or work dir"
    )
    consolidate_parser.add_argument("output", type=Path, help="the .pt file to write")
    consolidate_parser.add_argument(
        "--optimizer",
        action="store_true",
        help='also consolidate the optimizer state; the file is then {"model": ..., "optimizer": ...}',
    )

    plan_parser = commands.add_parser(
        "plan",
        help="show the FSDP wrap plan of a training step and its memory per worker, without training",
        description="Build the model of a torch::train step (on the meta device where possible, else on the "
        "CPU) and print each FSDP unit with its parameter count, whether it is checkpointed, and the "
        "estimated per-worker bytes of parameters, gradients and optimizer state beside DDP's. "
        "Needs no process group and no GPU.",
    )
    plan_parser.add_argument("config", type=Path, help="the Tango experiment config (.jsonnet or .json)")
    plan_parser.add_argument("--step", help="the step to plan (default: the config's only torch::train step)")
    plan_parser.add_argument(
        "--world-size", type=int, help="number of workers (default: the step's device_count)"
    )
    plan_parser.add_argument(
        "-i", "--include-package", action="append", default=[], help="a module to import (repeatable)"
    )
    plan_parser.add_argument(
        "--ext-var", action="append", default=[], help="a jsonnet external variable KEY=VALUE"
    )
    plan_parser.add_argument(
        "--json", type=Path, dest="json_path", help="also write the plan as JSON to this file"
    )
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "consolidate":
            consolidate(args.checkpoint_dir, args.output, with_optimizer=args.optimizer)
        elif args.command == "plan":
            plan_command(
                args.config, args.step, args.world_size, args.include_package, args.ext_var, args.json_path
            )
    except (CheckpointError, ConfigurationError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
