"""
Checkpoints of FSDP2 models through ``torch.distributed.checkpoint`` (DCP), in this package's
checkpoint protocol: a directory that counts only once its ``COMPLETE.json`` marker is there,
whose every file the marker lists with size and SHA-256, and that loads without running pickled
code.

Layout of a checkpoint directory (``checkpoint_state_step<N>``)::

    dcp/.metadata            DCP's index of the shards (a pickle: see "Loading safely" below)
    dcp/__{r}_0.distcp       worker r's shards of the model and optimizer state
    worker{r}_{name}.pt      worker r's replicated extra states (trainer, lr_scheduler, ...),
                             written with tango_fairscale.checkpointing.atomic_save and a header
    worker{r}_buffers.pt     worker r's own buffers (BUFFERS_STATE), for a model that has any
    COMPLETE.json            written last, by save_sharded (the commit sequence of both backends)

DCP reshards on load: a checkpoint saved by N workers loads on M (any mesh).

Across hosts, each with its own disk (see :mod:`tango_fairscale.launch.multihost`), each host's directory
holds its own workers' files and a ``.metadata`` of its own: DCP writes a value that several
workers hold (an optimizer step count; under hybrid sharding, every shard, held once per host)
only once, and its one metadata file, on the coordinator's host, names where. Here such a value is
written once *per host* (:class:`_PerHostSavePlanner`), and every host gets the same index of the
shards, pointing at its own files wherever it has the value (:class:`_PerHostWriter`): a host's
part then loads from its own disk when nothing is resharded.

Loading safely. DCP's :class:`~torch.distributed.checkpoint.FileSystemReader` reads tensors with
``torch.load(weights_only=True)``, but unpickles ``.metadata`` with plain :func:`pickle.load`,
and its default planner loads non-tensor values (optimizer hyper-parameters) with
``torch.load(weights_only=False)``: both run arbitrary code from a hostile file. Here:

1. every file is checked against the marker first (a regular file, its size and SHA-256), so only
   the files this package's save wrote, unchanged, are read; every file DCP's metadata points to
   must be one of them (no path leaves the checkpoint);
2. ``.metadata`` is unpickled by an unpickler that only resolves DCP's own metadata classes,
   ``torch.Size``, dtypes and paths (:data:`METADATA_GLOBALS`): anything else is refused before
   it is called;
3. non-tensor values are loaded with ``torch.load(weights_only=True)``.

The marker sits in the same directory, so (1) proves integrity (no torn, mixed or edited files),
not authorship: someone who can write the directory can rewrite the marker. (2) and (3) are what
keep such a directory from running code; the worst it can do is hold wrong numbers.
"""

import copy
import logging
import os
import pickle
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import AbstractSet, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.storage import WriteResult

from ... import checkpointing, compat
from ...checkpointing import pretrained_base
from ...checkpointing.commit import commit
from ...checkpointing.compatible import check_same_optimizer, check_same_shapes
from ...checkpointing.streaming import TensorEntry
from ...errors import CheckpointError
from ...topology import Topology
from ..lookup import check_written_by, holds_worker_files
from .buffers import BUFFERS_STATE, own_buffers, restore_own_buffers, worker_0_buffers
from .safe_reading import (
    METADATA_FILE,
    METADATA_GLOBALS,
    _dcp_call,
    _SafeEmptyStateDictLoadPlanner,
    _SafeFileSystemReader,
    _SafeLoadPlanner,
    read_metadata,
)

logger = logging.getLogger(__name__)

#: What the marker of a torch-backend (DCP) checkpoint says about its format.
MARKER_FIELDS = {"backend": "torch", "format": "dcp"}
#: The subdirectory of a torch-backend checkpoint that DCP writes into.
DCP_DIR = "dcp"


