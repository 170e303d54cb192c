"""
Sharded training checkpoints: written atomically per worker, counted only once complete,
read back with ``torch.load(..., weights_only=True)``, and consolidated offline.

A checkpoint is a directory (Tango's ``checkpoint_state_step<N>``) holding, per worker ``r``::

    worker{r}_model.pt         {"weights": FSDP local (sharded) state dict, "metadata": FSDP shard metadata}
    worker{r}_optimizer.pt     the optimizer state of that worker's shard
    worker{r}_lr_scheduler.pt  (when there is a scheduler)
    worker{r}_grad_scaler.pt   (when there is a grad scaler)
    worker{r}_trainer.pt       Tango's trainer state (step, best metric, callbacks)

and, written by worker 0 after every worker has finished its files, the marker
``COMPLETE.json``. A directory without the marker is an interrupted save and is never resumed
from.
"""

import json
import os
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from .errors import CheckpointError

MARKER = "COMPLETE.json"
FORMAT_VERSION = 1
STATE_NAMES = ("model", "optimizer", "lr_scheduler", "grad_scaler", "trainer")


def worker_file(checkpoint_dir: Path, worker: int, name: str) -> Path:
    """The path of one worker's file of a given kind (``"model"``, ``"optimizer"``, ...)."""
    return Path(checkpoint_dir) / f"worker{worker}_{name}.pt"


def atomic_save(obj: Any, path: Path) -> None:
    """
    ``torch.save`` to a temporary file in the same directory, flushed to disk, then renamed
    over ``path``: a reader sees the old file or the whole new one, never a partial write.
    """
    path = Path(path)
    # A unique sibling name (not tempfile's 0600 files), so the result gets the usual permissions.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def safe_load(path: Path) -> Any:
    """
    ``torch.load(path, map_location="cpu", weights_only=True)``: tensors, containers and plain
    values only. A file that needs anything else (a pickled object or callable) is refused
    before any of it runs, with an error naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"Checkpoint file {path} is missing.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises UnpicklingError, RuntimeError, ... by version
        raise CheckpointError(
            f"Refusing to load {path}: it is not a plain tensor checkpoint that loads with "
            f"weights_only=True, so it may carry executable pickle content. Nothing in it was run. "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        ) from None


def write_marker(checkpoint_dir: Path, world_size: int, extra: Optional[Dict[str, Any]] = None) -> None:
    """Mark ``checkpoint_dir`` complete. Call on one worker after all workers have written."""
    marker = {"format_version": FORMAT_VERSION, "world_size": world_size, **(extra or {})}
    path = Path(checkpoint_dir) / MARKER
    tmp = path.with_name(f".{MARKER}.tmp")
    with open(tmp, "w") as handle:
        json.dump(marker, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_marker(checkpoint_dir: Path) -> Optional[Dict[str, Any]]:
    """The marker of a complete checkpoint, or ``None`` when the directory is not one."""
    path = Path(checkpoint_dir) / MARKER
    if not path.is_file():
        return None
    try:
        with open(path) as handle:
            marker = json.load(handle)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and "world_size" in marker else None


def is_complete(checkpoint_dir: Path) -> bool:
    """Whether ``checkpoint_dir`` holds a checkpoint whose every worker finished writing."""
    marker = read_marker(checkpoint_dir)
    if marker is None:
        return False
    return all(
        worker_file(checkpoint_dir, worker, "model").is_file() for worker in range(marker["world_size"])
    )


def require_complete(checkpoint_dir: Path) -> Dict[str, Any]:
    """The marker of ``checkpoint_dir``, or a :class:`CheckpointError` saying what is wrong."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir} is not a directory.")
    marker = read_marker(checkpoint_dir)
    if marker is None:
        if any(checkpoint_dir.glob("worker*_model.pt")):
            raise CheckpointError(
                f"{checkpoint_dir} is an incomplete checkpoint: it has no {MARKER}, so its save "
                "was interrupted. Use an earlier complete checkpoint."
            )
        raise CheckpointError(
            f"{checkpoint_dir} is not a tango-fairscale checkpoint (no {MARKER} and no "
            "worker*_model.pt files)."
        )
    missing = [
        str(worker_file(checkpoint_dir, worker, "model").name)
        for worker in range(marker["world_size"])
        if not worker_file(checkpoint_dir, worker, "model").is_file()
    ]
    if missing:
        raise CheckpointError(f"{checkpoint_dir} is incomplete: missing {missing}.")
    return marker


def load_model_shards(checkpoint_dir: Path) -> List[Dict[str, Any]]:
    """Every worker's ``{"weights", "metadata"}`` model file of a complete checkpoint, in rank order."""
    marker = require_complete(checkpoint_dir)
    return [safe_load(worker_file(checkpoint_dir, w, "model")) for w in range(marker["world_size"])]


def consolidate_model_state(shards: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """
    The full, unsharded state dict of the model, with the plain model's keys, from every
    worker's model file.
    """
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    weights = [shard["weights"] for shard in shards]
    metadata = [shard["metadata"] for shard in shards]
    full = FSDP.consolidate_shard_weights(weights, metadata)
    # FairScale restores tied (shared) parameters only for the last FSDP unit's metadata;
    # do it for every unit.
    for unit in metadata[0]["param_metadata"]:
        for source, destination in unit["shared_param_info"]:
            full[destination] = full[source]
    return full
