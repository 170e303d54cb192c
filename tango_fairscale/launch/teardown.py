"""
A finished worker's exit: its process groups destroyed, its logs, standard streams and exit
handlers flushed and run while the interpreter is fully alive, then the process ended with
``os._exit(0)``, without the interpreter's finalization.

Why it matters. Each gloo process group runs collectives on two C++ threads of its own
(``pt_gloo_runloop``). When a thread finishes a collective it drops its reference to the
collective's work object, and if that was the last one, destroys it there; destroying its
tensors takes the GIL. A thread that asks for the GIL while the interpreter finalizes is ended
by Python with ``pthread_exit``, whose unwinding through torch's ``noexcept`` C++ frames calls
``std::terminate``: "terminate called without an active exception", SIGABRT, and a failed run
whose checkpoints and ``weights.pt`` were already written. It happens when the worker's last
collective returned a moment before the worker exited, which is most runs' ending (a core dump
of one: ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit`` on a
``ProcessGroupGloo::runLoop`` thread while the main thread was in ``Py_FinalizeEx``).

Why not join the threads instead. ``dist.destroy_process_group()`` does not stop them: only a
group's destructor joins them, when its last reference goes, and torch's DTensor caches (FSDP2)
and the autograd hooks of FairScale's units (held from C++) keep groups alive that no code of
ours made or can reach. Without finalization no thread can ask for a GIL that is being torn
down: ``_exit`` ends every thread at once.

What a normal exit does that still happens, first: objects that are garbage are finalized
(``gc.collect()``: their ``__del__`` and weak reference callbacks run); threading's exit
callbacks run (``concurrent.futures``' executors told to stop) and the threads that are not
daemons are joined (Python's own rule); the ``atexit`` handlers run (``logging.shutdown``: every
handler flushed and closed, Tango's socket to the main process's log server among them;
``multiprocessing``'s clean-up of its children; a service's client, such as W&B's); and
``sys.stdout`` and ``sys.stderr`` are flushed. What no longer happens: objects still referenced
(from a module's globals, say) are not finalized, so a file that a user's code keeps open without
flushing loses its buffer. What the package writes is durable before the worker gets here:
checkpoint files and ``weights.pt`` through
:func:`~tango_fairscale.checkpointing.files.atomic_file` (fsynced, renamed, directory fsynced),
the metrics log and the loggers' journals flushed per line, the loggers closed in
``post_train_loop``.

How the main process learns that the worker succeeded: ``torch.multiprocessing.spawn`` counts a
worker whose exit status is 0 as finished; only a worker whose function raised writes the error
file its ``join`` reads (and exits 1). Only a worker that finished ends here: one that raised may
have a peer inside a collective with it, and its error must reach the main process at once.
"""

import atexit
import gc
import logging
import os
import sys
import threading
from typing import NoReturn, Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)

#: The name gloo gives the threads that run a process group's collectives.
GLOO_THREAD_NAME = "pt_gloo_runloop"


def gloo_threads() -> Optional[int]:
    """How many of gloo's collective threads this process has; ``None`` where ``/proc`` cannot tell."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().strip() == GLOO_THREAD_NAME
        except OSError:  # the thread ended while we looked
            continue
    return count


def close_process_groups() -> None:
    """
    Destroy this process's process groups (the default one and every group made from it) and
    collect the garbage that held them. Local (not collective): each worker closes its own end.
    It does not make the exit safe by itself (see the module): a finished worker of a step ends
    with :func:`end_finished_worker`, which calls it.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # The engine, model and optimizer form reference cycles (hooks, FSDP states): collected now,
    # while the interpreter lives, their finalizers run as they would have at exit.
    gc.collect()


def end_finished_worker() -> NoReturn:
    """
    End a spawned worker that finished: :func:`close_process_groups`, what a normal exit runs
    (the threads that are not daemons joined, the ``atexit`` handlers, the standard streams
    flushed), then ``os._exit(0)`` (see the module for why, and what is not done). Only for a
    process that ``torch.multiprocessing.spawn`` started to run a step's worker function, after
    that function returned: never in a process that has more to do.
    """
    try:
        close_process_groups()
    except Exception as error:  # noqa: BLE001 - the run is done: exit 0 all the same
        logger.warning("Could not close the process groups at exit (%s: %s)", type(error).__name__, error)
    # What the interpreter calls at exit, in its order, here while it is alive (gloo's threads
    # may still run): threading's exit callbacks (concurrent.futures' executors told to stop) and
    # the threads that are not daemons joined, then the atexit handlers.
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is not None and threading.current_thread() is threading.main_thread():
        shutdown_threads()
    else:
        current = threading.current_thread()
        for thread in threading.enumerate():
            if thread is not current and not thread.daemon and thread is not threading.main_thread():
                thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()  # idempotent; in case a handler unregistered it from atexit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # none, closed, or a closed pipe
            pass
    os._exit(0)