def is_torch_checkpoint(marker: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's marker says the torch backend (DCP) wrote it."""
    return all(marker.get(key) == value for key, value in MARKER_FIELDS.items())


def dcp_files_of_worker(marker: Mapping[str, Any], rank: int) -> List[str]:
    """Worker ``rank``'s DCP data files (relative to the checkpoint) in a torch-backend checkpoint."""
    prefix = f"{DCP_DIR}/__{rank}_"
    return sorted(name for name in marker.get("digests") or {} if name.startswith(prefix))


def _require_torch_marker(
    checkpoint_dir: Path, rank: Optional[int] = None, world_size: int = 0
) -> Dict[str, Any]:
    """
    The marker of a complete torch-backend checkpoint or, with ``rank``, of one that worker
    ``rank`` of ``world_size`` workers can load without resharding (a host's part of a checkpoint
    across hosts); else a :class:`CheckpointError` saying what is wrong.
    """
    if checkpoint_dir.is_dir() and (checkpoint_dir / DCP_DIR).is_dir():
        marker = checkpointing.read_marker(checkpoint_dir)
        if marker is None:
            raise CheckpointError(
                f"{checkpoint_dir} is an incomplete checkpoint: it has no {checkpointing.MARKER}, so its "
                "save was interrupted. Use an earlier complete checkpoint."
            )
        check_written_by(checkpoint_dir, marker, "torch")
        if rank is not None and holds_worker_files(checkpoint_dir, marker, world_size, rank):
            return marker
    marker = checkpointing.require_complete(checkpoint_dir)
    check_written_by(checkpoint_dir, marker, "torch")
    return marker


def _agree(error: Optional[str]) -> None:
    """Raise the first worker's error on every worker (none is left waiting in a collective)."""
    if dist.is_available() and dist.is_initialized():
        errors: List[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise CheckpointError(error)


def _dcp_files(checkpoint_dir: Path, marker: Mapping[str, Any]) -> List[str]:
    """The DCP files the marker lists (as paths relative to the checkpoint), metadata first."""
    prefix = f"{DCP_DIR}/"
    names = sorted(name for name in marker.get("digests") or {} if name.startswith(prefix))
    metadata = f"{DCP_DIR}/{METADATA_FILE}"
    if metadata not in names:
        raise CheckpointError(
            f"{checkpoint_dir}'s {checkpointing.MARKER} lists no {metadata}: it is not a complete "
            "torch-backend checkpoint."
        )
    names.remove(metadata)
    if (checkpoint_dir / DCP_DIR).is_symlink():
        raise CheckpointError(
            f"{checkpoint_dir / DCP_DIR} is a symbolic link; links inside a checkpoint are not followed."
        )
    return [metadata, *names]


def _verify_dcp_files(
    checkpoint_dir: Path, marker: Mapping[str, Any], hashes: bool
) -> Tuple[Set[str], Set[str]]:
    """
    Check the DCP files this worker may read against the marker: in a complete checkpoint every
    file, in a host's part the metadata and the files of the host's workers (one of them may
    hold a value they all need). The workers that read the same directory (same host, same
    inode) split the hashing of those files; each checks the metadata it reads itself. Every
    worker learns every failure, and none is left waiting in a collective. Returns the names,
    relative to the DCP directory, of the files the marker lists and of those this worker may read.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    names: List[str] = []
    readable: List[str] = []
    directory: Optional[Tuple[str, int, int]] = None
    error: Optional[str] = None
    try:
        names = _dcp_files(checkpoint_dir, marker)
        if checkpointing.is_complete(checkpoint_dir):
            readable = names
        else:
            workers = list((marker.get("host") or {}).get("workers") or [rank])
            own = {name for worker in workers for name in dcp_files_of_worker(marker, worker)}
            readable = [names[0], *(name for name in names[1:] if name in own)]
        # Hosts on separate disks may hold directories of the same path: the host name tells
        # them apart, the inode tells apart directories of one host.
        status = checkpoint_dir.stat()
        directory = (socket.gethostname(), status.st_dev, status.st_ino)
    except (CheckpointError, OSError) as failure:
        error = str(failure)
    gathered: List[Any] = [(error, directory)]
    if distributed:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (error, directory))
    first = next((e for e, _ in gathered if e is not None), None)
    if first is not None:  # every worker gathered the same errors: all raise
        raise CheckpointError(first)
    readers = [worker for worker, (_, other) in enumerate(gathered) if other == directory]
    mine = [readable[0], *readable[1:][readers.index(rank) :: len(readers)]]
    try:
        checkpointing.verify_files(checkpoint_dir, dict(marker), mine, hashes=hashes)
    except CheckpointError as failure:
        error = str(failure)
    _agree(error)
    return {name[len(DCP_DIR) + 1 :] for name in names}, {name[len(DCP_DIR) + 1 :] for name in readable}


class _PerHostSavePlanner(DefaultSavePlanner):
    """
    DCP's save planner, deduplicating what several workers hold within each host instead of
    across all of them: every host's files then hold every value its workers hold. The metadata
    still lists each shard once (from the global deduplication), so loading plans as usual.
    On one host this is DCP's default.
    """

    def __init__(self, node_of_rank: Sequence[int]) -> None:
        super().__init__()
        self._node_of_rank = list(node_of_rank)

    def _dedup_save_plans(self, all_plans: List[SavePlan]) -> List[SavePlan]:
        by_node: Dict[int, List[int]] = {}
        for rank, node in enumerate(self._node_of_rank):
            by_node.setdefault(node, []).append(rank)
        plans = list(all_plans)
        for ranks in by_node.values():
            deduplicated = dedup_save_plans([all_plans[r] for r in ranks], self.dedup_save_to_lowest_rank)
            for rank, plan in zip(ranks, deduplicated):
                plans[rank] = plan
        return plans

    def _create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        # Metadata from one copy of each value (DCP's own deduplication and checks), the plans
        # (what each worker writes) from the per-host one. Index hints are hints only
        # (MetadataIndex compares by name and offset), so the plans need no rewriting.
        _, metadata = super()._create_global_plan(dedup_save_plans(all_plans, self.dedup_save_to_lowest_rank))
        return self._dedup_save_plans(all_plans), metadata


compat.check_dcp_planner_overrides(_PerHostSavePlanner)


class _PerHostWriter(dcp.FileSystemWriter):
    """
    DCP's file writer whose coordinator builds one metadata per host (:attr:`per_host`), each
    pointing at that host's own files for every value the host wrote, and writes its own host's.
    """

    def __init__(self, path: Path, node_of_rank: Sequence[int]) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self._node_of_rank = list(node_of_rank)
        #: On the coordinator after the save: node rank -> that host's metadata.
        self.per_host: Dict[int, Metadata] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        with _os_error_kept():
            return super().write_data(plan, planner)

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        with _os_error_kept():
            self._finish(metadata, results)

    def _finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        def own_last(node: int) -> List[List[WriteResult]]:
            # DCP's writer lets the last write of a value name its file: this host's workers last.
            order = sorted(range(len(results)), key=lambda rank: self._node_of_rank[rank] == node)
            return [results[rank] for rank in order]

        me = self._node_of_rank[dist.get_rank() if dist.is_initialized() else 0]
        super().finish(metadata, own_last(me))  # also sets the version and storage_meta
        for node in sorted(set(self._node_of_rank)):
            host = copy.copy(metadata)
            host.storage_data = {wr.index: wr.storage_data for part in own_last(node) for wr in part}
            self.per_host[node] = host


@contextmanager
def _os_error_kept() -> Iterator[None]:
    """
    A failed write raised as its :class:`OSError`. DCP sends each worker's failure to the
    coordinator and back pickled, which drops an exception's context: ``torch.save`` on a full
    disk raises ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos`` with the
    ``OSError`` (``ENOSPC``) only as its context, so the error every worker got named no cause.
    An ``OSError`` keeps its ``errno``, ``strerror`` and file name through pickling.
    """
    try:
        yield
    except BaseException as error:
        found = checkpointing.os_error_in(error)
        if found is None or found is error:
            raise
        raise OSError(found.errno, found.strerror, found.filename) from error


def _write_host_metadata(dcp_dir: Path, metadata: Metadata) -> None:
    """Write (atomically, synced) a host's DCP metadata, as DCP's writer does on the coordinator."""
    temporary = dcp_dir / f"{METADATA_FILE}.tmp"
    with open(temporary, "wb") as handle:
        pickle.dump(metadata, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, dcp_dir / METADATA_FILE)
    checkpointing.fsync_directory(dcp_dir)


def _training_state(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer], leave_out: AbstractSet[str] = frozenset()
) -> Dict[str, Any]:
    """
    The sharded model (and optimizer) state, keyed by the plain model's parameter names, without
    the parameters named in ``leave_out`` (a pretrained frozen base, see
    :mod:`tango_fairscale.checkpointing.pretrained_base`).
    """
    if optimizer is None:
        model_state, optimizer_state = get_model_state_dict(model), None
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
    if leave_out:
        model_state = {k: v for k, v in model_state.items() if plain_name(k) not in leave_out}
    state = {"model": worker_0_buffers(model_state)}
    if optimizer_state is not None:
        state["optim"] = optimizer_state
    return state


def save_sharded(
    checkpoint_dir: Path,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    extra_states: Optional[Mapping[str, Any]] = None,
    *,
    step: Optional[int] = None,
    topology: Optional[Topology] = None,
    complete_part: Optional[Callable[[Path, Dict[str, Any]], None]] = None,
    base: Optional[pretrained_base.PretrainedBase] = None,
    fields: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """
    Save an FSDP2 model's and optimizer's shards with DCP, and this worker's ``extra_states``
    (name -> state, e.g. ``{"trainer": ..., "lr_scheduler": ...}``, replicated or per-worker
    values of plain types) as ``worker{rank}_{name}.pt``, and mark the checkpoint complete
    (:func:`tango_fairscale.checkpointing.commit.commit`: the one commit sequence of both
    backends). Collective: every worker calls it.

    ``topology`` groups the workers by host for a launch across hosts: each host's
    ``checkpoint_dir`` is then its own (its own disk), and gets its workers' files and a DCP
    metadata of its own (see the module's docstring); ``complete_part`` adds the part's fields to
    each host's marker. By default all workers share one directory. The parameters of ``base``
    (a pretrained frozen base) are left out; ``fields`` (on each host's leader, naming that base)
    go into the marker.

    Removes the directory's marker and any earlier DCP files first (a resumed run may save the
    same step again). Returns, on every worker, the marker's fields: the format, ``world_size``,
    ``training_steps`` (``step``), the extra states' names (``files``) and every file's size and
    SHA-256 (``digests``; ``dcp/.metadata`` this host's).
    """
    checkpoint_dir = Path(checkpoint_dir)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    topology = topology or Topology.one_host(world_size)
    if topology.world_size != world_size:
        raise ValueError(f"save_sharded: a topology of {topology.world_size} workers for {world_size}.")
    extra_states = dict(extra_states or {})
    for name in extra_states:
        if not name.isidentifier() or name == BUFFERS_STATE:
            raise ValueError(
                f"save_sharded: extra state names must be identifiers other than {BUFFERS_STATE!r}, "
                f"got {name!r}."
            )
    buffers = own_buffers(model)
    if buffers:
        # DCP holds worker 0's (weights.pt's); each worker resumes its own.
        extra_states[BUFFERS_STATE] = buffers
    nodes = [topology.host_of(r) for r in range(world_size)]
    dcp_dir = checkpoint_dir / DCP_DIR

    def write() -> Dict[str, Dict[str, Any]]:
        writer = _PerHostWriter(dcp_dir, nodes)
        try:
            dcp.save(
                _training_state(model, optimizer, base.names if base else frozenset()),
                storage_writer=writer,
                planner=_PerHostSavePlanner(nodes),
            )
        except CheckpointException as error:
            # DCP gathers every worker's failure; a full disk (or any OS error) becomes one line.
            failures = [checkpointing.os_error_in(failure) for failure, _ in error.failures.values()]
            found = next((failure for failure in failures if failure is not None), None)
            if found is None:
                raise
            raise checkpointing.io_failure("write", dcp_dir, found) from None
        # Each host's metadata, from the coordinator (rank 0), which wrote its own host's.
        per_host: List[Any] = [writer.per_host]
        if topology.num_hosts > 1:
            dist.broadcast_object_list(per_host, src=0)
            if topology.is_leader(rank) and nodes[rank] != nodes[0]:
                _write_host_metadata(dcp_dir, per_host[0][nodes[rank]])
        digests: Dict[str, Dict[str, Any]] = {}
        # DCP names each worker's data file by its rank.
        for path in sorted(dcp_dir.glob(f"__{rank}_*.distcp")):
            digests[f"{DCP_DIR}/{path.name}"] = checkpointing.file_digest(path)
        for name, state in extra_states.items():
            path = checkpointing.worker_file(checkpoint_dir, rank, name)
            digests[path.name] = checkpointing.atomic_save(
                checkpointing.with_header(state, kind=name, rank=rank, world_size=world_size, step=step), path
            )
        if topology.is_leader(rank):
            # Each host's marker lists its own metadata (commit's merge keeps the leader's digest).
            digests[f"{DCP_DIR}/{METADATA_FILE}"] = checkpointing.file_digest(dcp_dir / METADATA_FILE)
        return digests

    return commit(
        checkpoint_dir,
        topology,
        rank,
        write,
        {
            **MARKER_FIELDS,
            "training_steps": step,
            "files": sorted(extra_states),
            **(fields or {}),
        },
        clear=[DCP_DIR],
        complete_part=complete_part,
    )


def _check_same_parameters(metadata: Metadata, model_state: Mapping[str, Any], checkpoint_dir: Path) -> None:
    """
    A checkpoint of a model with other parameters: DCP would load the common ones and silently
    leave the rest (fewer saved), or fail deep inside its planner (more saved). Refused, naming
    what is missing and what is extra.
    """
    saved = {
        key[len("model.") :]
        for key, value in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(value, TensorStorageMetadata)
    }
    expected = {key for key, value in model_state.items() if isinstance(value, torch.Tensor)}
    missing, extra = sorted(expected - saved), sorted(saved - expected)
    if missing or extra:
        raise CheckpointError(
            f"{checkpoint_dir} was saved from a model with other parameters: "
            + "; ".join(
                part
                for part in (
                    f"{len(missing)} of this model's are not in it ({', '.join(missing[:5])}"
                    f"{', ...' if len(missing) > 5 else ''})"
                    if missing
                    else "",
                    f"{len(extra)} in it are not this model's ({', '.join(extra[:5])}"
                    f"{', ...' if len(extra) > 5 else ''})"
                    if extra
                    else "",
                )
                if part
            )
            + ". Resume it with the model it was saved from."
        )


def _check_same_shapes_and_optimizer(
    metadata: Metadata,
    model_state: Mapping[str, Any],
    optimizer: Optional[torch.optim.Optimizer],
    checkpoint_dir: Path,
) -> None:
    """
    A checkpoint of a model of another size, or of another optimizer, refused as the fairscale
    backend refuses it: DCP failed on them with a size mismatch or a missing key, which read as
    files swapped after the save.
    """
    saved_shapes = {
        key[len("model.") :]: tuple(item.size)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }
    local_shapes = {
        key: tuple(value.shape) for key, value in model_state.items() if isinstance(value, torch.Tensor)
    }
    check_same_shapes(saved_shapes, local_shapes, f"checkpoint {checkpoint_dir}")
    if optimizer is None:
        return
    # DCP flattens the optimizer's param_groups into "optim.param_groups.<index>.<option>".
    groups: Dict[int, List[str]] = {}
    for key in metadata.state_dict_metadata:
        parts = key.split(".")
        if len(parts) >= 4 and parts[:2] == ["optim", "param_groups"] and parts[2].isdigit():
            groups.setdefault(int(parts[2]), []).append(parts[3])
    check_same_optimizer([groups[index] for index in sorted(groups)], optimizer, checkpoint_dir)


def load_sharded(
    checkpoint_dir: Path,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    *,
    hashes: bool = True,
    base: Optional[pretrained_base.PretrainedBase] = None,
    hash_base: bool = True,
) -> Dict[str, Any]:
    """
    Load a complete checkpoint of :func:`save_sharded` into an FSDP2 ``model`` (and
    ``optimizer``), saved by any number of workers: DCP reads each worker's part of every saved
    shard. Across hosts, a host's part of a checkpoint of the same world size loads too (its
    workers read their host's files only). Collective: every worker calls it. Returns this
    worker's extra states (name -> state): its own file, or worker 0's for a worker the saving
    run did not have. Each worker's buffers are its own as saved (on another number of workers,
    the saving run's worker 0's, as on the fairscale backend).

    Every file is checked against the marker before it is read, and nothing is unpickled beyond
    DCP's metadata classes and plain values (see the module's docstring). A checkpoint of the
    fairscale backend, or one that fails a check, is a :class:`CheckpointError` on every worker.
    """
    checkpoint_dir = Path(checkpoint_dir).resolve()
    rank = dist.get_rank()
    marker: Dict[str, Any] = {}
    error: Optional[str] = None
    try:
        marker = _require_torch_marker(checkpoint_dir, rank, dist.get_world_size())
    except CheckpointError as failure:
        error = str(failure)
    _agree(error)
    allowed, readable = _verify_dcp_files(checkpoint_dir, marker, hashes)
    metadata = read_metadata(checkpoint_dir / DCP_DIR / METADATA_FILE)
    saved = {
        plain_name(key[len("model.") :]) for key in metadata.state_dict_metadata if key.startswith("model.")
    }
    # The pretrained frozen base the checkpoint left out: the model holds it already, read from
    # the same files (checked here, on every worker alike, so that all raise or none does).
    left_out = {name for name in (base.names if base else ()) if name not in saved}
    if left_out:
        error = None
        try:
            saved_base = pretrained_base.saved_base(marker)
            pretrained_base.check_same_base(saved_base, base, sorted(left_out))
            assert saved_base is not None
            pretrained_base.check_files(saved_base, hashes=hashes and hash_base)
        except CheckpointError as failure:
            error = str(failure)
        _agree(error)
    state = _training_state(model, optimizer, left_out)
    # Checked on every worker alike (same metadata, same model), so all raise or none does.
    _check_same_parameters(metadata, state["model"], checkpoint_dir)
    _check_same_shapes_and_optimizer(metadata, state["model"], optimizer, checkpoint_dir)
    _dcp_call(
        dcp.load,
        state,
        storage_reader=_SafeFileSystemReader(checkpoint_dir / DCP_DIR, allowed, readable),
        planner=_SafeLoadPlanner(),
    )
    # Without the left-out base, the state dict is not the whole model's: not strict.
    options = StateDictOptions(strict=not left_out)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
    source = rank if rank < marker["world_size"] else 0
    states = {
        name: checkpointing.read_worker_state(checkpoint_dir, marker, source, name, hashes=hashes)
        for name in checkpointing.saved_file_names(marker)
    }
    buffers = states.pop(BUFFERS_STATE, None)
    if buffers is not None and marker["world_size"] == dist.get_world_size():
        restore_own_buffers(model, buffers)
    return states


#: The path parts that wrappers add to parameter names: torch's checkpoint wrapper, FSDP1's.
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def plain_name(name: str) -> str:
    """A parameter name without wrapper levels (``blocks.0._checkpoint_wrapped_module.linear.weight``)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def consolidate_dcp(
    checkpoint_dir: Path, *, with_optimizer: bool = False, hashes: bool = True
) -> Dict[str, Any]:
    """
    The plain model's state dict (full tensors on the CPU, plain parameter names) from a complete
    checkpoint of :func:`save_sharded`, read in this process alone (no process group needed, and
    none used if there is one). Loads strictly into the unwrapped model. Holds the whole model in
    memory. With ``with_optimizer``, ``{"model": ..., "optimizer": ...}`` instead, the optimizer
    state keyed by plain parameter name as for the fairscale backend:
    ``{"state": {name: {"exp_avg": ..., "step": ...}}, "param_groups": [{..., "params": [names]}]}``.
    """
    checkpoint_dir = Path(checkpoint_dir).resolve()
    marker = _require_torch_marker(checkpoint_dir)
    return _consolidate(checkpoint_dir, marker, with_optimizer=with_optimizer, hashes=hashes)


def _link_part(checkpoint_dir: Path, received_dir: Path) -> Tuple[Dict[str, Any], Set[str]]:
    """
    Link this host's DCP files of ``checkpoint_dir`` (a host's part of a checkpoint across hosts)
    in beside those received from the other hosts in ``received_dir`` (under their names relative
    to the checkpoint, already checked against the marker, e.g. by
    :func:`tango_fairscale.launch.multihost.receive_missing_files`); returns the marker and the names of
    the received files.
    """
    marker = checkpointing.read_marker(checkpoint_dir)
    if marker is None:
        raise CheckpointError(f"{checkpoint_dir} has no {checkpointing.MARKER}.")
    check_written_by(checkpoint_dir, marker, "torch")
    names = _dcp_files(checkpoint_dir, marker)
    received = {name for name in names if (received_dir / name).is_file()}
    (received_dir / DCP_DIR).mkdir(parents=True, exist_ok=True)
    for name in names:
        if name not in received and (checkpoint_dir / name).is_file():
            try:
                os.link(checkpoint_dir / name, received_dir / name)
            except OSError:  # a filesystem without hard links
                shutil.copy2(checkpoint_dir / name, received_dir / name)
    return marker, received


def _verified_files(
    root: Path, marker: Dict[str, Any], *, hashes: bool, hashed: AbstractSet[str] = frozenset()
) -> Set[str]:
    """
    Check the DCP files under ``root`` against the marker (SHA-256 with ``hashes``; files in
    ``hashed`` were hashed already, and only their sizes are checked again) and return their
    names relative to the DCP directory: the files a :class:`_SafeFileSystemReader` may read.
    """
    names = _dcp_files(root, marker)
    checkpointing.verify_files(root, marker, [name for name in names if name not in hashed], hashes=hashes)
    checkpointing.verify_files(root, marker, [name for name in names if name in hashed], hashes=False)
    return {name[len(DCP_DIR) + 1 :] for name in names}


def _consolidate(
    checkpoint_dir: Path, marker: Dict[str, Any], *, with_optimizer: bool, hashes: bool
) -> Dict[str, Any]:
    """:func:`consolidate_dcp` of a resolved checkpoint directory whose marker was checked."""
    allowed = _verified_files(checkpoint_dir, marker, hashes=hashes)
    keys = {"model", "optim"} if with_optimizer else {"model"}
    loaded: Dict[str, Any] = {}
    _dcp_call(
        _load_state_dict,
        loaded,
        storage_reader=_SafeFileSystemReader(checkpoint_dir / DCP_DIR, allowed),
        planner=_SafeEmptyStateDictLoadPlanner(keys=keys),
        no_dist=True,
    )
    model = pretrained_base.add_base_tensors(
        _plain_keys(loaded.get("model", {}), checkpoint_dir), marker, hashes=hashes
    )
    if not with_optimizer:
        return model
    saved = loaded.get("optim", {})
    optimizer = {
        "state": _plain_keys(saved.get("state", {}), checkpoint_dir),
        "param_groups": [
            {**group, "params": [plain_name(name) for name in group.get("params", [])]}
            for group in saved.get("param_groups", [])
        ],
    }
    return {"model": model, "optimizer": optimizer}


class ConsolidatedDcpModel:
    """
    The model part of :func:`consolidate_dcp`, one tensor at a time: :attr:`entries` from DCP's
    metadata, :meth:`produce` reads one full tensor (each worker's chunks of it, nothing else).
    With :func:`~tango_fairscale.checkpointing.streaming.stream_save` the peak is the largest
    tensor, not the model. The files are checked against the marker here, before anything is
    read; files in ``hashed`` were hashed already (received from another host), and only their
    sizes are checked again.
    """

    def __init__(
        self,
        root: Path,
        checkpoint_dir: Path,
        marker: Dict[str, Any],
        *,
        hashes: bool = True,
        hashed: AbstractSet[str] = frozenset(),
    ) -> None:
        self._allowed = _verified_files(root, marker, hashes=hashes, hashed=hashed)
        self._root = root
        metadata = _SafeFileSystemReader(root / DCP_DIR, self._allowed).read_metadata()
        self._fqns: Dict[str, str] = {}
        entries: List[TensorEntry] = []
        for fqn, item in metadata.state_dict_metadata.items():
            if not fqn.startswith("model."):
                continue
            if not isinstance(item, TensorStorageMetadata):
                raise CheckpointError(f"{checkpoint_dir}: the model entry {fqn!r} is not a tensor.")
            name = plain_name(fqn[len("model.") :])
            if name in self._fqns:
                raise CheckpointError(f"{checkpoint_dir}: two saved entries are both named {name!r}.")
            self._fqns[name] = fqn
            entries.append(TensorEntry(name, tuple(item.size), item.properties.dtype))
        self.entries = entries

    def produce(self, entry: TensorEntry) -> torch.Tensor:
        """The full tensor of ``entry`` (one of :attr:`entries`), read from the DCP files."""
        fqn = self._fqns[entry.name]
        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        _dcp_call(
            _load_state_dict,
            {fqn: tensor},
            storage_reader=_SafeFileSystemReader(self._root / DCP_DIR, self._allowed),
            planner=_SafeLoadPlanner(),
            no_dist=True,
        )
        return tensor


def dcp_model_source(checkpoint_dir: Path, *, hashes: bool = True) -> Any:
    """:class:`ConsolidatedDcpModel` of a complete checkpoint of :func:`save_sharded`."""
    checkpoint_dir = Path(checkpoint_dir).resolve()
    marker = _require_torch_marker(checkpoint_dir)
    return pretrained_base.with_base(  # type: ignore[no-any-return]
        ConsolidatedDcpModel(checkpoint_dir, checkpoint_dir, marker, hashes=hashes), marker, hashes=hashes
    )


def dcp_part_model_source(checkpoint_dir: Path, received_dir: Path, *, hashes: bool = True) -> Any:
    """
    :class:`ConsolidatedDcpModel` of a host's part of a checkpoint across hosts whose other DCP
    data files were received into ``received_dir`` (see :func:`_link_part`): this host's files are
    linked in beside them and checked before anything is read. It reads from ``received_dir``,
    which must outlive it; the caller removes it.
    """
    checkpoint_dir, received_dir = Path(checkpoint_dir).resolve(), Path(received_dir)
    marker, received = _link_part(checkpoint_dir, received_dir)
    return pretrained_base.with_base(  # type: ignore[no-any-return]
        ConsolidatedDcpModel(received_dir, checkpoint_dir, marker, hashes=hashes, hashed=received),
        marker,
        hashes=hashes,
    )


def _plain_keys(entries: Mapping[str, Any], checkpoint_dir: Path) -> Dict[str, Any]:
    result: Dict[str, Any] = {}
    for key, value in entries.items():
        clean = plain_name(key)
        if clean in result:
            raise CheckpointError(f"{checkpoint_dir}: two saved entries are both named {clean!r}.")
        result[clean] = value
    return result


__all__ = [
    "DCP_DIR",
    "MARKER_FIELDS",
    "METADATA_GLOBALS",
    "consolidate_dcp",
    "dcp_files_of_worker",
    "dcp_model_source",
    "dcp_part_model_source",
    "is_torch_checkpoint",
    "load_sharded",
    "plain_name",
    "read_metadata",
    "save_sharded",
]
