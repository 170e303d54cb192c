"""
:class:`StoreRoute`: the step records of every worker to the workers that write them, through the
run's rendezvous store (the TCP store the process group started from: Tango's main process serves
it on one host, host 0 across hosts, :mod:`tango_fairscale.launch`). Why the store and not a
collective: :mod:`tango_fairscale.telemetry.core`.
"""

from collections import deque
from datetime import timedelta
from typing import Deque, Dict, Sequence

import torch.distributed as dist

__all__ = ["SLOTS", "StoreRoute"]

#: Records a worker keeps in the store: each send deletes the one sent this many sends before, so
#: the store holds at most this many per worker. More than the records a reader lets wait
#: (:data:`~tango_fairscale.telemetry.core.MAX_PENDING`), so that it reads each before it goes.
SLOTS = 64


class StoreRoute:
    """One worker's connection to the store: it sends its records and reads the other workers'."""

    def __init__(self, address: str, port: int, prefix: str, rank: int) -> None:
        # A client of its own, so that a slow read here never delays the process group's use of
        # the store.
        store = dist.TCPStore(
            address, port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False
        )
        self.store = dist.PrefixStore(prefix, store)
        self.rank = rank
        self._sent: Deque[str] = deque()

    def send(self, key: str, text: str) -> None:
        """Put this worker's record ``key`` in the store (and delete its oldest beyond :data:`SLOTS`)."""
        name = f"{self.rank}/{key}"
        self.store.set(name, text)
        self._sent.append(name)
        if len(self._sent) > SLOTS:
            self.store.delete_key(self._sent.popleft())

    def arrived(self, key: str, ranks: Sequence[int]) -> Dict[int, str]:
        """The records ``key`` of ``ranks`` in the store now (all of them or fewer), without waiting."""
        names = [f"{rank}/{key}" for rank in ranks]
        if not names:
            return {}
        if self.store.check(names):
            values = self.store.multi_get(names)  # all there: one round trip
            return {rank: value.decode() for rank, value in zip(ranks, values)}
        return {
            rank: self.store.get(name).decode()
            for rank, name in zip(ranks, names)
            if self.store.check([name])
        }

    def wait(self, key: str, ranks: Sequence[int], seconds: float) -> bool:
        """Wait up to ``seconds`` for the records ``key`` of ``ranks``: whether they all came."""
        try:
            self.store.wait([f"{rank}/{key}" for rank in ranks], timedelta(seconds=seconds))
        except dist.DistStoreError:  # the time is up; a lost connection raises DistNetworkError
            return False
        return True
