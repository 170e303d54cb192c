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


class WorkerDiedError(RuntimeError, CliRunError):
    """
    A worker ended without raising: killed by a signal (the out-of-memory killer's SIGKILL, a
    crash's SIGSEGV) or exited with a status of its own. A ``CliRunError``: ``tango run`` prints
    its message alone, one line naming the worker, the signal, its likely cause and how to resume.
    """


#: The likely cause of a worker's death by each signal, as the line :func:`worker_died` says it.
LIKELY_CAUSES = {
    "SIGKILL": (
        "out of memory? The kernel's OOM killer sends SIGKILL: see `dmesg` or `journalctl -k` for "
        "'Killed process {pid}'; lower the batch size, or the workers' memory (docs/capacity.md)"
    ),
    "SIGSEGV": "a crash in native code (segmentation fault): a library's bug, or one built for another torch",
    "SIGBUS": "a memory-mapped file changed or was truncated while read, or /dev/shm is full",
    "SIGABRT": "aborted by native code (a C++ check in torch, gloo or NCCL); its message is above, on stderr",
    "SIGILL": "an instruction this CPU lacks: a library built for another CPU",
    "SIGFPE": "an arithmetic fault in native code",
    "SIGTERM": "sent to that worker alone from outside the run; signal the tango process to stop a run",
    "SIGINT": "sent to that worker alone from outside the run; signal the tango process to stop a run",
    "SIGHUP": "its terminal or session closed; run tango under nohup, tmux or a scheduler",
}


def worker_died(error: BaseException, rank: int, resume: str) -> WorkerDiedError:
    """
    The one line of a worker's death as ``mp.spawn`` reports it (a ``ProcessExitedException``,
    its ``signal_name`` or ``exit_code``): the worker by its global ``rank`` and pid, the signal,
    its likely cause (:data:`LIKELY_CAUSES`) and ``resume``, how to resume.
    """
    pid = getattr(error, "error_pid", None)
    signal_name = getattr(error, "signal_name", None)
    who = f"Worker {rank}" + (f" (pid {pid})" if pid is not None else "")
    if signal_name:
        cause = LIKELY_CAUSES.get(signal_name, "a signal from outside the run, or a crash in native code")
        what = f"{who} was killed by {signal_name}: {cause.format(pid=pid)}"
    else:
        status = getattr(error, "exit_code", None)
        what = f"{who} exited with status {status} without raising an error (a library called exit)"
    return WorkerDiedError(f"{what}. {resume[:1].upper()}{resume[1:]}.")
