"""
Checkpoints of a launch across hosts (see :mod:`tango_fairscale.launch`), where each host may
keep its own workspace on its own disk.

**Parts.** Each host's workers write their files into that host's checkpoint directory, as on
one host. After a barrier that every worker of every host reaches only once its files are
written, each host's first worker writes the host's ``COMPLETE.json``: the world size, the files
and, under ``"host"``, this host's node rank, the number of hosts, the ranks whose files it holds
and the attempt that wrote it. A host's directory is then a *part* of the checkpoint: the
library's :func:`~tango_fairscale.checkpointing.is_complete` says no (the other hosts' files are
missing), which is what it is on its own.

**Resuming.** Before Tango looks for ``checkpoint_state_latest``, every worker lists the steps
its own host can resume from (:func:`resumable_steps`), the workers all-gather the lists, and the
newest step that every worker can resume from, written by one attempt, is the one (:func:`agree`).
Each host points its ``checkpoint_state_latest`` there. A host that died during a save leaves the
others one step ahead; they go back with it.

**A shared filesystem.** When a host can read the other hosts' work directories (checked at the
rendezvous with a token file), its first worker hard-links their files of each checkpoint into
its own before writing its marker (:func:`link_other_hosts_files`): every host's checkpoint is then
complete, so ``python -m tango_fairscale consolidate`` and ``resume_from_checkpoint`` on another
number of hosts or workers work on it as on one host. Hard links cost no space and survive the
other host's removal of its stale checkpoints. ``TANGO_FAIRSCALE_SHARED_CHECKPOINTS=0`` keeps
parts even then.

**Final weights.** Each host's ``weights.pt`` is consolidated from every worker's model files of
the best checkpoint: those another host holds, and this one cannot read, are sent by that host's
first worker (:func:`receive_missing_files`, given the files the backend reads), streamed to disk
in chunks, so no shared filesystem is needed for the step's result, on any host.
"""

import hashlib
import logging
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set

import torch
import torch.distributed as dist

from .. import checkpointing
from ..errors import CheckpointError
from . import HostWorld

logger = logging.getLogger(__name__)

#: The marker's key for a host's part of a checkpoint.
PART_KEY = "host"
_STEP_DIRECTORY = re.compile(r"checkpoint_state_step(\d+)")
#: The files worker ``rank`` wrote into a checkpoint, relative to it, from its marker: the writing
#: backend's :meth:`~tango_fairscale.backends.base.Backend.files_of_worker` (or
#: :func:`~tango_fairscale.backends.lookup.files_of_worker`, which asks the marker's backend).
FilesOfWorker = Callable[[Mapping[str, Any], int], List[str]]


def part_description(world: HostWorld) -> Dict[str, Any]:
    """What a host's marker says about its part (under :data:`PART_KEY`)."""
    ranks = world.ranks_of(world.node_rank)
    return {
        PART_KEY: {
            "node_rank": world.node_rank,
            "num_nodes": world.num_nodes,
            "workers": list(ranks),
            "attempt": world.attempt,
        }
    }


def complete_part(
    checkpoint_dir: Path, world: HostWorld, fields: Dict[str, Any], files_of_worker: FilesOfWorker
) -> None:
    """
    On a host's leader, before its marker is written (every worker's files are on disk): link in
    the other hosts' files it can read (:func:`link_other_hosts_files`) and describe its part in
    the marker's ``fields``.
    """
    link_other_hosts_files(checkpoint_dir, world, fields, files_of_worker)
    fields.update(part_description(world))


def explain_part(error: Exception, checkpoint_dir: Path) -> Exception:
    """``error``, saying how to resume a checkpoint when it is a host's part of one across hosts."""
    try:
        marker = checkpointing.read_marker(checkpoint_dir) if checkpoint_dir.is_dir() else None
    except CheckpointError:
        marker = None
    part = describe_part(marker) if marker is not None else None
    if part is None:
        return error
    return CheckpointError(
        f"{error} It is {part}: resume it with the same hosts and device_count, or copy every "
        "host's worker files of it (worker*.pt, and dcp/ for the torch backend) into one directory "
        "to resume it elsewhere (on a shared filesystem each host's checkpoints are complete already)."
    )


