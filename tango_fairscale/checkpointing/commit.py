"""
The one sequence that turns files written by every worker into a checkpoint, for both backends
(each backend supplies only what its workers write):

1. each host's leader (:class:`~tango_fairscale.topology.Topology`) creates the directory and
   removes its marker, so that the directory stops counting as a checkpoint before any file in it
   changes (a resumed run may save the same step again), and what the backend names in ``clear``;
2. a barrier: no worker writes before that;
3. every worker writes its files and returns their digests (size and SHA-256);
4. the digests are gathered from every worker: after that every file of every host is on disk;
5. each host's leader completes its host's part (across hosts: the other hosts' files linked in
   where it can read them, and the part's description), then writes the marker (a failure
   before that removes the partial directory);
6. a barrier: every host's marker is written before any host goes on and removes its older
   checkpoints, so that the hosts always have a newest checkpoint in common.
"""

import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch.distributed as dist

from ..topology import Topology
from .files import MARKER, write_marker

#: A file's digest, as :func:`~tango_fairscale.checkpointing.file_digest` returns it.
Digests = Dict[str, Dict[str, Any]]


def merge_digests(gathered: Sequence[Optional[Digests]], topology: Topology, rank: int) -> Digests:
    """
    Every worker's digests, as ``rank``'s host lists them: a file that each host writes a copy of
    (DCP's ``.metadata``) is listed with this host's leader's digest.
    """
    merged: Digests = {}
    for part in gathered:
        merged.update(part or {})
    merged.update(gathered[topology.leader_of(topology.host_of(rank))] or {})
    return dict(sorted(merged.items()))


def commit(
    checkpoint_dir: Path,
    topology: Topology,
    rank: int,
    write: Callable[[], Digests],
    fields: Mapping[str, Any],
    *,
    clear: Sequence[str] = (),
    complete_part: Optional[Callable[[Path, Dict[str, Any]], None]] = None,
) -> Dict[str, Any]:
    """
    Run the sequence above on every worker (it is collective) and return the marker's fields:
    ``fields`` with ``world_size`` and the merged ``digests``. ``write`` writes this worker's
    files and returns their digests; ``clear`` names entries of the directory (files or folders) a
    new save replaces wholesale; ``complete_part`` (across hosts) adds to the marker's fields, on
    each host's leader, before the marker is written.
    """
    checkpoint_dir = Path(checkpoint_dir)
    leader = topology.is_leader(rank)
    if leader:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        (checkpoint_dir / MARKER).unlink(missing_ok=True)
        for name in clear:
            path = checkpoint_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    dist.barrier()
    try:
        digests = write()
        gathered: List[Optional[Digests]] = [None] * topology.world_size
        dist.all_gather_object(gathered, digests)
        marker_fields: Dict[str, Any] = {
            **fields,
            "world_size": topology.world_size,
            "digests": merge_digests(gathered, topology, rank),
        }
        if leader:
            if complete_part is not None:
                complete_part(checkpoint_dir, marker_fields)
            write_marker(checkpoint_dir, world_size=topology.world_size, extra=marker_fields)
    except BaseException:
        # A save that failed (a full disk here, a worker that died elsewhere) leaves no partial
        # checkpoint to fill the disk: it never got its marker, so nothing would resume from it.
        # Every worker that sees the failure removes it (the one that failed first, before its
        # peers may be stopped); a run started again removes what a killed save left
        # (tango_fairscale.checkpointing.resume). The last complete checkpoint and the latest
        # link are untouched.
        if not (checkpoint_dir / MARKER).exists():
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
        raise
    dist.barrier()
    return marker_fields
