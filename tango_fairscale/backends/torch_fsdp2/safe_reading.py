"""
Reading a DCP checkpoint without running pickled code: DCP's ``.metadata`` unpickled by an
unpickler that resolves only DCP's metadata classes (:data:`METADATA_GLOBALS`), every data file
the metadata names checked against the files the marker lists, and non-tensor values loaded with
``weights_only=True``. See :mod:`.checkpoint`'s docstring, "Loading safely".
"""

import io
import logging
import pickle
from pathlib import Path
from typing import Any, Optional, Set, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from ... import checkpointing
from ...errors import CheckpointError

logger = logging.getLogger(__name__)


#: DCP's metadata file (``torch.distributed.checkpoint.filesystem._metadata_fn``).
METADATA_FILE = ".metadata"

#: The only globals ``.metadata`` may name: DCP's metadata classes, torch.Size, torch's dtypes (any
#: ``torch.<name>`` that is a :class:`torch.dtype`, checked separately), the layout lookup and paths
#: (``StorageMeta.checkpoint_id``). Calling any of them builds a plain value.
METADATA_GLOBALS: Set[Tuple[str, str]] = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(
        (module, name)
        for module in ("pathlib", "pathlib._local")
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
    ),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: see :data:`METADATA_GLOBALS`."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"Refusing to load {self._path}: it names {module}.{name}, which is not part of DCP's checkpoint "
            "metadata, so it may run code. Nothing in it was run."
        )


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata file at ``path``, unpickled with :class:`_MetadataUnpickler`."""
    with open(path, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle, path).load()
        except CheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 - truncated or not a pickle: damage, not a crash
            raise CheckpointError(f"Cannot read {path}: {type(error).__name__}: {error}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not DCP metadata (it holds a {type(metadata).__name__}).")
    return metadata


class _SafeFileSystemReader(dcp.FileSystemReader):
    """
    DCP's file reader with :func:`read_metadata` in place of ``pickle.load``, and with every data
    file the metadata names checked against ``allowed`` (the files the marker lists and that were
    verified), so that a path in the metadata cannot reach outside the checkpoint.
    """

    def __init__(self, path: Path, allowed: Set[str], verified: Optional[Set[str]] = None) -> None:
        super().__init__(path)
        self._directory = Path(path)
        self._allowed = allowed
        self._verified = allowed if verified is None else verified

    def read_data(self, plan: Any, planner: Any) -> Any:
        # A host's part of a checkpoint across hosts: only this worker's own files were checked,
        # and they hold all it needs unless the layout changed; never read an unchecked file.
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            if name not in self._verified:
                raise CheckpointError(
                    f"{self._directory} is a host's part of a checkpoint across hosts, and loading it here "
                    f"needs {name}, which another host wrote: the sharding changed since the save (another "
                    "number of hosts or workers, or hybrid_sharding switched). Resume it as it was saved, or "
                    "copy every host's files of it into one directory to load it with another sharding."
                )
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("Per-rank DCP metadata is not used by this package's checkpoints.")
        metadata = read_metadata(self._directory / METADATA_FILE)
        named = {info.relative_path for info in (metadata.storage_data or {}).values()}
        foreign = sorted(str(name) for name in named if name not in self._allowed)
        if foreign:
            raise CheckpointError(
                f"{self._directory / METADATA_FILE} refers to files that are not listed in the checkpoint's "
                f"{checkpointing.MARKER}: {foreign[:5]}. The checkpoint was altered; use an untouched one."
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes_safely(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``weights_only=True`` (DCP's uses ``False``)."""
    try:
        loaded = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"Refusing to load the checkpoint value {read_item.dest_index.fqn!r}: it is not a plain value "
            f"that loads with weights_only=True. Nothing in it was run. ({str(error).splitlines()[0]})"
        ) from None
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes_safely(self, read_item, value)


class _SafeEmptyStateDictLoadPlanner(_EmptyStateDictLoadPlanner):
    """The planner of ``dcp_to_torch_save`` (state dict rebuilt from the metadata), loading safely."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes_safely(self, read_item, value)


def _dcp_call(function: Any, *args: Any, **kwargs: Any) -> Any:
    """
    Call a DCP function that reads a checkpoint, turning its :class:`CheckpointException` (a
    ``BaseException`` that gathers every worker's failure, with their tracebacks) into one line:
    this package's :class:`CheckpointError` when one of the failures is ours (a refused file or
    value), else one naming the first worker's error. The files passed the marker's checks before
    DCP read them, so such an error means they were swapped or replaced after the save.
    """
    try:
        return function(*args, **kwargs)
    except CheckpointException as error:
        failures = sorted(error.failures.items())
        ours = [failure for _, (failure, _) in failures if isinstance(failure, CheckpointError)]
        if ours:
            raise CheckpointError(str(ours[0])) from None
        reader = kwargs.get("storage_reader")
        where = getattr(reader, "_directory", "the checkpoint")
        rank, (failure, _) = failures[0]
        lines = str(failure).strip().splitlines()
        raise CheckpointError(
            f"{where} does not read as the checkpoint its metadata describes (worker {rank}: "
            f"{type(failure).__name__}{': ' + lines[0][:200] if lines else ''}); its files match the "
            "marker, so they were swapped or replaced after the save. Use an untouched checkpoint. Nothing "
            "in it was run."
        ) from None