def step_of(path: Path) -> Optional[int]:
    """N for a ``checkpoint_state_stepN`` directory (or a link's target of that name), else ``None``."""
    match = _STEP_DIRECTORY.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def resumable_steps(
    work_dir: Path,
    world_size: int,
    rank: int,
    holds_worker_files: Callable[[Path, Mapping[str, Any], int, int], bool],
) -> Dict[int, str]:
    """
    The checkpoints in ``work_dir`` worker ``rank`` of a world of ``world_size`` can resume from,
    as ``{step: attempt}``: a marker for this world size and the worker's own files (a part, or a
    complete checkpoint), or a complete checkpoint of any world size (which is resharded). The
    attempt is ``""`` for checkpoints written on one host. ``holds_worker_files(checkpoint_dir,
    marker, world_size, rank)`` says whether a worker's files are there
    (:func:`tango_fairscale.backends.lookup.holds_worker_files`, which asks the marker's backend).
    """
    steps: Dict[int, str] = {}
    for path in Path(work_dir).glob("checkpoint_state_step*"):
        step = step_of(path)
        if step is None or path.is_symlink() or not path.is_dir():
            continue
        try:
            marker = checkpointing.read_marker(path)
            if marker is None:
                continue
            # A marker no backend of this version owns is a CheckpointError: not resumable.
            resumable = holds_worker_files(path, marker, world_size, rank) or checkpointing.is_complete(path)
        except CheckpointError:
            continue
        if resumable:
            steps[step] = str(marker.get(PART_KEY, {}).get("attempt", ""))
    return steps


def agree(per_worker: Sequence[Mapping[int, str]]) -> Optional[int]:
    """
    The newest step that every worker can resume from, written by the same attempt on every
    host (parts of different attempts are never mixed), or ``None``.
    """
    if not per_worker:
        return None
    common = set(per_worker[0]).intersection(*per_worker[1:])
    for step in sorted(common, reverse=True):
        if len({steps[step] for steps in per_worker}) == 1:
            return step
    return None


def link_other_hosts_files(
    checkpoint_dir: Path, world: HostWorld, fields: Mapping[str, Any], files_of_worker: FilesOfWorker
) -> bool:
    """
    From each host whose work directory this one reads (``world.visible``): hard-link their
    workers' files of this checkpoint (``files_of_worker`` of the marker ``fields``) into
    ``checkpoint_dir``, which is then complete. Call after every worker has
    written its files. Returns ``False`` (and links nothing more) when a host's files cannot be
    linked (another filesystem, no permission): the checkpoint stays this host's part.
    """
    checkpoint_dir = Path(checkpoint_dir)
    directories = set()
    for node, info in enumerate(world.hosts):
        if node == world.node_rank or not world.visible[node]:
            continue
        source_dir = Path(info.work_dir) / checkpoint_dir.name
        for rank in world.ranks_of(node):
            for name in files_of_worker(fields, rank):
                source, target = source_dir / name, checkpoint_dir / name
                temporary = target.with_name(f".{target.name}.{os.getpid()}.link")
                try:
                    temporary.unlink(missing_ok=True)
                    os.link(source, temporary)
                    os.replace(temporary, target)
                except OSError as error:
                    temporary.unlink(missing_ok=True)
                    logger.warning(
                        "Cannot hard-link %s into %s (%s): this host's checkpoints stay parts; copy the "
                        "other hosts' files in to consolidate or reshard them.",
                        source,
                        checkpoint_dir,
                        error,
                    )
                    return False
                directories.add(target.parent)
    for directory in directories:
        checkpointing.fsync_directory(directory)
    return True


def _marker(checkpoint_dir: Path) -> Dict[str, Any]:
    marker = checkpointing.read_marker(checkpoint_dir)
    if marker is None:
        raise CheckpointError(f"{checkpoint_dir} has no {checkpointing.MARKER}.")
    return marker


