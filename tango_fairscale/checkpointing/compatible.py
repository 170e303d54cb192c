"""
Whether a checkpoint fits the run resuming it, said the same way by both backends: parameters of
other shapes (a model of another size) and the state of another optimizer are refused in one
line naming what differs, before PyTorch or DCP fail on them with messages about keys or sizes.
"""

from pathlib import Path
from typing import Mapping, Sequence, Tuple

import torch

from ..errors import CheckpointError

Shape = Tuple[int, ...]


def check_same_shapes(
    saved: Mapping[str, Shape], local: Mapping[str, Shape], source: str = "checkpoint"
) -> None:
    """Refuse when a parameter both hold has another shape in the checkpoint (``source``) than here."""
    different = [
        (name, saved[name], local[name])
        for name in local
        if name in saved and tuple(saved[name]) != tuple(local[name])
    ]
    if different:
        listed = ", ".join(f"{name}: saved {list(a)}, this model {list(b)}" for name, a, b in different[:5])
        raise CheckpointError(
            f"The {source} holds parameters of other shapes than this model's ({len(different)} differ: "
            f"{listed}). It was saved from a model of another size; resume it with the same model "
            "configuration."
        )


def check_same_optimizer(
    saved_options: Sequence[Sequence[str]], optimizer: torch.optim.Optimizer, checkpoint_dir: Path
) -> None:
    """
    Refuse a checkpoint of another optimizer (type or options): ``saved_options`` are the option
    names of each saved parameter group. PyTorch would fail deep inside with a ``KeyError``.
    """
    groups = [sorted(set(group) - {"params"}) for group in optimizer.param_groups]
    saved = [sorted(set(options) - {"params"}) for options in saved_options]
    if len(saved) != len(groups) or (saved and saved[0] != groups[0]):
        name = type(optimizer).__name__
        raise CheckpointError(
            f"{checkpoint_dir} holds the state of another optimizer: {len(saved)} parameter "
            f"group(s) with options {saved[0] if saved else []}, where this run's {name} has "
            f"{len(groups)} with {groups[0] if groups else []}. Resume with the optimizer it was saved with."
        )
