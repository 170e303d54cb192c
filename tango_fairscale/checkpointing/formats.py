"""
Which backend wrote a checkpoint, from its marker alone: kept apart from the torch backend's
checkpoint module so that telling the formats apart does not import
``torch.distributed.checkpoint`` (about a second per process) for the fairscale backend.
"""

from pathlib import Path
from typing import Any, Mapping

from ..errors import CheckpointError

#: What the marker of a torch-backend (DCP) checkpoint says about its format.
MARKER_FIELDS = {"backend": "torch", "format": "dcp"}


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
