"""
A worker's orderly exit: every process group destroyed, and gloo's threads joined or idle, while
the interpreter is still alive.

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

``dist.destroy_process_group()`` alone does not prevent it. Gloo's ``shutdown`` and ``abort``
leave the threads running; only the process group's destructor joins them, and it runs when the
last reference goes. Under the torch backend (FSDP2), DTensor's sharding-propagation and
redistribution caches keep the ``DeviceMesh`` objects alive (the caches pytorch/pytorch#172504
clears between tests), and each mesh holds its groups in ``_pg_registry``. Under the fairscale
backend, FairScale caches the groups its FSDP makes for the life of the process.
:func:`close_process_groups` drops every reference to a group that Python can see
(:func:`release_process_groups`) and collects the model's reference cycles: the destructors run
and join the threads (they release the GIL, so a thread finishing a work object can take it).
Groups that only C++ still references (FairScale's: each FSDP unit stays alive through the
autograd hooks it registered on its parameters) cannot be released; then the worker waits
:data:`GRACE_SECONDS`, the GIL released, for their threads to drop their last work objects.
"""

import gc
import logging
import os
import time
from typing import Any, Callable, List, Optional, Tuple

import torch.distributed as dist

logger = logging.getLogger(__name__)

#: The name gloo gives the threads that run a process group's collectives.
GLOO_THREAD_NAME = "pt_gloo_runloop"
#: Seconds a finished worker whose gloo threads could not be joined waits, the GIL released, for
#: them to drop their last work objects before the interpreter finalizes.
GRACE_SECONDS = 0.25


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


def release_process_groups() -> int:
    """
    Drop every reference to a process group that the garbage collector can see: in instance
    attributes, dicts and lists (and the dicts and lists directly inside those, which the collector
    may not track). Returns how many were dropped. Call it only after
    ``dist.destroy_process_group()``, at the end of a worker: the objects that held them (FSDP units
    and their buckets, device meshes, FairScale's group cache) cannot communicate afterwards.

    Why every holder and not a list of them: under the torch backend, DTensor's caches keep the
    device meshes alive, which hold their groups in ``_pg_registry``; under the fairscale backend,
    each FSDP unit is kept alive by the autograd hooks it registered on its parameters (a cycle
    through C++ that the collector cannot break), and FairScale keeps the groups it made in a
    cache of its own for the life of the process.
    """
    group_type = dist.ProcessGroup
    dropped = 0

    def scrub(container: Any, depth: int) -> None:
        # Plain dicts and lists only, through their own methods: subclasses may compute their
        # items (transformers' lazy auto-mappings import modules), or guard them.
        nonlocal dropped
        items: List[Tuple[Any, Any]]
        put: Callable[[Any, Any, Any], None]
        if type(container) is dict:
            items, put = list(dict.items(container)), dict.__setitem__
        elif type(container) is list:
            items, put = list(enumerate(list.copy(container))), list.__setitem__
        else:
            return
        for key, value in items:
            if issubclass(type(value), group_type):
                put(container, key, None)
                dropped += 1
            elif depth:
                scrub(value, depth - 1)

    for obj in gc.get_objects():
        kind = type(obj)
        if kind is dict or kind is list:
            scrub(obj, 1)
            continue
        if issubclass(kind, type):  # classes: their attributes are not instances' references
            continue
        try:
            # An instance's attributes (Python 3.11+ keeps them inline, with no dict the collector lists).
            attributes = object.__getattribute__(obj, "__dict__")
        except Exception:  # noqa: BLE001 - no __dict__ (slots, C types), or one that refuses
            continue
        scrub(attributes, 1)
    return dropped


def close_process_groups() -> None:
    """
    At the end of a worker that finished: destroy its process groups and make sure gloo's threads
    are joined before the interpreter exits. Local (not collective): each worker closes its own
    end. Not for a worker that failed: there a peer may still be inside a collective with it,
    and joining the threads would wait for that collective to time out.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()
    try:
        release_process_groups()
    except Exception as error:  # noqa: BLE001 - the run is done: leave the groups, never fail it here
        logger.warning("Could not release the process groups at exit (%s: %s)", type(error).__name__, error)
    # The engine, model and optimizer form reference cycles (hooks, FSDP states) that hold
    # process groups too; collecting them now runs the groups' destructors, which join the threads.
    gc.collect()
    left = gloo_threads()
    if left:
        # Groups referenced from C++ only (FairScale's, through the autograd hooks of its units)
        # cannot be released from here, and their threads outlive this function. What a thread
        # does after it finished the last collective is drop that collective's work object, which
        # takes the GIL once: give it the time to, with the GIL released, before the interpreter
        # finalizes. Measured: scripts/repeat_run.py, docs/architecture.md.
        time.sleep(GRACE_SECONDS)
        logger.debug("%d gloo thread(s) left after the process group was destroyed", left)
