"""Workers: SIGINT/SIGTERM stop them, quietly, and they die with their main process."""

import ctypes
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

logger = logging.getLogger(__name__)


def terminate_workers(grace: float = 5.0) -> int:
    """
    Stop this process's child processes (the step's workers): SIGTERM, then SIGKILL for any still
    there after ``grace`` seconds. Returns how many there were.
    """
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.kill()
            child.join(5)
    return len(children)


#: The exit status of a ``tango run`` stopped by SIGINT (Ctrl-C) or SIGTERM: 128 + the signal's
#: number, as a shell reports a process that the signal ended.
EXIT_STATUS = {signal.SIGINT: 128 + signal.SIGINT, signal.SIGTERM: 128 + signal.SIGTERM}


class TrainingStopped(SystemExit):
    """
    The step was stopped by SIGINT or SIGTERM, its workers are gone, and the one line saying so
    (and how to resume) was logged. A :class:`SystemExit` with the exit status of
    :data:`EXIT_STATUS`: Tango's step records the failure and re-raises it, its executor and CLI
    (click) let it through, and Python exits with the status without printing it; the integration
    boundary keeps Tango from logging it again, with its traceback, unless the log level is debug
    (patch T6).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(EXIT_STATUS[signal.Signals(signum)])
        self.signal_name = signal.Signals(signum).name


def _resume_hint_default() -> str:
    return "rerun the same tango run command to resume from the latest checkpoint"


@contextmanager
def stop_workers_on_signals(
    grace: float = 5.0, resume_hint: Callable[[], str] = _resume_hint_default
) -> Iterator[None]:
    """
    While the workers run: SIGINT or SIGTERM to this (``tango``) process stops them, within
    ``grace`` seconds, logs one line (what stopped the run, and ``resume_hint()``: how to resume),
    and ends the step with :class:`TrainingStopped`: exit status 130 (SIGINT) or 143 (SIGTERM),
    without a traceback (``--log-level debug`` logs one). Without this, Python's default SIGTERM
    would kill this process alone, and SIGINT would leave it waiting for workers that go on
    training. No checkpoint is written: the last complete one is where a rerun resumes. A second
    signal acts as the first would have without this. Only the main thread can set handlers;
    elsewhere nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def stop(signum: int, frame: Any) -> None:
        restore()
        count = terminate_workers(grace)
        name = signal.Signals(signum).name
        stopped = TrainingStopped(signum)
        if sys.stderr is not None and sys.stderr.isatty():
            # Worker 0's progress bar, cut off mid-line: the line below starts on a line of its own.
            sys.stderr.write("\n")
        logger.error(
            "Stopped by %s%s: %d worker(s) stopped, no checkpoint written for the interruption; %s "
            "(exit status %d).",
            name,
            " (Ctrl-C)" if signum == signal.SIGINT else "",
            count,
            resume_hint(),
            stopped.code,
        )
        raise stopped

    for sig in signals:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        restore()


@contextmanager
def environment(updates: Mapping[str, str]) -> Iterator[None]:
    """Set ``updates`` in ``os.environ`` (inherited by the workers spawned meanwhile), then restore."""
    previous = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def end_quietly_on_signals() -> None:
    """
    In a worker: SIGINT is ignored and SIGTERM ends the worker at once, with status 143, after
    multiprocessing's exit-time clean-up. The main process stops the workers
    (:func:`stop_workers_on_signals`), with SIGTERM; Ctrl-C sends SIGINT to the whole process
    group, workers included, where it raised ``KeyboardInterrupt`` in the middle of training and
    failed the other worker's collective. Killed by Python's default SIGTERM, a worker never
    released what it had registered with multiprocessing's resource tracker (tqdm's
    write lock is a named semaphore), and the tracker warned of "leaked semaphore objects" after
    every stopped run. The clean-up runs multiprocessing's finalizers of exit priority 0 and up
    (those ``multiprocessing`` runs first at exit: the semaphores' unlinking among them), then
    ``os._exit``: no interpreter finalization, where a gloo thread still inside a collective
    could abort the process (see :mod:`tango_fairscale.teardown`). Only the main thread can set
    handlers; elsewhere nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def end(signum: int, frame: Any) -> None:
        # multiprocessing's own exit-time step (util._exit_function runs _run_finalizers(0) first).
        run_finalizers = getattr(multiprocessing.util, "_run_finalizers", None)
        if run_finalizers is not None:
            try:
                run_finalizers(0)
            except Exception:  # noqa: BLE001 - the worker is ending; nothing to report it to
                pass
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, end)


def die_with_parent() -> None:
    """
    In a worker: be killed (SIGKILL) when the ``tango`` process that spawned it dies, however it
    dies. torch's spawn asks for SIGINT, which a worker waiting inside a collective only sees once
    the collective returns, possibly at its timeout. Linux only; elsewhere nothing happens.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request: nobody would kill us
        os.kill(os.getpid(), signal.SIGKILL)
