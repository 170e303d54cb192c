"""
The file protocol of a sharded checkpoint: per-worker files written atomically, the completion
marker, safe loading, and finding a complete checkpoint. See :mod:`tango_fairscale.checkpointing`
for the layout.
"""

import errno
import hashlib
import json
import mmap as mmap_module
import os
import pickle
import queue
import re
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Iterable, Iterator, List, Optional

import torch

from ..errors import CheckpointError
from . import model_records
from .placing import place

MARKER = "COMPLETE.json"
#: The marker's field naming the unique id of the step whose run wrote the checkpoint.
STEP_ID_FIELD = "step_id"
#: 2: worker files carry a header (kind, rank, world size, step), the marker every file's size
#: and SHA-256. Format 1 checkpoints (neither) are still read.
FORMAT_VERSION = 2
STATE_NAMES = ("model", "optimizer", "lr_scheduler", "grad_scaler", "trainer")


def worker_file(checkpoint_dir: Path, worker: int, name: str) -> Path:
    """The path of one worker's file of a given kind (``"model"``, ``"optimizer"``, ...)."""
    return Path(checkpoint_dir) / f"worker{worker}_{name}.pt"


#: Writes smaller than this are copied before they are hashed on the hashing thread.
_COPY_BELOW_BYTES = 1 << 20


class _HashingWriter:
    """
    A write-only file object that hashes what passes through it, on a second thread: SHA-256
    releases the GIL on large buffers, so hashing overlaps with ``torch.save``'s serialisation and
    writing instead of adding to it. Large writes are views of tensor storage, which stays
    untouched until ``torch.save`` returns (:meth:`finish` waits for the hash before that); small
    ones (zip records) come from buffers ``torch.save`` reuses, so they are copied first.
    """

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._sha256 = hashlib.sha256()
        self._pending: queue.SimpleQueue[Optional[memoryview]] = queue.SimpleQueue()
        self._hasher = threading.Thread(target=self._hash, name="checkpoint-sha256", daemon=True)
        self._hasher.start()
        self.size = 0

    def _hash(self) -> None:
        while (chunk := self._pending.get()) is not None:
            self._sha256.update(chunk)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.size += len(view)
        self._pending.put(view if len(view) >= _COPY_BELOW_BYTES else memoryview(bytes(view)))
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()

    def finish(self) -> Dict[str, Any]:
        """Wait for the hash of everything written; ``{"size", "sha256"}``."""
        self._pending.put(None)
        self._hasher.join()
        return {"size": self.size, "sha256": self._sha256.hexdigest()}


def os_error_in(error: BaseException) -> Optional[OSError]:
    """
    The :class:`OSError` behind ``error``: itself, or one in its chain. ``torch.save`` turns a
    failed write (a full disk) into ``RuntimeError: [enforce fail at inline_container.cc] ...
    unexpected pos``, with the write's ``OSError`` only as its context.
    """
    seen = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno is not None:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def io_failure(operation: str, path: Path, error: OSError) -> CheckpointError:
    """One line naming the operation, the path and the OS error: ``Cannot write P: ... (ENOSPC).``"""
    code = errno.errorcode.get(error.errno or 0, str(error.errno))
    return CheckpointError(f"Cannot {operation} {path}: {error.strerror or error} ({code}).")


#: ``atomic_file``'s ``checked`` for a file of the run's own (a checkpoint's): replaced whatever is there.
ANYTHING = object()


@contextmanager
def atomic_file(
    path: Path, *, checked: Any = ANYTHING, still_replaceable: Optional[Callable[[Path], bool]] = None
) -> Iterator[BinaryIO]:
    """
    A new file to write ``path`` through: a temporary sibling, flushed to disk and renamed over
    ``path`` when the block ends, removed if it raises. A reader sees the old file or the whole
    new one, never a partial write. For an output put where a user's files may be, ``checked`` is
    what its check found at ``path`` when the write started (``None``: nothing; else an earlier
    output's :func:`~tango_fairscale.checkpointing.placing.identity`, which
    ``still_replaceable`` confirms): only that is replaced, anything else stops the write in one
    line (:func:`~tango_fairscale.checkpointing.placing.place`).
    """
    path = Path(path)
    # A unique sibling name (not tempfile's 0600 files), so the result gets the usual permissions.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if checked is ANYTHING:
            os.replace(tmp, path)
        else:
            old = place(tmp, path, checked, still_replaceable=still_replaceable or _never, what=path.name)
            if old is not None:
                old.unlink()
        fsync_directory(path.parent)
    except Exception as error:
        # A full disk, a read-only or vanished directory: one line naming the file and the OS
        # error, not the serializer's internal message with the cause buried in its context.
        failure = os_error_in(error)
        if failure is None or isinstance(error, CheckpointError):  # already one line (place's refusal)
            raise
        raise io_failure("write", path, failure) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def _never(path: Path) -> bool:
    return False


