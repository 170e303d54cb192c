"""
Wall time in the all-gathers and reduce-scatters of FSDP units on CPU workers: both backends'
rings (:mod:`tango_fairscale.cpu.collectives` for FairScale's FSDP,
:mod:`tango_fairscale.backends.torch_fsdp2.collectives` for FSDP2) run inside :func:`timed`, which adds
their seconds and calls to the process-wide :data:`COLLECTIVES` and names them for
``torch.profiler`` (``tango_fairscale::all_gather``, ``tango_fairscale::reduce_scatter``).

On CPU workers every such collective runs synchronously in the training thread, so its wall time,
waiting for the other workers included, is time the step spends in it. GPU workers never take
these paths (NCCL runs FSDP's collectives asynchronously on streams of their own, overlapped with
computation, where a host-side clock measures nothing): nothing is counted there.
"""

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator

import torch

__all__ = ["COLLECTIVES", "CollectiveTime", "CollectiveTotals", "timed"]

#: The collectives that are timed, by the name :func:`timed` is given.
NAMES = ("all_gather", "reduce_scatter")


@dataclass(frozen=True)
class CollectiveTotals:
    """Seconds and calls per collective since the process started (see :meth:`CollectiveTime.totals`)."""

    seconds: Dict[str, float] = field(default_factory=lambda: dict.fromkeys(NAMES, 0.0))
    calls: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(NAMES, 0))

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def since(self, earlier: "CollectiveTotals") -> "CollectiveTotals":
        """What was added between ``earlier`` and these totals."""
        return CollectiveTotals(
            {name: self.seconds[name] - earlier.seconds[name] for name in NAMES},
            {name: self.calls[name] - earlier.calls[name] for name in NAMES},
        )


class CollectiveTime:
    """Running totals of the timed collectives in this process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(NAMES, 0.0)
        self._calls = dict.fromkeys(NAMES, 0)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] += seconds
            self._calls[name] += 1

    def totals(self) -> CollectiveTotals:
        """A snapshot: subtract two of them (:meth:`CollectiveTotals.since`) for an interval."""
        with self._lock:
            return CollectiveTotals(dict(self._seconds), dict(self._calls))


#: The process's totals, which the metrics log, the memory callback and the benchmarks read.
COLLECTIVES = CollectiveTime()


@contextmanager
def timed(name: str) -> Iterator[None]:
    """Time the block as one call of collective ``name`` (one of :data:`NAMES`)."""
    start = time.perf_counter()
    try:
        # A named range in profiler traces (fairscale::profile): with the rings, the collectives
        # are otherwise only a series of gloo sends and receives.
        with torch.profiler.record_function(f"tango_fairscale::{name}"):
            yield
    finally:
        COLLECTIVES.add(name, time.perf_counter() - start)
