"""Exceptions of tango-fairscale."""

import difflib
from typing import Iterable, Optional

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


class Refused(CliRunError):
    """
    A refusal of this package or a configuration error (``ConfigurationError`` and its kinds),
    whichever process raised it, raised again in Tango's main process as the one line
    ``Type: message``: Tango prints a ``CliRunError`` as its message alone, where it printed
    these inside 25-47 lines of "Uncaught exception" (``--log-level debug`` logs the original).
    """


def did_you_mean(key: str, options: Iterable[str]) -> Optional[str]:
    """ "did you mean 'X'?" for the option nearest a misspelt ``key``; ``None`` when none is near."""
    nearest = difflib.get_close_matches(key, list(options), n=1)
    return f"did you mean {nearest[0]!r}?" if nearest else None


#: How a worker's traceback, quoted by ``torch.multiprocessing``, ends for a :class:`CheckpointError`.
_QUOTED_CHECKPOINT_ERROR = f"{CheckpointError.__module__}.{CheckpointError.__qualname__}: "
#: The qualified names, as a quoted traceback's last line gives them, of the other errors a worker
#: raises as one line: configuration mistakes found in the workers, collectives that timed out or
#: that the workers disagree on.
_QUOTED_ONE_LINE_ERRORS = (
    "tango.common.exceptions.ConfigurationError",
    f"{WrapConfigurationError.__module__}.{WrapConfigurationError.__qualname__}",
    "tango_fairscale.cpu.collectives.CollectiveTimeoutError",
    "tango_fairscale.backends.torch_fsdp2.collectives.CollectiveMismatchError",
)


def worker_checkpoint_error(error: BaseException) -> Optional[CliRunError]:
    """
    The one-line error of ``error``, a worker's failure as ``mp.spawn`` raises it (its message
    quotes the worker's traceback): a :class:`WorkerCheckpointError` for a
    :class:`CheckpointError`, a :class:`Refused` for a configuration error or a collective that
    timed out; ``None`` for any other error. Those errors' messages are one line.
    """
    lines = [line for line in str(error).splitlines() if line.strip()]
    if not lines or not any(line.startswith("Traceback (most recent call last)") for line in lines):
        return None
    last = lines[-1]
    if last.startswith(_QUOTED_CHECKPOINT_ERROR):
        return WorkerCheckpointError(f"CheckpointError: {last[len(_QUOTED_CHECKPOINT_ERROR) :]}")
    for qualified in _QUOTED_ONE_LINE_ERRORS:
        if last.startswith(qualified + ": "):
            return Refused(f"{qualified.rpartition('.')[2]}: {last[len(qualified) + 2 :]}")
    return None


def refused(error: BaseException) -> Optional[CliRunError]:
    """
    The one line of a refusal raised in Tango's main process (a ``ConfigurationError`` of a
    launch, a rendezvous or a step's own checks; a :class:`CheckpointError`), ``None`` for any
    other error and for one Tango already prints as one line.
    """
    if isinstance(error, CliRunError) or not isinstance(error, (ConfigurationError, CheckpointError)):
        return None
    text = str(error).strip().splitlines()
    return Refused(f"{type(error).__name__}: {text[0] if text else ''}")