def atomic_save(obj: Any, path: Path) -> Dict[str, Any]:
    """
    ``torch.save`` to ``path`` through :func:`atomic_file`. Returns the file's
    ``{"size", "sha256"}``, computed from the bytes as they are written (no second read of a file
    that may be gigabytes).
    """
    with atomic_file(path) as handle:
        writer = _HashingWriter(handle)
        try:
            torch.save(obj, writer)  # type: ignore[arg-type]
        finally:
            digest = writer.finish()
    return digest


def file_digest(path: Path, chunk_bytes: int = 16 << 20) -> Dict[str, Any]:
    """``{"size", "sha256"}`` of a file on disk, read in chunks."""
    sha256 = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            sha256.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": sha256.hexdigest()}


#: The key of the header that every worker file of format 2 wraps its state in.
HEADER_KEY = "tango_fairscale_file"


def with_header(state: Any, *, kind: str, rank: int, world_size: int, step: Optional[int]) -> Dict[str, Any]:
    """
    ``state`` wrapped with what ties the file to its checkpoint: its kind, the worker that wrote
    it, the world size and the step. Checked by :func:`without_header` on load.
    """
    header = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "rank": rank,
        "world_size": world_size,
        "step": step,
    }
    return {HEADER_KEY: header, "state": state}


def without_header(
    loaded: Any, path: Path, *, kind: str, rank: int, world_size: int, step: Optional[int]
) -> Any:
    """
    The state of a worker file, after checking that its header names this kind, worker, world
    size and step. Files of format 1 (before headers) are returned as they are.
    """
    if not (isinstance(loaded, dict) and HEADER_KEY in loaded):
        return loaded
    header = loaded[HEADER_KEY]
    expected = {"kind": kind, "rank": rank, "world_size": world_size, "step": step}
    wrong = {key: (header.get(key), value) for key, value in expected.items() if header.get(key) != value}
    if wrong:
        details = ", ".join(
            f"{key} {found!r} where {want!r} was expected" for key, (found, want) in wrong.items()
        )
        raise CheckpointError(
            f"Checkpoint file {path} does not belong in this checkpoint: its header has {details}. "
            "Files were moved, swapped or copied in from another checkpoint; use an untouched checkpoint."
        )
    return loaded["state"]


def verify_files(
    checkpoint_dir: Path, marker: Dict[str, Any], names: Iterable[str], hashes: bool = True
) -> None:
    """
    Check the files ``names`` of a checkpoint against its marker: each a regular file (a symbolic
    link is refused, not followed), of the recorded size and, with ``hashes``, SHA-256. Markers
    written before digests were recorded (format 1) are checked for presence only.
    """
    digests = marker.get("digests")
    for name in names:
        path = Path(checkpoint_dir) / name
        if path.is_symlink():
            raise CheckpointError(
                f"Checkpoint file {path} is a symbolic link (to {os.readlink(path)}); links inside a "
                "checkpoint are not followed. Copy the file itself into the checkpoint, or use the original."
            )
        if not path.is_file():
            raise CheckpointError(f"Checkpoint file {path} is missing.")
        if digests is None:
            continue
        recorded = digests.get(name)
        if recorded is None:
            raise CheckpointError(
                f"Checkpoint file {path} is not listed in {MARKER}; the marker is not this checkpoint's."
            )
        size = path.stat().st_size
        if size != recorded["size"]:
            raise CheckpointError(
                f"Checkpoint file {path} has {size} bytes where {MARKER} recorded {recorded['size']}: it was "
                "changed or truncated after the checkpoint was written."
            )
        if hashes:
            found = file_digest(path)["sha256"]
            if found != recorded["sha256"]:
                raise CheckpointError(
                    f"Checkpoint file {path} has SHA-256 {found[:16]}... where {MARKER} recorded "
                    f"{recorded['sha256'][:16]}...: its contents changed after the checkpoint was written."
                )


