"""
The records a checkpoint's marker holds about the model (``pretrained_base``: the frozen base left
to the pretrained files; ``peft_adapter``: the adapter's config) say what its files mean: without
its ``pretrained_base``, a checkpoint that left the base to the files consolidated to the adapters
alone; with an edited ``peft_adapter``, the adapter export failed deep inside peft, or named the
tensors after another adapter. The marker lists each record with its SHA-256 (``model_records``),
and reading the marker refuses a record removed or changed since the save, naming the
checkpoint's marker and the record. Markers written before this list have none, and are read as
before.
"""

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Mapping

from ..errors import CheckpointError

#: The marker's field: each model record's name and SHA-256.
RECORDS_FIELD = "model_records"


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def digests(records: Mapping[str, Any]) -> Dict[str, str]:
    """The ``model_records`` field of a marker holding ``records`` (each as JSON reads it back)."""
    return {name: _digest(json.loads(json.dumps(value))) for name, value in sorted(records.items())}


def check(path: Path, marker: Mapping[str, Any]) -> None:
    """Refuse the marker at ``path`` when a model record it lists is gone or differs from the saved one."""
    listed = marker.get(RECORDS_FIELD)
    if listed is None:
        return
    if not (isinstance(listed, dict) and all(isinstance(v, str) for v in listed.values())):
        raise CheckpointError(
            f"{path} is malformed: {RECORDS_FIELD} must map record names to SHA-256 digests."
        )
    for name, digest in listed.items():
        if name not in marker:
            raise CheckpointError(
                f"{path}: its record {name!r} was removed since the checkpoint was saved, and the "
                "checkpoint's files cannot be read without it. Restore the marker as it was saved, or "
                "use another checkpoint."
            )
        if _digest(marker[name]) != digest:
            raise CheckpointError(
                f"{path}: its record {name!r} was changed since the checkpoint was saved (its SHA-256 "
                "differs from the one in model_records). Restore the marker as it was saved, or use "
                "another checkpoint."
            )
