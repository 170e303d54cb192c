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

**Final weights.** Each host's ``weights.pt`` is consolidated from every worker's model file of
the best checkpoint: those another host holds, and this one cannot read, are sent by that host's
first worker (:func:`gather_model_shards`), so no shared filesystem is needed for the step's
result, on any host.
"""

import hashlib
import io
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from . import checkpointing
from .checkpointing.formats import files_of_worker, holds_worker_files
from .errors import CheckpointError
from .launch import HostWorld

logger = logging.getLogger(__name__)

#: The marker's key for a host's part of a checkpoint.
PART_KEY = "host"
_STEP_DIRECTORY = re.compile(r"checkpoint_state_step(\d+)")


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


def step_of(path: Path) -> Optional[int]:
    """N for a ``checkpoint_state_stepN`` directory (or a link's target of that name), else ``None``."""
    match = _STEP_DIRECTORY.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def resumable_steps(work_dir: Path, world_size: int, rank: int) -> Dict[int, str]:
    """
    The checkpoints in ``work_dir`` worker ``rank`` of a world of ``world_size`` can resume from,
    as ``{step: attempt}``: a marker for this world size and the worker's own files (a part, or a
    complete checkpoint), or a complete checkpoint of any world size (which is resharded). The
    attempt is ``""`` for checkpoints written on one host.
    """
    steps: Dict[int, str] = {}
    for path in Path(work_dir).glob("checkpoint_state_step*"):
        step = step_of(path)
        if step is None or path.is_symlink() or not path.is_dir():
            continue
        try:
            marker = checkpointing.read_marker(path)
        except CheckpointError:
            continue
        if marker is None:
            continue
        if holds_worker_files(path, marker, world_size, rank) or checkpointing.is_complete(path):
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


def link_other_hosts_files(checkpoint_dir: Path, world: HostWorld, fields: Mapping[str, Any]) -> bool:
    """
    From each host whose work directory this one reads (``world.visible``): hard-link their
    workers' files of this checkpoint (those the marker ``fields`` list for them, either
    backend's) into ``checkpoint_dir``, which is then complete. Call after every worker has
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


def gather_model_shards(checkpoint_dir: Path, world: HostWorld) -> List[Dict[str, Any]]:
    """
    Every worker's model state of a fairscale-backend checkpoint, on the first worker of each
    host (call it on each of them, and only there: it exchanges point-to-point with the others
    only). Files this host has are read here; the others are sent by the first worker of the
    host that wrote them (:func:`receive_missing_files`).
    """
    checkpoint_dir = Path(checkpoint_dir)
    received = receive_missing_files(
        checkpoint_dir, world, lambda rank: checkpointing.worker_file(Path(), rank, "model").name
    )
    marker = _marker(checkpoint_dir)
    shards = []
    for rank in range(world.world_size):
        path = checkpointing.worker_file(checkpoint_dir, rank, "model")
        if path.name in received:
            origin = f"{path.name} of {checkpoint_dir.name}, sent by {world.describe(world.node_of(rank))}"
            try:
                state = torch.load(io.BytesIO(received.pop(path.name)), map_location="cpu", weights_only=True)
            except Exception as error:  # noqa: BLE001 - weights_only refusals and damaged files alike
                raise CheckpointError(f"Cannot read {origin}: {type(error).__name__}: {error}") from None
            shards.append(
                checkpointing.without_header(
                    state,
                    path,
                    kind="model",
                    rank=rank,
                    world_size=marker["world_size"],
                    step=marker.get("training_steps"),
                )
            )
        else:
            shards.append(checkpointing.read_worker_state(checkpoint_dir, marker, rank, "model"))
    if world.global_rank(0) == 0:
        logger.info("Gathered the model files of %d workers on %d hosts", world.world_size, world.num_nodes)
    return shards


def _marker(checkpoint_dir: Path) -> Dict[str, Any]:
    marker = checkpointing.read_marker(checkpoint_dir)
    if marker is None:
        raise CheckpointError(f"{checkpoint_dir} has no {checkpointing.MARKER}.")
    return marker


def receive_missing_files(
    checkpoint_dir: Path, world: HostWorld, file_of: Callable[[int], Optional[str]]
) -> Dict[str, bytes]:
    """
    The file ``file_of(rank)`` (relative to the checkpoint; ``None`` for a worker without one) of
    every worker whose file this host lacks, sent by the first worker of the host that wrote it,
    as ``{name: contents}``, each
    checked against the size and SHA-256 in this host's marker (which lists every worker's
    files). Call it on the first worker of every host, and only there: it exchanges
    point-to-point with the others only. This host sends the files of its own workers that
    another host lacks.
    """
    checkpoint_dir = Path(checkpoint_dir)
    world_size = world.world_size
    names = {rank: file_of(rank) for rank in range(world_size)}
    files = {rank: name for rank, name in names.items() if name is not None}
    leaders = {node: world.global_rank(0, node) for node in range(world.num_nodes) if node != world.node_rank}
    have = torch.tensor(
        [rank not in files or (checkpoint_dir / files[rank]).is_file() for rank in range(world_size)],
        dtype=torch.uint8,
    )
    # 1. Which files each host holds.
    held = {node: torch.zeros(world_size, dtype=torch.uint8) for node in leaders}
    works = [dist.isend(have, leader) for leader in leaders.values()]
    works += [dist.irecv(held[node], leader) for node, leader in leaders.items()]
    _wait(works)
    # 2. Each host sends the files of its own workers that another host lacks. Sends are
    # asynchronous, so that two hosts sending to each other cannot wait on each other.
    outgoing: List[torch.Tensor] = []
    works = []
    for node, leader in leaders.items():
        for rank in world.ranks_of(world.node_rank):
            if not held[node][rank]:
                payload = torch.frombuffer(
                    bytearray((checkpoint_dir / files[rank]).read_bytes()), dtype=torch.uint8
                )
                size = torch.tensor([payload.numel()], dtype=torch.int64)
                outgoing += [size, payload]
                works += [
                    dist.isend(size, leader, tag=2 * rank),
                    dist.isend(payload, leader, tag=2 * rank + 1),
                ]
    received: Dict[str, bytes] = {}
    for rank in range(world_size):
        if not have[rank]:
            if world.node_of(rank) == world.node_rank:
                raise CheckpointError(f"{checkpoint_dir / files[rank]} is missing.")
            source = world.global_rank(0, world.node_of(rank))
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, source, tag=2 * rank)
            buffer = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(buffer, source, tag=2 * rank + 1)
            received[files[rank]] = buffer.numpy().tobytes()
            recorded = (_marker(checkpoint_dir).get("digests") or {}).get(files[rank])
            data = received[files[rank]]
            if recorded is not None and (
                len(data) != recorded["size"] or hashlib.sha256(data).hexdigest() != recorded["sha256"]
            ):
                raise CheckpointError(
                    f"{files[rank]} of {checkpoint_dir.name}, sent by {world.describe(world.node_of(rank))}, "
                    f"does not match the size and SHA-256 in {checkpoint_dir / checkpointing.MARKER}."
                )
    _wait(works)
    del outgoing
    return received


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