def fsync_directory(directory: Path) -> None:
    """Flush a directory's entries (the renames into it) to disk, where the OS allows it."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def safe_load(path: Path, mmap: bool = False, shared: bool = False) -> Any:
    """
    ``torch.load(path, map_location="cpu", weights_only=True)``: tensors, containers and plain
    values only. A file that needs anything else (a pickled object or callable) is refused
    before any of it runs, with an error naming the file.

    With ``mmap=True`` the tensors are views of the file, read from disk only where they are
    used: resharding reads every saved worker's file but needs a slice of each. With ``shared``
    too, the mapping is shared (``MAP_SHARED``) rather than private: its pages are the page
    cache's, not the process's private memory (``RLIMIT_DATA`` and cgroups count private
    mappings in full). For files only read, never written through the tensors: a write would reach
    the file. Where the file cannot be opened for writing (a read-only checkpoint), the mapping is
    private.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"Checkpoint file {path} is missing.")
    if mmap and shared and os.access(path, os.W_OK):
        with torch.serialization.set_default_mmap_options(mmap_module.MAP_SHARED):
            return _torch_load(path, mmap=True)
    return _torch_load(path, mmap=mmap)


def _torch_load(path: Path, mmap: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:  # what weights_only raises for a disallowed global
        first_line = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointError(
            f"Refusing to load {path}: it is not a plain tensor checkpoint that loads with "
            f"weights_only=True, so it may carry executable pickle content. Nothing in it was run. "
            f"({first_line})"
        ) from None
    except (OSError, RuntimeError, EOFError) as error:  # unreadable, truncated, not a torch file
        raise CheckpointError(
            f"Cannot read checkpoint file {path}: {type(error).__name__}: {error}"
        ) from None


def write_marker(checkpoint_dir: Path, world_size: int, extra: Optional[Dict[str, Any]] = None) -> None:
    """
    Mark ``checkpoint_dir`` complete. Call on one worker after all workers have written; give
    the files' digests in ``extra["digests"]`` (file name -> ``{"size", "sha256"}``).
    """
    marker = {"format_version": FORMAT_VERSION, "world_size": world_size, **(extra or {})}
    path = Path(checkpoint_dir) / MARKER
    tmp = path.with_name(f".{MARKER}.tmp")
    with open(tmp, "w") as handle:
        json.dump(marker, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def read_marker(checkpoint_dir: Path) -> Optional[Dict[str, Any]]:
    """
    The marker of ``checkpoint_dir``, or ``None`` when it has none. A marker that is there but
    is not one (not JSON, a world size that is not a positive whole number, ...) is a
    :class:`CheckpointError` saying so: that is damage, not an interrupted save.
    """
    path = Path(checkpoint_dir) / MARKER
    if not path.is_file():
        return None
    try:
        with open(path) as handle:
            marker = json.load(handle)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} is malformed ({error}); the checkpoint cannot be trusted.") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"{path} is malformed: expected a JSON object, got {type(marker).__name__}.")
    world_size = marker.get("world_size")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(
            f"{path} is malformed: world_size must be a positive whole number, got {world_size!r}."
        )
    files = marker.get("files", ["model"])
    if not (isinstance(files, list) and all(isinstance(name, str) for name in files)):
        raise CheckpointError(f"{path} is malformed: files must be a list of names, got {files!r}.")
    digests = marker.get("digests")
    if digests is not None and not (
        isinstance(digests, dict)
        and all(
            isinstance(d, dict) and isinstance(d.get("size"), int) and isinstance(d.get("sha256"), str)
            for d in digests.values()
        )
    ):
        raise CheckpointError(
            f"{path} is malformed: digests must map file names to sizes and SHA-256 hashes."
        )
    model_records.check(path, marker)
    return marker


def saved_file_names(marker: Dict[str, Any]) -> List[str]:
    """
    The names of the files (``"model"``, ``"optimizer"``, ``"lr_scheduler"``, ...) that every
    worker wrote, as the marker lists them; a marker from before that list has only the model's
    name, the one file every checkpoint has.
    """
    return list(marker.get("files", ["model"]))


def _missing_files(checkpoint_dir: Path, marker: Dict[str, Any]) -> List[str]:
    expected = [
        worker_file(checkpoint_dir, worker, name).name
        for worker in range(marker["world_size"])
        for name in saved_file_names(marker)
    ]
    # Files in subdirectories (the torch backend's DCP files) are listed with their digests.
    expected += [name for name in marker.get("digests") or {} if name not in expected]
    return [name for name in expected if not (Path(checkpoint_dir) / name).is_file()]


def is_complete(checkpoint_dir: Path) -> bool:
    """Whether ``checkpoint_dir`` holds a checkpoint whose every worker finished writing."""
    try:
        marker = read_marker(checkpoint_dir)
    except CheckpointError:
        return False
    return marker is not None and not _missing_files(checkpoint_dir, marker)


def require_complete(checkpoint_dir: Path) -> Dict[str, Any]:
    """The marker of ``checkpoint_dir``, or a :class:`CheckpointError` saying what is wrong."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir} is not a directory.")
    marker = read_marker(checkpoint_dir)
    if marker is None:
        if any(checkpoint_dir.glob("worker*_model.pt")):
            if written_by_bundled_integration(checkpoint_dir):
                raise CheckpointError(
                    f"{checkpoint_dir} was written by ai2-tango's bundled tango.integrations.fairscale "
                    "engine (or Tango's own engines), another checkpoint format: it has no completion "
                    f"marker and its files are unpickled whole, so tango-fairscale does not resume it. "
                    "Run the step in a new workspace (or move its work directory aside) to train from "
                    "the start; the weights.pt of that run, if it finished, loads into the plain model."
                )
        if any(checkpoint_dir.glob("worker*_*.pt")) or any(checkpoint_dir.glob("*/*.distcp")):
            # Either backend's per-worker files, or the torch backend's DCP data files (a save
            # killed before the per-worker files).
            raise CheckpointError(
                f"{checkpoint_dir} is an incomplete checkpoint: it has no {MARKER}, so its save "
                "was interrupted. Use an earlier complete checkpoint."
            )
        raise CheckpointError(
            f"{checkpoint_dir} is not a tango-fairscale checkpoint (no {MARKER} and no "
            "worker*_model.pt files)."
        )
    missing = _missing_files(checkpoint_dir, marker)
    if missing:
        raise CheckpointError(f"{checkpoint_dir} is incomplete: missing {missing}.")
    return marker


#: Keys that only this package's model files have (see :mod:`tango_fairscale.checkpointing`).
_OWN_MODEL_KEYS = ("optimizer_keys", "module_aliases")


def written_by_bundled_integration(checkpoint_dir: Path) -> bool:
    """
    Whether a checkpoint directory without a marker holds another engine's files: its model file
    lacks the keys this package writes. Read memory-mapped and with ``weights_only``, so neither a
    large nor a hostile file costs anything; a file that does not load that way is not ours either.
    """
    path = worker_file(checkpoint_dir, 0, "model")
    if not path.is_file():
        return False
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - unreadable with weights_only: not a file we wrote
        return True
    if isinstance(state, dict) and HEADER_KEY in state:
        return False
    return not (isinstance(state, dict) and all(key in state for key in _OWN_MODEL_KEYS))


def resolve_checkpoint(path: Path) -> Path:
    """
    The complete checkpoint that ``path`` names: a checkpoint directory itself, or the work
    directory of a ``torch::train`` step (its ``checkpoint_state_latest``). Raises a
    :class:`CheckpointError` saying what is wrong otherwise.
    """
    path = Path(path).expanduser()
    if (path / "checkpoint_state_latest").exists():
        path = path / "checkpoint_state_latest"
    path = path.resolve()
    require_complete(path)
    return path


def read_worker_state(
    checkpoint_dir: Path,
    marker: Dict[str, Any],
    rank: int,
    kind: str,
    *,
    mmap: bool = False,
    shared: bool = False,
    hashes: bool = True,
) -> Any:
    """
    The state in worker ``rank``'s ``kind`` file of a complete checkpoint: the file checked
    against the marker (:func:`verify_files`), loaded with ``weights_only`` (:func:`safe_load`,
    which says what ``mmap`` and ``shared`` do) and its header checked against this checkpoint
    (:func:`without_header`).
    """
    path = worker_file(checkpoint_dir, rank, kind)
    verify_files(checkpoint_dir, marker, [path.name], hashes=hashes)
    return without_header(
        safe_load(path, mmap=mmap, shared=shared),
        path,
        kind=kind,
        rank=rank,
        world_size=marker["world_size"],
        step=marker.get("training_steps"),
    )


#: How ``torch::train`` names the checkpoint of step N (``TrainConfig.state_path_for_step``).
_STEP_DIRECTORY = re.compile(r"checkpoint_state_step(\d+)")


def newest_complete_checkpoint(work_dir: Path) -> Optional[Path]:
    """
    The complete checkpoint of the highest step in a ``torch::train`` work directory, found by
    listing it: for when ``checkpoint_state_latest`` is missing or dangling (Tango removes and
    re-creates the link, so a kill in between leaves none).
    """
    candidates = []
    for path in Path(work_dir).glob("checkpoint_state_step*"):
        match = _STEP_DIRECTORY.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink() and is_complete(path):
            candidates.append((int(match.group(1)), path))
    return max(candidates)[1] if candidates else None
