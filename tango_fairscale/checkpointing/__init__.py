"""
Sharded training checkpoints: written atomically per worker, counted only once complete,
read back with ``torch.load(..., weights_only=True)``, and consolidated offline.

A checkpoint is a directory (Tango's ``checkpoint_state_step<N>``) holding, per worker ``r``::

    worker{r}_model.pt         {"weights": FSDP local (sharded) state dict, "metadata": FSDP shard metadata}
    worker{r}_optimizer.pt     the optimizer state of that worker's shard
    worker{r}_lr_scheduler.pt  (when there is a scheduler)
    worker{r}_grad_scaler.pt   (when there is a grad scaler)
    worker{r}_trainer.pt       Tango's trainer state (step, best metric, callbacks)

and, written by worker 0 after every worker has finished its files, the marker
``COMPLETE.json``. A directory without the marker is an interrupted save and is never resumed
from.

The model file also records, in ``"optimizer_keys"``, which flat parameter each optimizer
state entry belongs to. With the shard padding in the metadata, that is enough to rebuild the
full (unsharded) model and optimizer state offline, and to reshard both for another number of
workers (:mod:`tango_fairscale.backends.fairscale_fsdp.resharding`).
"""

from ..errors import CheckpointError
from .files import (
    FORMAT_VERSION,
    HEADER_KEY,
    MARKER,
    STATE_NAMES,
    STEP_ID_FIELD,
    atomic_save,
    file_digest,
    fsync_directory,
    io_failure,
    is_complete,
    newest_complete_checkpoint,
    os_error_in,
    read_marker,
    read_worker_state,
    require_complete,
    resolve_checkpoint,
    safe_load,
    saved_file_names,
    verify_files,
    with_header,
    without_header,
    worker_file,
    write_marker,
)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_KEY",
    "MARKER",
    "STATE_NAMES",
    "STEP_ID_FIELD",
    "CheckpointError",
    "atomic_save",
    "file_digest",
    "fsync_directory",
    "io_failure",
    "is_complete",
    "newest_complete_checkpoint",
    "os_error_in",
    "read_marker",
    "read_worker_state",
    "require_complete",
    "resolve_checkpoint",
    "safe_load",
    "saved_file_names",
    "verify_files",
    "with_header",
    "without_header",
    "worker_file",
    "write_marker",
]
