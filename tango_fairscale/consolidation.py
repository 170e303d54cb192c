"""
One full state dict from a checkpoint of either backend: FairScale's flat shards
(:mod:`tango_fairscale.checkpointing`) or PyTorch FSDP2's DCP files
(:mod:`tango_fairscale.backends.torch_fsdp_checkpoint`), told apart by the marker. Used by the
engine for the step's ``weights.pt`` and by ``python -m tango_fairscale consolidate``.
"""

from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

from . import checkpointing
from .checkpointing.formats import is_torch_checkpoint


def consolidate(
    checkpoint_dir: Path, *, with_optimizer: bool = False, progress: Optional[Callable[[], None]] = None
) -> Dict[str, Any]:
    """
    The plain model's state dict of a complete checkpoint (resolved by the caller); with
    ``with_optimizer``, ``{"model": ..., "optimizer": ...}``, the optimizer state keyed by parameter
    name. Every file is checked against the marker before it is read. ``progress`` is called once
    per file read.
    """
    from .backends.torch_fsdp_checkpoint import consolidate_dcp

    marker = checkpointing.require_complete(checkpoint_dir)
    if is_torch_checkpoint(marker):
        # DCP reads every worker's file in one call.
        result = consolidate_dcp(checkpoint_dir, with_optimizer=with_optimizer)
        if progress is not None:
            progress()
        return result
    kinds = ["model", "optimizer"] if with_optimizer else ["model"]
    loaded: Dict[str, Any] = {kind: [] for kind in kinds}
    for kind in kinds:
        for worker in range(marker["world_size"]):
            # Checked against the marker's sizes and hashes and the file's own header.
            loaded[kind].append(checkpointing.read_worker_state(checkpoint_dir, marker, worker, kind))
            if progress is not None:
                progress()
    model_state: Dict[str, torch.Tensor] = checkpointing.consolidate_model_state(loaded["model"])
    if not with_optimizer:
        return model_state
    return {
        "model": model_state,
        "optimizer": checkpointing.consolidate_optimizer_state(loaded["model"], loaded["optimizer"]),
    }


def files_to_read(marker: Dict[str, Any], with_optimizer: bool) -> int:
    """How many calls of ``progress`` :func:`consolidate` will make."""
    if is_torch_checkpoint(marker):
        return 1
    return marker["world_size"] * (2 if with_optimizer else 1)
