"""
One full state dict from a checkpoint of either backend: FairScale's flat shards
(:mod:`tango_fairscale.checkpointing`) or PyTorch FSDP2's DCP files
(:mod:`tango_fairscale.backends.torch_fsdp_checkpoint`), told apart by the marker. Used by the
engine for the step's ``weights.pt`` and by ``python -m tango_fairscale consolidate``.

The model alone is written one tensor at a time (:func:`model_source`, :func:`save_model`): the
shards are mapped, not read into private memory, and each full tensor is built, written and
dropped before the next, so consolidating needs the largest tensor's memory, not the model's.
"""

from pathlib import Path
from typing import Any, Callable, Dict, Optional, Protocol, Sequence

import torch

from . import checkpointing
from .checkpointing.formats import is_torch_checkpoint
from .checkpointing.resharding import ConsolidatedModel
from .checkpointing.streaming import TensorEntry, stream_save


class ModelSource(Protocol):
    """A consolidated model state dict, one tensor at a time (either backend's checkpoint)."""

    @property
    def entries(self) -> Sequence[TensorEntry]: ...

    def produce(self, entry: TensorEntry) -> torch.Tensor: ...


def fairscale_model_source(shards: Sequence[Dict[str, Any]]) -> ModelSource:
    """The model of FairScale model files (``{"weights", "metadata", ...}``, one per worker)."""
    return ConsolidatedModel(list(shards))


def model_source(checkpoint_dir: Path, *, hashes: bool = True) -> ModelSource:
    """
    The plain model's state dict of a complete checkpoint (resolved by the caller), to be written
    by :func:`save_model`. Every file is checked against the marker first (SHA-256 with ``hashes``).
    """
    marker = checkpointing.require_complete(checkpoint_dir)
    if is_torch_checkpoint(marker):
        # Here, not at the top: the fairscale path does without DCP's imports (a second each).
        from .backends.torch_fsdp_checkpoint import dcp_model_source

        return dcp_model_source(checkpoint_dir, hashes=hashes)
    shards = [
        # Mapped and shared: the pages are the page cache's, not this process's private memory.
        checkpointing.read_worker_state(
            checkpoint_dir, marker, worker, "model", mmap=True, shared=True, hashes=hashes
        )
        for worker in range(marker["world_size"])
    ]
    return fairscale_model_source(shards)


def save_model(source: ModelSource, path: Path, *, progress: Optional[Callable[[], None]] = None) -> None:
    """Write ``source`` to ``path`` (atomically) as ``torch.save`` would, one tensor at a time."""
    stream_save(
        source.entries,
        source.produce,
        Path(path),
        progress=None if progress is None else lambda _: progress(),
    )


def consolidate(
    checkpoint_dir: Path, *, with_optimizer: bool = False, progress: Optional[Callable[[], None]] = None
) -> Dict[str, Any]:
    """
    The plain model's state dict of a complete checkpoint (resolved by the caller); with
    ``with_optimizer``, ``{"model": ..., "optimizer": ...}``, the optimizer state keyed by parameter
    name. Every file is checked against the marker before it is read. ``progress`` is called once
    per file read.
    """
    # Here, not at the top: the fairscale path does without DCP's imports (a second each).
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
