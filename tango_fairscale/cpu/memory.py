"""Keeping a CPU worker's heap from growing with FSDP's per-step whole-unit buffers."""

import ctypes
import os
import sys
from typing import Dict, Mapping, Optional

# glibc's mallopt parameter for the mmap threshold (malloc.h).
_M_MMAP_THRESHOLD = -3
#: The default threshold: FairScale's flat units (a block's parameters or gradients in one tensor).
MMAP_THRESHOLD_BYTES = 16 << 20
#: While a model is built and sharded: its shards, which live as long as the run, get their own
#: mappings instead of settling in the heap between the unit-sized tensors freed around them.
BUILD_MMAP_THRESHOLD_BYTES = 2 << 20


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
      their gradients), 2 MiB: under a whole-run budget of 1,600 MiB per process on 2 workers,
      the largest GPT-2 that trained went from 14 blocks (16 MiB) to 16 (4 MiB) and 17 (2 MiB),
      the rest of the peak beside model state and runtime from 535 to 368 MiB
      (``benchmarks/capacity.py``, ``docs/capacity.md``).

    While the model is built, the engine sets :data:`BUILD_MMAP_THRESHOLD_BYTES` (both backends),
    then the backend's own for training: loading a 124 M-parameter GPT-2 under ``init_on_meta`` on
    the fairscale backend, VmData rose 0.97 x the weights above the runtime with it, 1.38 x with 16
    MiB throughout (``docs/pretrained-memory.md``).

    It is what ``MALLOC_MMAP_THRESHOLD_=<bytes>`` does, so a value set there is left alone.
    Linux/glibc only; returns whether the setting was applied.
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # not glibc
        return False


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
