"""Keeping a CPU worker's heap from growing with FSDP's per-step whole-unit buffers."""

import ctypes
import os
import sys
import threading
from contextlib import contextmanager
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

from .threads import blas_environment, choose_threads

# glibc's mallopt parameter for the mmap threshold (malloc.h).
_M_MMAP_THRESHOLD = -3
#: The default threshold: FairScale's flat units (a block's parameters or gradients in one tensor).
MMAP_THRESHOLD_BYTES = 16 << 20
#: The threshold for long-lived allocations (:func:`long_lived_allocations`).
LONG_LIVED_MMAP_THRESHOLD_BYTES = 2 << 20
#: The threshold while Tango's main process builds a model whose parameters go to ``meta`` (patch
#: P1: the step's result, pre-flight's ``init_on_meta`` check): glibc's starting value. Each
#: parameter is allocated on the CPU by its module's constructor (or as a recorded initialiser's
#: scratch) and freed at once; under the dynamic threshold the process had reached (MiBs) it was
#: freed into the heap, where the small objects built next split the holes, and VmData kept it:
#: for a 202 M-parameter Llama (769 MiB of weights) the step's result's build left 680 MiB and
#: pre-flight's check 500 MiB, which ``weights.pt``'s tensors did not reuse. A mapping of its own
#: is unmapped when freed: 107 MiB were left.
META_BUILD_MMAP_THRESHOLD_BYTES = 128 << 10


#: What the threshold is set back to when the last :func:`limit_cpu_heap_growth` block ends, where
#: none was set before the first began: glibc's default is a dynamic threshold (128 KiB at start,
#: raised to the size of each mapped chunk freed, up to this ceiling: 4 MiB times ``sizeof(long)``,
#: 32 MiB on 64-bit), and the first ``mallopt`` turns that adjustment off for the life of the
#: process, with no call to turn it on again nor to read the value it had reached. The ceiling is
#: where a process that frees tensors of MiBs has its dynamic threshold (torch's allocations are
#: such), and the fixed value closest to it; 128 KiB would give every later allocation of more a
#: fresh mapping, paged in anew each time.
RESTORED_MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)

_lock = threading.Lock()
#: The open :func:`limit_cpu_heap_growth` blocks (a token, the threshold), oldest first; the newest
#: applies.
_blocks: List[Tuple[object, int]] = []
#: How many :func:`long_lived_allocations` blocks are open (a nested one changes nothing).
_long_lived_depth = 0
#: The threshold this module last set with ``mallopt``; ``None`` while it never has (glibc's
#: dynamic threshold is in effect).
_in_effect: Optional[int] = None


