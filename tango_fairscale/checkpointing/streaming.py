"""
Writing a full state dict one tensor at a time, in ``torch.save``'s own format.

``torch.save(state_dict)`` needs every tensor in memory at once: consolidating a sharded model
that way held the whole model beside the training state of the worker doing it, which is why
the end of a run needed more memory than training. :func:`stream_save` writes the same file
(``torch.load`` reads it, with ``weights_only=True``) from a list of entries and a function that
produces one tensor when its turn comes: the peak is the largest tensor, not the model.

The format is the one ``torch.save`` writes (``torch/serialization.py``, ``_save``): a zip
archive with the pickled object in ``data.pkl``, each storage in ``data/<key>``, and the
``.format_version``, ``.storage_alignment`` and ``byteorder`` records. The pickle rebuilds each
tensor with ``torch._utils._rebuild_tensor_v2`` from a storage it refers to by key, so it can be
written before any tensor exists; the storages follow, produced one by one.

Records of the caller's (``records``) go into the same archive: ``torch.load`` reads only the
records it knows, so a file ``consolidate`` marks as its own (:mod:`tango_fairscale.output_paths`)
loads as before. Each write first removes the temporaries an interrupted write of the same file
left (a killed run's ``.weights.pt.PID.HEX.tmp``, the size of the model).
"""

import collections
import io
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..output_paths import remove_stale_temporaries
from .files import ANYTHING, atomic_file


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the state dict to write: its name, shape and dtype."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    #: The name of an earlier entry this one is the same tensor as (tied weights): written once,
    #: loaded as one storage under both names, as ``torch.save`` does for a shared tensor.
    alias_of: Optional[str] = None

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


class _Storage:
    """Stands for a storage in the pickle: ``torch.save``'s persistent id names it by key."""

    def __init__(self, key: str, entry: TensorEntry) -> None:
        self.key = key
        self.entry = entry


class _Tensor:
    """Stands for a contiguous tensor over all of a :class:`_Storage`."""

    def __init__(self, storage: _Storage) -> None:
        self.storage = storage


def _storage_type(dtype: torch.dtype) -> Any:
    # e.g. torch.FloatStorage, the class torch.save names for a float32 tensor's storage.
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides: List[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


#: ``_rebuild_tensor_v2``'s backward hooks argument, as torch.save writes it.
_NO_HOOKS: "collections.OrderedDict[Any, Any]" = collections.OrderedDict()


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", _storage_type(obj.entry.dtype), obj.key, "cpu", obj.entry.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _Tensor):
            shape = obj.storage.entry.shape
            return (
                torch._utils._rebuild_tensor_v2,
                (obj.storage, 0, torch.Size(shape), _contiguous_strides(shape), False, _NO_HOOKS),
            )
        return NotImplemented


def _pickled(entries: Sequence[TensorEntry]) -> Tuple[bytes, List[_Storage]]:
    """``data.pkl`` for ``{name: tensor}`` of ``entries``, and the storages it refers to, in key order."""
    storages: List[_Storage] = []
    tensors: Dict[str, _Tensor] = {}
    for entry in entries:
        if entry.alias_of is not None:
            if entry.alias_of not in tensors:
                raise ValueError(
                    f"{entry.name} is an alias of {entry.alias_of!r}, which is not an earlier entry."
                )
            tensors[entry.name] = tensors[entry.alias_of]
            continue
        storage = _Storage(str(len(storages)), entry)
        storages.append(storage)
        tensors[entry.name] = _Tensor(storage)
    data = io.BytesIO()
    # Protocol 2, as torch.save's default.
    _Pickler(data, protocol=2).dump(dict(tensors))
    return data.getvalue(), storages


def stream_save(
    entries: Sequence[TensorEntry],
    produce: Callable[[TensorEntry], torch.Tensor],
    path: Path,
    *,
    progress: Optional[Callable[[TensorEntry], None]] = None,
    records: Optional[Mapping[str, bytes]] = None,
    checked: Any = ANYTHING,
    still_replaceable: Optional[Callable[[Path], bool]] = None,
) -> None:
    """
    Write ``{entry.name: tensor}`` to ``path`` as ``torch.save`` would, calling ``produce(entry)``
    for one tensor at a time (aliases are not produced) and writing it before the next. Atomic: the
    file is written beside ``path`` under a temporary name, flushed to disk and renamed over it, so a
    crash leaves the old file or none, never a partial one. ``progress`` is called after each tensor.
    ``records`` (name: bytes) are written into the archive too. ``checked`` and ``still_replaceable``:
    what an output may replace (:func:`~tango_fairscale.checkpointing.files.atomic_file`).
    """
    data, storages = _pickled(entries)
    remove_stale_temporaries(Path(path))
    with atomic_file(Path(path), checked=checked, still_replaceable=still_replaceable) as handle:
        with torch.serialization._open_zipfile_writer(handle) as archive:  # type: ignore[arg-type]
            archive.write_record("data.pkl", data, len(data))
            archive.write_record(".format_version", "1", len("1"))
            alignment = str(torch.serialization._get_storage_alignment())
            archive.write_record(".storage_alignment", alignment, len(alignment))
            archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
            for storage in storages:
                entry = storage.entry
                tensor = produce(entry)
                if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
                    raise ValueError(
                        f"{entry.name}: produced a {tensor.dtype} tensor of shape {list(tensor.shape)}, "
                        f"where {entry.dtype} of shape {list(entry.shape)} was announced."
                    )
                tensor = tensor.detach().cpu().contiguous()
                size = tensor.numel() * tensor.element_size()
                if tensor.storage_offset() or tensor.untyped_storage().nbytes() != size:
                    tensor = tensor.clone()  # a view of a larger storage: write its own bytes only
                archive.write_record(f"data/{storage.key}", tensor.untyped_storage(), size)
                del tensor
                if progress is not None:
                    progress(entry)
            _write_records(archive, records)


def save_with_records(
    obj: Any,
    path: Path,
    records: Mapping[str, bytes],
    *,
    checked: Any = ANYTHING,
    still_replaceable: Optional[Callable[[Path], bool]] = None,
) -> None:
    """
    ``torch.save(obj)`` to ``path``, atomically as :func:`stream_save`, with ``records`` (name:
    bytes) in its archive: ``torch.save``'s own writer and serializer, then the records.
    """
    remove_stale_temporaries(Path(path))
    with atomic_file(Path(path), checked=checked, still_replaceable=still_replaceable) as handle:
        with torch.serialization._open_zipfile_writer(handle) as archive:  # type: ignore[arg-type]
            torch.serialization._save(obj, archive, pickle, 2, False)  # type: ignore[attr-defined]
            _write_records(archive, records)


def _write_records(archive: Any, records: Optional[Mapping[str, bytes]]) -> None:
    for name, content in (records or {}).items():
        archive.write_record(name, content, len(content))
