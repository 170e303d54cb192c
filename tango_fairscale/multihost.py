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
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from . import checkpointing
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
        own_files = marker["world_size"] == world_size and all(
            checkpointing.worker_file(path, rank, name).is_file()
            for name in checkpointing.saved_file_names(marker)
        )
        if own_files or checkpointing.is_complete(path):
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


def link_other_hosts_files(checkpoint_dir: Path, world: HostWorld, names: Sequence[str]) -> bool:
    """
    From each host whose work directory this one reads (``world.visible``): hard-link their files ``names``
    of this checkpoint into ``checkpoint_dir``, which is then complete. Call after every worker
    has written its files. Returns ``False`` (and links nothing more) when a host's files cannot
    be linked (another filesystem, no permission): the checkpoint stays this host's part.
    """
    checkpoint_dir = Path(checkpoint_dir)
    for node, info in enumerate(world.hosts):
        if node == world.node_rank or not world.visible[node]:
            continue
        source_dir = Path(info.work_dir) / checkpoint_dir.name
        for rank in world.ranks_of(node):
            for name in names:
                source = checkpointing.worker_file(source_dir, rank, name)
                target = checkpointing.worker_file(checkpoint_dir, rank, name)
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
    checkpointing.fsync_directory(checkpoint_dir)
    return True


def gather_model_shards(checkpoint_dir: Path, world: HostWorld) -> List[Dict[str, Any]]:
    """
    Every worker's model state of the checkpoint, on the first worker of each host (call it on
    each of them, and only there: it exchanges point-to-point with the others only). Files this
    host has are read here; the others are sent by the first worker of the host that wrote them.
    """
    checkpoint_dir = Path(checkpoint_dir)
    world_size, me = world.world_size, world.global_rank(0)
    leaders = {node: world.global_rank(0, node) for node in range(world.num_nodes) if node != world.node_rank}
    have = torch.tensor(
        [checkpointing.worker_file(checkpoint_dir, r, "model").is_file() for r in range(world_size)],
        dtype=torch.uint8,
    )
    # 1. Which model files each host holds.
    held = {node: torch.zeros(world_size, dtype=torch.uint8) for node in leaders}
    works = [dist.isend(have, leader) for leader in leaders.values()]
    works += [dist.irecv(held[node], leader) for node, leader in leaders.items()]
    _wait(works, "exchange which model files each host holds")
    # 2. Each host sends the files of its own workers that another host lacks. Sends are
    # asynchronous, so that two hosts sending to each other cannot wait on each other.
    outgoing: List[torch.Tensor] = []
    works = []
    for node, leader in leaders.items():
        for rank in world.ranks_of(world.node_rank):
            if not held[node][rank]:
                payload = torch.frombuffer(
                    bytearray(checkpointing.worker_file(checkpoint_dir, rank, "model").read_bytes()),
                    dtype=torch.uint8,
                )
                size = torch.tensor([payload.numel()], dtype=torch.int64)
                outgoing += [size, payload]
                works += [
                    dist.isend(size, leader, tag=2 * rank),
                    dist.isend(payload, leader, tag=2 * rank + 1),
                ]
    received: Dict[int, torch.Tensor] = {}
    for rank in range(world_size):
        if not have[rank]:
            if world.node_of(rank) == world.node_rank:
                raise CheckpointError(
                    f"{checkpointing.worker_file(checkpoint_dir, rank, 'model')} is missing."
                )
            source = world.global_rank(0, world.node_of(rank))
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, source, tag=2 * rank)
            received[rank] = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(received[rank], source, tag=2 * rank + 1)
    _wait(works, "send this host's model files")
    del outgoing
    marker = checkpointing.read_marker(checkpoint_dir)
    if marker is None:
        raise CheckpointError(f"{checkpoint_dir} has no {checkpointing.MARKER}.")
    shards = []
    for rank in range(world_size):
        if rank in received:
            shards.append(_read_received(received.pop(rank), checkpoint_dir, marker, rank, world))
        else:
            shards.append(checkpointing.read_worker_state(checkpoint_dir, marker, rank, "model"))
    if me == 0:
        logger.info("Gathered the model files of %d workers on %d hosts", world_size, world.num_nodes)
    return shards


def _wait(works: Sequence[Any], what: str) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _read_received(
    payload: torch.Tensor, checkpoint_dir: Path, marker: Dict[str, Any], rank: int, world: HostWorld
) -> Any:
    """
    A model file received from another host, checked as the library checks one on disk: its size
    and SHA-256 against this host's marker (which lists every worker's files), read with
    ``weights_only``, its header against this checkpoint.
    """
    path = checkpointing.worker_file(checkpoint_dir, rank, "model")
    origin = f"{path.name} of {checkpoint_dir.name}, sent by {world.describe(world.node_of(rank))}"
    data = payload.numpy().tobytes()
    recorded = (marker.get("digests") or {}).get(path.name)
    if recorded is not None and (
        len(data) != recorded["size"] or hashlib.sha256(data).hexdigest() != recorded["sha256"]
    ):
        raise CheckpointError(
            f"{origin} does not match the size and SHA-256 in {checkpoint_dir / checkpointing.MARKER}."
        )
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - weights_only refusals and damaged files alike
        raise CheckpointError(f"Cannot read {origin}: {type(error).__name__}: {error}") from None
    return checkpointing.without_header(
        state,
        path,
        kind="model",
        rank=rank,
        world_size=marker["world_size"],
        step=marker.get("training_steps"),
    )


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
