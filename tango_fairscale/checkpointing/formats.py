"""
Which backend wrote a checkpoint, from its marker alone: kept apart from the torch backend's
checkpoint module so that telling the formats apart does not import
``torch.distributed.checkpoint`` (about a second per process) for the fairscale backend.
"""

from pathlib import Path
from typing import Any, List, Mapping

from ..errors import CheckpointError
from .files import saved_file_names, worker_file

#: What the marker of a torch-backend (DCP) checkpoint says about its format.
MARKER_FIELDS = {"backend": "torch", "format": "dcp"}
#: The subdirectory of a torch-backend checkpoint that DCP writes into.
DCP_DIR = "dcp"


def is_torch_checkpoint(marker: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's marker says the torch backend (DCP) wrote it; else the fairscale backend did."""
    return all(marker.get(key) == value for key, value in MARKER_FIELDS.items())


def check_written_by(checkpoint_dir: Path, marker: Mapping[str, Any], backend: str) -> None:
    """A :class:`CheckpointError` naming the right backend when the other one wrote the checkpoint."""
    written_by = "torch" if is_torch_checkpoint(marker) else "fairscale"
    if written_by == backend:
        return
    formats = {"torch": "DCP", "fairscale": "FairScale's flat shards"}
    raise CheckpointError(
        f"{checkpoint_dir} was written by the {written_by} backend ({formats[written_by]}), not the "
        f'{backend} backend: resume it with training_engine.backend: "{written_by}", or consolidate it '
        "to weights and start a new run."
    )


def files_of_worker(marker: Mapping[str, Any], rank: int) -> List[str]:
    """
    The files worker ``rank`` wrote into a checkpoint of either backend, relative to its
    directory: its ``worker{rank}_*.pt`` files and, for the torch backend, its DCP data files.
    """
    return [
        worker_file(Path(), rank, name).name for name in saved_file_names(dict(marker))
    ] + dcp_files_of_worker(marker, rank)


def dcp_files_of_worker(marker: Mapping[str, Any], rank: int) -> List[str]:
    """Worker ``rank``'s DCP data files (relative to the checkpoint) in a torch-backend checkpoint."""
    prefix = f"{DCP_DIR}/__{rank}_"
    return sorted(name for name in marker.get("digests") or {} if name.startswith(prefix))


def holds_worker_files(checkpoint_dir: Path, marker: Mapping[str, Any], world_size: int, rank: int) -> bool:
    """
    Whether ``checkpoint_dir`` can be resumed by worker ``rank`` of a world of ``world_size``
    without resharding: saved by that many workers, with that worker's files there (a host's
    part of a checkpoint across hosts holds no more than its own workers' files).
    """
    return marker.get("world_size") == world_size and all(
        (Path(checkpoint_dir) / name).is_file() for name in files_of_worker(marker, rank)
    )
