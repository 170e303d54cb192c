"""
One full state dict from a checkpoint of either backend, told apart by its marker: the backend
that wrote it (:mod:`tango_fairscale.backends`) reads it. Used by ``python -m tango_fairscale
consolidate``; the engine's ``weights.pt`` goes through its own backend directly.

The model alone is written one tensor at a time (:func:`model_source`, :func:`save_model`): the
shards are mapped, not read into private memory, and each full tensor is built, written and
dropped before the next, so consolidating needs the largest tensor's memory, not the model's.
Both writers mark the file as ``consolidate``'s (a record in its archive), so that a later
``consolidate --force`` replaces it and nothing else (:mod:`tango_fairscale.output_paths`).
"""

from pathlib import Path
from typing import Any, Callable, Dict, Optional

from .. import checkpointing
from ..backends.base import ModelSource
from ..backends.lookup import backend_of
from ..output_paths import CONSOLIDATED, PT_MARKER_RECORD, is_consolidated_file, marker
from .placing import Identity
from .streaming import save_with_records, stream_save


def model_source(checkpoint_dir: Path, *, hashes: bool = True) -> ModelSource:
    """
    The plain model's state dict of a complete checkpoint (resolved by the caller), to be written
    by :func:`save_model`. Every file is checked against the marker first (SHA-256 with ``hashes``).
    """
    marker = checkpointing.require_complete(checkpoint_dir)
    return backend_of(marker).model_source(checkpoint_dir, hashes=hashes)


def save_model(
    source: ModelSource,
    path: Path,
    *,
    progress: Optional[Callable[[], None]] = None,
    checked: Optional[Identity] = None,
) -> None:
    """
    Write ``source`` to ``path`` (atomically) as ``torch.save`` would, one tensor at a time,
    replacing only ``checked``: what the output's check found there (``None``: nothing; else an
    earlier ``consolidate`` output, still one when it is replaced).
    """
    stream_save(
        source.entries,
        source.produce,
        Path(path),
        progress=None if progress is None else lambda _: progress(),
        records={PT_MARKER_RECORD: marker(CONSOLIDATED)},
        checked=checked,
        still_replaceable=is_consolidated_file,
    )


def save_consolidated(state: Dict[str, Any], path: Path, *, checked: Optional[Identity] = None) -> None:
    """Write :func:`consolidate`'s result to ``path`` with torch.save's serializer, as :func:`save_model`."""
    save_with_records(
        state,
        Path(path),
        {PT_MARKER_RECORD: marker(CONSOLIDATED)},
        checked=checked,
        still_replaceable=is_consolidated_file,
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
    marker = checkpointing.require_complete(checkpoint_dir)
    return backend_of(marker).consolidate(checkpoint_dir, with_optimizer=with_optimizer, progress=progress)


def files_to_read(marker: Dict[str, Any], with_optimizer: bool) -> int:
    """How many calls of ``progress`` :func:`consolidate` will make."""
    return backend_of(marker).files_to_read(marker, with_optimizer)
