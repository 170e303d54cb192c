"""
Several hosts: heartbeats between the hosts' ``tango`` processes, so that a lost host is named
within seconds.
"""

import logging
import threading
import time
from typing import Callable, Dict, Optional

from .failures import _first_line
from .launchers import HEARTBEAT_INTERVAL
from .signals import terminate_workers
from .store import _store
from .world import HostWorld

logger = logging.getLogger(__name__)


class HostMonitor:
    """
    Heartbeats between the hosts' ``tango`` processes, through the attempt's store: each adds 1 to
    its counter every second and watches the others'. A host whose counter stands still for
    ``host_timeout`` seconds (its ``tango`` was killed, crashed or cannot be reached), or host 0
    when its store stops answering (the store lives in its ``tango`` process), is lost: this host's
    workers are then stopped, so that no collective waits for it until its timeout.
    """

    def __init__(
        self, world: HostWorld, host_timeout: float, on_lost: Optional[Callable[[int], None]] = None
    ):
        self.world = world
        self.host_timeout = host_timeout
        self._on_lost = on_lost or (lambda node: terminate_workers(grace=3.0))
        self._lock = threading.Lock()
        self._lost: Dict[int, str] = {}
        self._settled: Dict[int, str] = {}
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tango-fairscale-host-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        self._stop.set()
        if wait and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def stopped(self) -> bool:
        """Whether the monitor no longer watches (stopped, or its store is gone)."""
        return self._stop.is_set() or self._finished.is_set()

    def lost(self) -> Dict[int, str]:
        with self._lock:
            return dict(self._lost)

    def states(self) -> Dict[int, str]:
        """What the other hosts reported (``"ended"``, ``"failed N: why"``), by node rank."""
        with self._lock:
            return dict(self._settled)

    def all_settled(self) -> bool:
        with self._lock:
            done = set(self._lost) | set(self._settled)
        return all(node in done for node in range(self.world.num_nodes) if node != self.world.node_rank)

    def _lose(self, node: int, why: str) -> None:
        with self._lock:
            if node in self._lost or node in self._settled:
                return
            self._lost[node] = why
        logger.error("Lost %s: %s; stopping this host's workers.", self.world.describe(node), why)
        self._on_lost(node)

    def _run(self) -> None:
        try:
            self._watch()
        finally:
            self._finished.set()

    def _watch(self) -> None:
        me, world = self.world.node_rank, self.world
        try:
            # A client of its own: TCPStore objects are not shared between threads here.
            store = _store(world.store_address, world.store_port, max(self.host_timeout, 5.0))
        except Exception as error:  # noqa: BLE001
            if not self._stop.is_set() and me != 0:
                self._lose(0, f"its rendezvous store does not answer ({_first_line(error)})")
            return
        others = [node for node in range(world.num_nodes) if node != me]
        seen = {node: -1 for node in others}
        changed = {node: time.monotonic() for node in others}
        while not self._stop.wait(HEARTBEAT_INTERVAL):
            try:
                store.add(f"beat/{me}", 1)
                for node in others:
                    with self._lock:
                        if node in self._settled or node in self._lost:
                            continue
                    if store.check([f"state/{node}"]):
                        with self._lock:
                            self._settled[node] = store.get(f"state/{node}").decode()
                        continue
                    beats = int(store.add(f"beat/{node}", 0))
                    now = time.monotonic()
                    if beats != seen[node]:
                        seen[node], changed[node] = beats, now
                    elif now - changed[node] > self.host_timeout:
                        self._lose(
                            node, f"its tango process sent no heartbeat for {now - changed[node]:.0f} s"
                        )
            except Exception as error:  # noqa: BLE001 - the store is in host 0's tango process
                if not self._stop.is_set() and me != 0:
                    self._lose(0, f"its tango process stopped answering ({_first_line(error)})")
                return