@contextmanager
def limit_cpu_heap_growth(threshold: int = MMAP_THRESHOLD_BYTES) -> Iterator[bool]:
    """
    While the block is open, allocations of ``threshold`` bytes and more are served with their own
    memory mappings, returned to the system when freed; the engine opens it on CPU workers for its
    life (:class:`~tango_fairscale.FairScaleTrainingEngine`, ended by its ``close``). FSDP on CPU
    allocates and frees whole-unit buffers (gathered parameters, their gradients) every step;
    glibc's default raises its mmap threshold after the first such free (up to 32 MiB), so later
    ones come from the heap, where they fragment and stay resident. Each backend says which
    threshold its buffers need (:attr:`~tango_fairscale.backends.base.Backend.cpu_mmap_threshold`):

    - FairScale's flat units, 16 MiB: measured on a 124 M-parameter GPT-2 with 2 workers (model
      built eagerly), a worker's peak RSS went from 2.81 to 2.38 GiB, at 4.29 instead of 3.52 s
      per step: fresh mappings are paged in anew. A 1 MiB threshold saved more in an earlier
      measurement but made every activation a fresh mapping and a step 25 % slower.
    - FSDP2's per-parameter tensors (2.25 to 9 MiB each for GPT-2 of width 768, gathered and
      their gradients): see :class:`~tango_fairscale.backends.torch_fsdp2.backend.TorchBackend`.

    Below it, what a step allocates and frees comes from the heap and is reused from step to step
    without being paged in again; what outlives a step is allocated under
    :func:`long_lived_allocations`, so that it does not pin the heap.

    ``mallopt`` is process-wide, so the blocks are too (a lock keeps their record): the newest open
    block's threshold applies, and when a block ends, in any order, the threshold is set back to
    the newest one still open. When the last one ends it is restored as far as glibc allows: to
    the threshold that was set before the first began, and where that was glibc's own dynamic
    threshold (which cannot be read nor turned on again), to
    :data:`RESTORED_MMAP_THRESHOLD_BYTES`, that threshold's ceiling.

    It is what ``MALLOC_MMAP_THRESHOLD_=<bytes>`` does, so a value set there is left alone (and
    :func:`long_lived_allocations` changes nothing). Linux/glibc only; yields whether the setting
    applies.
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ or not _has_mallopt():
        yield False
        return
    token = object()
    with _lock:
        _blocks.append((token, threshold))
        _apply_locked()
    try:
        yield True
    finally:
        with _lock:
            # This block's entry, wherever it is now (an older block may have ended first).
            _blocks[:] = [block for block in _blocks if block[0] is not token]
            _apply_locked()


def _apply_locked() -> None:
    """Set the threshold the open blocks ask for, if it is not the one in effect (``_lock`` held)."""
    global _in_effect
    wanted: Optional[int]
    if _blocks:
        wanted = _blocks[-1][1]
        if _long_lived_depth and wanted > LONG_LIVED_MMAP_THRESHOLD_BYTES:
            wanted = LONG_LIVED_MMAP_THRESHOLD_BYTES
    else:
        # Nothing open: glibc's threshold if this module never set one, else its restoring value.
        wanted = None if _in_effect is None else RESTORED_MMAP_THRESHOLD_BYTES
    if wanted is not None and wanted != _in_effect and _set_mmap_threshold(wanted):
        _in_effect = wanted


def current_mmap_threshold() -> Optional[int]:
    """The threshold this module set and is in effect; ``None`` while glibc's own dynamic one is."""
    with _lock:
        return _in_effect


def _has_mallopt() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:  # not glibc
        return False


def _set_mmap_threshold(threshold: int) -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # not glibc
        return False


@contextmanager
def long_lived_allocations() -> Iterator[None]:
    """
    Inside, allocations of :data:`LONG_LIVED_MMAP_THRESHOLD_BYTES` (2 MiB) or more get their own
    memory mappings, whatever the threshold :func:`limit_cpu_heap_growth` set: for tensors that
    are allocated outside a step's pattern and outlive it (a model's shards as it is built, what a
    checkpoint loads, the torch backend's gradient shards and the buffers its units share).

    Why: glibc's main heap only shrinks from its top, and ``RLIMIT_DATA`` (VmData) counts all of
    it. A long-lived tensor placed in it before training, beneath the space a step's activations
    and gathered parameters take, pushes that space up; in its own mapping it leaves the heap to
    what a step allocates and frees, which the next step reuses. Measured:

    - while the model is built (``docs/capacity.md``), the fairscale backend went from 15 to 16
      blocks on 2 workers and from 27 to 29 on 4; loading a 124 M-parameter GPT-2 under
      ``init_on_meta`` on it, VmData rose 0.97 x the weights above the runtime, 1.38 x with 16
      MiB throughout (``docs/pretrained-memory.md``);
    - the torch backend's gradient shards, shared buffers and optimizer state, with a 16 MiB
      threshold: from 14 to 15 blocks on 2 workers.

    Not the optimizer state its first step allocates: placed in the holes a backward pass leaves,
    it costs nothing there, and as mappings it raised the training peak by 6 MiB (torch backend,
    2 workers, 16 blocks) and 17 MiB (fairscale backend, 4 workers, 28 blocks) in single trials.

    ``mallopt`` is process-wide: an allocation another thread makes meanwhile is served the same
    way, which only moves it out of the heap. Nothing changes where no :func:`limit_cpu_heap_growth`
    block with a threshold above 2 MiB is open (a user's ``MALLOC_MMAP_THRESHOLD_`` included).
    """
    global _long_lived_depth
    with _lock:
        _long_lived_depth += 1
        _apply_locked()
    try:
        yield
    finally:
        with _lock:
            _long_lived_depth -= 1
            _apply_locked()


