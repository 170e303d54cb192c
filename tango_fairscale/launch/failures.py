"""Several hosts: the errors that name another host, and how a failure is told in one line."""

from tango.common.exceptions import CliRunError


class HostLostError(RuntimeError, CliRunError):
    """
    Training stopped because another host of the launch stopped answering. A ``CliRunError``:
    ``tango run`` prints its message alone, one line.
    """


class HostFailedError(RuntimeError, CliRunError):
    """Training stopped because another host of the launch failed first (its error is quoted, one line)."""


def _first_line(error: BaseException) -> str:
    """
    One line saying what went wrong: for a worker's failure (torch's spawn quotes the worker's
    traceback) the exception line at its end, e.g. ``RuntimeError: nan loss encountered``.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        return lines[-1][:300]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
