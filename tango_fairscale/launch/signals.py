"""Workers: SIGINT/SIGTERM stop them, and they die with their main process."""

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

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


@contextmanager
def stop_workers_on_signals(grace: float = 5.0) -> Iterator[None]:
    """
    While the workers run: SIGINT or SIGTERM to this (``tango``) process stops them, within
    ``grace`` seconds, and then ends the step with ``KeyboardInterrupt`` (SIGINT) or exit status
    128 + 15 (SIGTERM). Without this, Python's default SIGTERM would kill this process alone, and
    SIGINT would leave it waiting for workers that go on training. No checkpoint is written: the
    last complete one is where a rerun resumes. A second signal acts as the first would have
    without this. Only the main thread can set handlers; elsewhere nothing changes.
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
        logger.error(
            "%s: stopped %d worker(s). No checkpoint was written for this interruption; a rerun "
            "resumes from the last complete checkpoint.",
            name,
            count,
        )
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

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
