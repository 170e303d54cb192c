"""Exceptions of tango-fairscale."""

from typing import Optional

from tango.common.exceptions import CliRunError, ConfigurationError, TangoError


class CheckpointError(TangoError):
    """A checkpoint is missing, incomplete, foreign, or not safe to load."""


class WrapConfigurationError(ConfigurationError, ValueError):
    """
    A ``with_wrapped_modules`` selection that cannot be applied (a pattern matching nothing, a
    class that is not there, a bad value). Also a :class:`ValueError`, which is what ai2-tango's
    bundled ``tango.integrations.fairscale`` raised for a pattern matching nothing: code that
    catches either keeps working.
    """


class WorkerCheckpointError(CheckpointError, CliRunError):
    """
    A worker's :class:`CheckpointError` (a refused checkpoint, a failed write), raised again in
    Tango's main process. Its message is the one line ``CheckpointError: ...``: Tango prints a
    ``CliRunError`` as its message alone, without the spawned worker's traceback quoted in the
    traceback of ``mp.spawn`` (``--log-level debug`` logs that traceback).
    """


#: How a worker's traceback, quoted by ``torch.multiprocessing``, ends for a :class:`CheckpointError`.
_QUOTED_CHECKPOINT_ERROR = f"{CheckpointError.__module__}.{CheckpointError.__qualname__}: "


def worker_checkpoint_error(error: BaseException) -> Optional[WorkerCheckpointError]:
    """
    The :class:`WorkerCheckpointError` of ``error``, a worker's failure as ``mp.spawn`` raises it
    (its message quotes the worker's traceback), when the worker failed with a
    :class:`CheckpointError`; ``None`` for any other error. CheckpointError messages are one line.
    """
    lines = [line for line in str(error).splitlines() if line.strip()]
    if not lines or not lines[-1].startswith(_QUOTED_CHECKPOINT_ERROR):
        return None
    if not any(line.startswith("Traceback (most recent call last)") for line in lines):
        return None
    return WorkerCheckpointError(f"CheckpointError: {lines[-1][len(_QUOTED_CHECKPOINT_ERROR) :]}")