@contextmanager
def received_files_dir(checkpoint_dir: Path) -> Iterator[Path]:
    """A temporary directory beside ``checkpoint_dir`` for :func:`receive_missing_files`, then removed."""
    directory = Path(tempfile.mkdtemp(prefix=f".{checkpoint_dir.name}.received-", dir=checkpoint_dir.parent))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _exchange_with_leaders(mine: torch.Tensor, leaders: Mapping[int, int]) -> Dict[int, torch.Tensor]:
    """Send ``mine`` to every other host's first worker and receive theirs (same shape), by node rank."""
    theirs = {node: torch.zeros_like(mine) for node in leaders}
    works = [dist.isend(mine, leader) for leader in leaders.values()]
    works += [dist.irecv(theirs[node], leader) for node, leader in leaders.items()]
    _wait(works)
    return theirs


#: The bytes of a file sent per round of :func:`receive_missing_files` (per file in flight).
TRANSFER_CHUNK_BYTES = 32 << 20


def receive_missing_files(
    checkpoint_dir: Path,
    world: HostWorld,
    file_of: Callable[[Mapping[str, Any], int], Optional[str]],
    into: Path,
) -> Set[str]:
    """
    Receive into ``into`` the file ``file_of(marker, rank)`` (a path relative to the checkpoint,
    from this host's marker; ``None`` for a worker without one) of every worker whose file this
    host lacks, from the first worker of the host that wrote it, and send the files of this
    host's workers that other hosts lack. Files travel in chunks of :data:`TRANSFER_CHUNK_BYTES`
    and are written as they arrive, so memory stays bounded whatever their size; each is
    checked against the size and SHA-256 in this host's marker (which lists every worker's
    files). Returns the names received.

    Call it on the first worker of every host, and only there: it exchanges point-to-point with
    the others only. A failure on one host (no marker, a file of its own workers missing, a file
    that arrives damaged) is raised on every host, after the exchange, so none waits for the others.
    """
    checkpoint_dir, into = Path(checkpoint_dir), Path(into)
    world_size = world.world_size
    marker: Dict[str, Any] = {}
    error: Optional[str] = None
    try:
        marker = _marker(checkpoint_dir)
    except CheckpointError as failure:  # told to the other hosts below rather than leaving them waiting
        error = str(failure)
    digests = marker.get("digests") or {}
    files = {rank: name for rank in range(world_size) if (name := file_of(marker, rank)) is not None}
    leaders = {
        node: world.topology.leader_of(node) for node in range(world.num_nodes) if node != world.node_rank
    }
    have = [rank not in files or (checkpoint_dir / files[rank]).is_file() for rank in range(world_size)]
    own_missing = [files[rank] for rank in world.ranks_of(world.node_rank) if not have[rank]]
    if own_missing:
        error = f"{checkpoint_dir} lacks this host's own file(s) {own_missing[:3]}."
    # 1. Which files each host holds, and whether it can take part.
    held = _exchange_with_leaders(torch.tensor([*have, error is None], dtype=torch.uint8), leaders)
    failed = [node for node, flags in held.items() if not flags[world_size]]
    if error is not None:
        raise CheckpointError(error)
    if failed:
        raise CheckpointError(
            f"{', '.join(world.describe(node) for node in failed)} cannot send its workers' files of "
            f"{checkpoint_dir.name} (its log says why), so the weights cannot be gathered."
        )
    # 2. The size of each file sent (a receiver learns it before taking any data).
    outgoing = [
        (leader, rank)
        for node, leader in leaders.items()
        for rank in world.ranks_of(world.node_rank)
        if rank in files and not held[node][rank]
    ]
    incoming = [rank for rank in files if not have[rank]]
    sizes = {
        rank: torch.tensor([(checkpoint_dir / files[rank]).stat().st_size], dtype=torch.int64)
        for _, rank in outgoing
    }
    incoming_sizes = {rank: torch.zeros(1, dtype=torch.int64) for rank in incoming}
    works = [dist.isend(sizes[rank], leader, tag=rank) for leader, rank in outgoing]
    works += [dist.irecv(incoming_sizes[rank], _sender(world, rank), tag=rank) for rank in incoming]
    _wait(works)
    # 3. The files, chunk by chunk. In each round every sender posts its chunks and every
    # receiver its buffers before anyone waits, so no two hosts can wait on each other.
    sources: Dict[int, BinaryIO] = {
        rank: open(checkpoint_dir / files[rank], "rb") for rank in {rank for _, rank in outgoing}
    }
    targets: Dict[int, BinaryIO] = {}
    hashers = {rank: hashlib.sha256() for rank in incoming}
    try:
        for rank in incoming:
            (into / files[rank]).parent.mkdir(parents=True, exist_ok=True)
            targets[rank] = open(into / files[rank], "wb")
        rounds = max(
            [-(-int(sizes[rank].item()) // TRANSFER_CHUNK_BYTES) for _, rank in outgoing]
            + [-(-int(incoming_sizes[rank].item()) // TRANSFER_CHUNK_BYTES) for rank in incoming]
            + [0]
        )
        for index in range(rounds):
            start = index * TRANSFER_CHUNK_BYTES
            chunks: Dict[int, torch.Tensor] = {}
            works = []
            for rank, handle in sources.items():
                if start < sizes[rank].item():
                    handle.seek(start)
                    chunks[rank] = torch.frombuffer(
                        bytearray(handle.read(TRANSFER_CHUNK_BYTES)), dtype=torch.uint8
                    )
            for leader, rank in outgoing:
                if rank in chunks:
                    works.append(dist.isend(chunks[rank], leader, tag=rank))
            buffers: Dict[int, torch.Tensor] = {}
            for rank in incoming:
                length = min(TRANSFER_CHUNK_BYTES, int(incoming_sizes[rank].item()) - start)
                if length > 0:
                    buffers[rank] = torch.empty(length, dtype=torch.uint8)
                    works.append(dist.irecv(buffers[rank], _sender(world, rank), tag=rank))
            _wait(works)
            for rank, buffer in buffers.items():
                data = buffer.numpy().data  # no copy: hashed and written from the buffer
                hashers[rank].update(data)
                targets[rank].write(data)
    finally:
        for stream in [*sources.values(), *targets.values()]:
            stream.close()
    damaged = []
    for rank in incoming:
        recorded = digests.get(files[rank])
        size = int(incoming_sizes[rank].item())
        if recorded is not None and (
            size != recorded["size"] or hashers[rank].hexdigest() != recorded["sha256"]
        ):
            damaged.append(f"{files[rank]}, sent by {world.describe(world.node_of(rank))}")
    marker_path = checkpoint_dir / checkpointing.MARKER
    error = f"{', '.join(damaged)} did not arrive as {marker_path} records it (size and SHA-256)"
    _agree_among_leaders(world, leaders, error if damaged else None)
    return {files[rank] for rank in incoming}


def _sender(world: HostWorld, rank: int) -> int:
    """The worker that sends worker ``rank``'s files: the first worker of its host."""
    return world.topology.leader_of(world.node_of(rank))


def _agree_among_leaders(world: HostWorld, leaders: Mapping[int, int], error: Optional[str]) -> None:
    """Raise on every host's first worker when any of them has ``error`` (theirs says which host)."""
    flags = _exchange_with_leaders(torch.tensor([error is not None], dtype=torch.uint8), leaders)
    if error is not None:
        raise CheckpointError(error + ".")
    failed = [world.describe(node) for node, value in flags.items() if value.item()]
    if failed:
        raise CheckpointError(
            f"{', '.join(failed)} could not check the files it received (its log says which)."
        )


def _wait(works: Sequence[Any]) -> None:
    for work in works:
        if work is not None:
            work.wait()


def describe_part(marker: Mapping[str, Any]) -> Optional[str]:
    """For errors: what part of a checkpoint across hosts a marker describes, or ``None`` for a whole one."""
    part = marker.get(PART_KEY)
    if not isinstance(part, dict):
        return None
    workers = part.get("workers") or []
    span = f"workers {workers[0]}-{workers[-1]}" if workers else "no workers"
    return (
        f"host {part.get('node_rank')}'s part of a checkpoint written by {part.get('num_nodes')} hosts "
        f"({span} of {marker.get('world_size')})"
    )