#: glibc's tunable (2.35 and later) that has malloc advise transparent huge pages
#: (``madvise(MADV_HUGEPAGE)``) for the memory it maps; ``1`` turns it on.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"


def cpu_worker_environment(
    env: Mapping[str, str], cpu_threads_per_worker: Optional[int], workers_on_host: int
) -> Dict[str, str]:
    """
    What Tango's main process adds to the environment ``env`` of the ``workers_on_host`` CPU
    workers it spawns for a step on the ``"fairscale"`` engine (either backend, and
    ``fairscale::evaluate``'s), with the engine's ``cpu_threads_per_worker``: glibc's malloc
    advises transparent huge pages for its mappings (``GLIBC_TUNABLES``), and numpy's OpenBLAS
    starts the threads each worker computes with instead of one per core
    (:func:`~tango_fairscale.cpu.threads.blas_environment`: about 41 MiB of VmData per thread it
    does not start). Both are read only when a process starts, so only a spawned worker can have
    them.

    Why huge pages: an FSDP worker allocates and writes whole-unit buffers every step (gathered parameters,
    their gradients, activations), each in a fresh mapping of its own past the mmap threshold
    (:func:`limit_cpu_heap_growth`), paged in one 4 KiB fault at a time. With huge pages, where
    the kernel offers them for ``madvise`` (``/sys/kernel/mm/transparent_hugepage/enabled``), one
    fault maps 2 MiB: measured on the 2-core machine, allocating and writing a GPT-2 block's
    per-parameter tensors (324 MiB in 48 tensors) took 96 to 105 ms instead of 164 to 191 ms.
    The mappings keep their sizes, so what ``RLIMIT_DATA`` counts barely changes (glibc grows the
    main heap in 2 MiB steps instead of 4 KiB ones); torch's own ``THP_MEM_ALLOC_ENABLE`` would
    align every large tensor to 2 MiB and add up to 2 MiB to each mapping.

    A ``glibc.malloc.hugetlb`` already in ``GLIBC_TUNABLES`` is left as it is
    (``GLIBC_TUNABLES=glibc.malloc.hugetlb=0`` turns this off); other tunables are kept. Linux only
    (elsewhere no tunable is added); a glibc older than 2.35, or another C library, ignores it.
    """
    threads = choose_threads(cpu_threads_per_worker, env, workers_on_host).threads
    added = blas_environment(env, threads)
    if sys.platform.startswith("linux") and _tunable(env, HUGE_PAGES_TUNABLE) is None:
        tunables = env.get("GLIBC_TUNABLES", "")
        added["GLIBC_TUNABLES"] = ":".join(item for item in (tunables, f"{HUGE_PAGES_TUNABLE}=1") if item)
    return added


def malloc_advises_huge_pages(env: Mapping[str, str] = os.environ) -> bool:
    """
    Whether this process was started with glibc's tunable asking malloc to advise transparent huge
    pages (``glibc.malloc.hugetlb=1`` in ``GLIBC_TUNABLES``; ``2`` asks for hugetlbfs pages
    instead, which are not advised). What was asked for: a glibc older than 2.35, another C
    library, or a kernel whose transparent huge pages are off does not act on it.
    """
    return _tunable(env, HUGE_PAGES_TUNABLE) == "1"


def _tunable(env: Mapping[str, str], name: str) -> Optional[str]:
    """The value ``GLIBC_TUNABLES`` (``name=value:name=value``) in ``env`` gives ``name``, if any."""
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        key, _, value = item.partition("=")
        if key == name:
            return value
    return None
