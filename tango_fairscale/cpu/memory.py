"""Keeping a CPU worker's heap from growing with FSDP's per-step whole-unit buffers."""

import ctypes
import os
import sys

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
