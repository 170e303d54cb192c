"""Keeping a CPU worker's heap from growing with FSDP's per-step whole-unit buffers."""

import ctypes
import os
import sys
from contextlib import contextmanager
from typing import Dict, Iterator, Mapping, Optional

# glibc's mallopt parameter for the mmap threshold (malloc.h).
_M_MMAP_THRESHOLD = -3
#: The default threshold: FairScale's flat units (a block's parameters or gradients in one tensor).
MMAP_THRESHOLD_BYTES = 16 << 20
#: The threshold for long-lived allocations (:func:`long_lived_allocations`).
LONG_LIVED_MMAP_THRESHOLD_BYTES = 2 << 20


def limit_cpu_heap_growth(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """
    Serve allocations of ``threshold`` bytes and more with their own memory mappings, returned to
    the system when freed. FSDP on CPU allocates and frees whole-unit buffers (gathered
    parameters, their gradients) every step; glibc's default raises its mmap threshold after the
    first such free (up to 32 MiB), so later ones come from the heap, where they fragment and stay
    resident. Each backend says which threshold its buffers need
    (:attr:`~tango_fairscale.backends.base.Backend.cpu_mmap_threshold`):

    - FairScale's flat units, 16 MiB: measured on a 124 M-parameter GPT-2 with 2 workers (model
      built eagerly), a worker's peak RSS went from 2.81 to 2.38 GiB, at 4.29 instead of 3.52 s
      per step: fresh mappings are paged in anew. A 1 MiB threshold saved more in an earlier
      measurement but made every activation a fresh mapping and a step 25 % slower.
    - FSDP2's per-parameter tensors (2.25 to 9 MiB each for GPT-2 of width 768, gathered and
      their gradients): see :class:`~tango_fairscale.backends.torch_fsdp2.backend.TorchBackend`.

    Below it, what a step allocates and frees comes from the heap and is reused from step to step
    without being paged in again; what outlives a step is allocated under
    :func:`long_lived_allocations`, so that it does not pin the heap.

    It is what ``MALLOC_MMAP_THRESHOLD_=<bytes>`` does, so a value set there is left alone (and
    :func:`long_lived_allocations` changes nothing). Linux/glibc only; returns whether the setting
    was applied.
    """
    global _applied_threshold
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    # Inside long_lived_allocations the threshold is recorded now and applied when its block ends.
    if _long_lived_depth == 0 and not _set_mmap_threshold(threshold):
        return False
    _applied_threshold = threshold
    return True


#: The threshold :func:`limit_cpu_heap_growth` applied in this process, if it did.
_applied_threshold: Optional[int] = None


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
    way, which only moves it out of the heap. Nothing changes where :func:`limit_cpu_heap_growth`
    has not applied a threshold above 2 MiB (a user's ``MALLOC_MMAP_THRESHOLD_`` included).
    """
    global _long_lived_depth
    threshold = _applied_threshold
    if threshold is None or threshold <= LONG_LIVED_MMAP_THRESHOLD_BYTES:
        yield
        return
    if _long_lived_depth == 0:
        _set_mmap_threshold(LONG_LIVED_MMAP_THRESHOLD_BYTES)
    _long_lived_depth += 1
    try:
        yield
    finally:
        _long_lived_depth -= 1
        if _long_lived_depth == 0 and _applied_threshold is not None:
            _set_mmap_threshold(_applied_threshold)


#: How many :func:`long_lived_allocations` blocks are open (a nested one changes nothing).
_long_lived_depth = 0


#: glibc's tunable (2.35 and later) that has malloc advise transparent huge pages
#: (``madvise(MADV_HUGEPAGE)``) for the memory it maps; ``1`` turns it on.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"


def cpu_worker_environment(env: Mapping[str, str]) -> Dict[str, str]:
    """
    What Tango's main process adds to the environment of the CPU workers it spawns for a step on
    the ``"fairscale"`` engine (either backend): glibc's malloc advises transparent huge pages
    for its mappings (``GLIBC_TUNABLES``; glibc reads it when a process starts, so only a spawned
    worker can have it).

    Why: an FSDP worker allocates and writes whole-unit buffers every step (gathered parameters,
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
    (elsewhere nothing is added); a glibc older than 2.35, or another C library, ignores it.
    """
    if not sys.platform.startswith("linux") or _tunable(env, HUGE_PAGES_TUNABLE) is not None:
        return {}
    tunables = env.get("GLIBC_TUNABLES", "")
    return {"GLIBC_TUNABLES": ":".join(item for item in (tunables, f"{HUGE_PAGES_TUNABLE}=1") if item)}


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
