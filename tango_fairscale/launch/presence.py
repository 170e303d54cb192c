"""
Several hosts: each host's ``tango run`` process present, from its start to its exit, in a store
that host 0's serves for the life of the run (the *launch store*), so that a host whose run ends
before the training step (an earlier step failed there) or disappears is named by the hosts that
wait for it at the training step's rendezvous, within seconds instead of the rendezvous timeout.

- Host 0 serves the launch store: under srun at ``MASTER_ADDR:MASTER_PORT``; under torchrun on a
  port of its own, published through the agent's store with a generation number (the agent
  already listens on ``MASTER_PORT``, and outlives a restarted ``tango``). The other hosts join
  it and claim their node rank (``join/N``): a restarted host skips the attempt it joined.
- Each host's process adds 1 to ``beat/N`` every second, from a thread; at its exit it sets
  ``exit/N`` to how its run ended: ``failed: step "data" failed there: ValueError: ...`` (the
  first error Tango logged) or ``ended``. Host 0's process waits a moment at its exit, until the
  hosts that still beat have read its ``exit/0`` (they acknowledge it, ``ack/0/N``): its store
  goes with it.
- Each training step's rendezvous (:func:`~.rendezvous.host_rendezvous`) finds the step's own
  store through this one, and while it waits for the other hosts it asks :meth:`LaunchPresence.check`,
  which raises naming a host that ended its run, stopped beating for :func:`lost_after` seconds,
  or (host 0) whose store stopped answering.

It starts when ``tango run`` imports the package (:func:`start_in_tango_run`), so that a host that
fails in its first step is seen, or else at the first training step's rendezvous.
"""

import atexit
import logging
import multiprocessing
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist
from tango.common.exceptions import ConfigurationError

from .failures import HostFailedError, HostLostError, _first_line
from .launchers import (
    DEFAULT_HOST_TIMEOUT,
    DEFAULT_RENDEZVOUS_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HOST_TIMEOUT_VARIABLE,
    RENDEZVOUS_TIMEOUT_VARIABLE,
    WORLD_VARIABLE,
    Launch,
    detect_launch,
)
from .network import local_address_towards
from .store import _get, _reachable, _store
from .world import seconds_from_environment

logger = logging.getLogger(__name__)

#: Where host 0 publishes its launch store in torchrun's agent store.
LAUNCH_PREFIX = "tango_fairscale/launch"

#: A host that is gone: the exit it reported, or why it counts as lost.
Gone = Tuple[str, str]  # ("exited", state) or ("lost", why)


def lost_after(host_timeout: float) -> float:
    """
    Seconds without a heartbeat after which a host counts as lost before training: longer than
    during training (``host_timeout``), since a host's steps before it may hold the interpreter
    for seconds (one long call into C), and a host that fails says so at once anyway.
    """
    return max(3 * host_timeout, 30.0)


def _serve(launch: Launch, address: str, timeout: float) -> dist.TCPStore:
    # Under torchrun, the agent's own store listens on MASTER_PORT: take a free port and publish it.
    port = 0 if launch.agent_store else launch.master_port
    try:
        return _store(address, port, timeout, server=True)
    except (RuntimeError, OSError) as error:
        raise ConfigurationError(
            f"Host 0 cannot serve the rendezvous store on port {port} ({error}). Set MASTER_PORT to a free "
            "port, the same on every host."
        ) from None


def _claim(store: dist.Store, node_rank: int) -> bool:
    """Register as ``node_rank`` in this attempt's store; ``False`` when it was claimed already."""
    return int(store.add(f"join/{node_rank}", 1)) == 1


def _join(launch: Launch, prefix: str, timeout: float) -> dist.TCPStore:
    """A non-zero host: connect to the store host 0 serves for the current attempt; claim the node rank."""
    deadline = time.monotonic() + timeout
    if not launch.agent_store:
        while time.monotonic() < deadline:
            if _reachable(launch.master_addr, launch.master_port):
                store = _store(launch.master_addr, launch.master_port, timeout)
                if not _claim(store, launch.node_rank):
                    raise ConfigurationError(
                        f"Two tango processes claim node rank {launch.node_rank} (SLURM_NODEID): run one "
                        "per host (srun --ntasks-per-node=1)."
                    )
                return store
            time.sleep(0.5)
        raise TimeoutError(
            f"Host 0's rendezvous store at {launch.master_addr}:{launch.master_port} did not answer within "
            f"{timeout:.0f} s ({RENDEZVOUS_TIMEOUT_VARIABLE}). Is tango running on host 0, is the port open?"
        )
    agent = _store(launch.master_addr, launch.master_port, timeout)
    skipped = 0
    while time.monotonic() < deadline:
        generation_text, address, port_text = _get(agent, f"{prefix}/endpoint", deadline).split()
        generation, port = int(generation_text), int(port_text)
        if generation > skipped and _reachable(address, port):
            store = _store(address, port, timeout)
            if _claim(store, launch.node_rank):
                return store
            # This node rank joined that attempt already: we are its restart (torchrun restarted
            # this host's tango), and host 0 will publish a new attempt once its own restarts.
            skipped = generation
        # Not published yet, or the published store belongs to an attempt that has ended.
        time.sleep(0.5)
    raise TimeoutError(
        f"No rendezvous store of host 0 answered within {timeout:.0f} s ({RENDEZVOUS_TIMEOUT_VARIABLE})."
    )


def run_outcome() -> str:
    """
    How this process's ``tango run`` ended, for the other hosts: ``failed: step "NAME" failed
    there: Type: message`` for the first error Tango logged (a step's), else ``ended``.
    """
    try:
        from tango.common import logging as tango_logging
        from tango.common.exceptions import CliRunError
        from tango.step import Step
    except ImportError:  # pragma: no cover - Tango is a dependency
        return "ended"
    # Tango keeps every exception it logged (a failed step's included) in this list, so that it
    # logs each once; read, never changed.
    for error in list(getattr(tango_logging, "_EXCEPTIONS_LOGGED", [])):
        if isinstance(error, CliRunError) and not str(error).strip():
            continue  # Tango's own "the run finished with errors"
        step = None
        traceback = error.__traceback__
        while traceback is not None:  # the innermost step whose run raised it
            owner = traceback.tb_frame.f_locals.get("self")
            if isinstance(owner, Step):
                step = owner.name
            traceback = traceback.tb_next
        where = f'step "{step}" failed there' if step else "it failed there"
        return f"failed: {where}: {_first_line(error)}"
    return "ended"


class LaunchPresence:
    """This host's ``tango`` process in the launch store, and what it knows of the other hosts'."""

    def __init__(self, launch: Launch, *, timeout: float, host_timeout: float) -> None:
        self.launch = launch
        self.timeout = timeout
        self.host_timeout = host_timeout
        self.address = local_address_towards(launch.master_addr, launch.master_port)
        self.endpoint: Optional[Tuple[str, int]] = None
        self._error: Optional[BaseException] = None
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._gone: Dict[int, Gone] = {}
        self._names: Dict[int, str] = {}
        self._store: Optional[dist.TCPStore] = None  # the thread's; the server itself on host 0
        self._steps = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tango-fairscale-presence", daemon=True)

    # --- The rendezvous's side ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def next_step(self) -> int:
        """The number of this process's next training step across hosts: its keys in the launch store."""
        with self._lock:
            self._steps += 1
            return self._steps

    def client(self, deadline: float, step: str) -> dist.TCPStore:
        """
        A connection of the calling thread to the launch store, once this host has joined it;
        raises as :meth:`check` does while it waits, and the error of joining.
        """
        while not self._connected.wait(0.2):
            self.check(step)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Host 0's rendezvous store did not answer within {self.timeout:.0f} s "
                    f"({RENDEZVOUS_TIMEOUT_VARIABLE}). Is tango running on host 0, is the port open?"
                )
        if self._error is not None:
            raise self._error
        assert self.endpoint is not None
        return _store(self.endpoint[0], self.endpoint[1], self._answer_within)

    @property
    def _answer_within(self) -> float:
        # A request to host 0's store that takes longer is an error (:meth:`wait_for`, the thread):
        # the store answers from a thread of its own, however busy host 0's tango is.
        return lost_after(self.host_timeout)

    def describe(self, node: int) -> str:
        name = self._names.get(node)
        return f"host {node} ({name}; node rank {node})" if name else f"host {node} (node rank {node})"

    def check(self, step: str) -> None:
        """Raise :class:`HostFailedError` or :class:`HostLostError` when another host is gone."""
        with self._lock:
            gone = dict(self._gone)
        if not gone:
            return
        node, (kind, why) = min(gone.items())
        me = self.launch.node_rank
        rerun = "then run the same command on every host again."
        if kind == "exited" and why.startswith("failed"):
            raise HostFailedError(
                f"Step {step} cannot start on host {me}: {self.describe(node)} ended its tango run before "
                f"reaching it, {why[len('failed: ') :]}. Fix that host's error, {rerun}"
            )
        if kind == "exited":
            raise HostFailedError(
                f"Step {step} cannot start on host {me}: {self.describe(node)} ended its tango run without "
                "running it (without an error: was the step's result already in that host's workspace?). "
                f"Give every host the same config and workspace state, {rerun}"
            )
        raise HostLostError(
            f"Step {step} cannot start on host {me}: it lost {self.describe(node)}: {why}. Check that "
            f"host's tango process and log, {rerun}"
        )

    def wait_for(
        self, store: dist.Store, key: str, deadline: float, step: str, what: Callable[[], str]
    ) -> str:
        """``store``'s value of ``key``, polled until ``deadline``, checking the other hosts meanwhile."""
        while True:
            try:
                if store.check([key]):
                    return store.get(key).decode()
            except Exception as error:  # noqa: BLE001 - host 0, and its store, may be gone
                # The thread says why in a moment (host 0's exit, or its loss).
                gone_by = time.monotonic() + 3 * HEARTBEAT_INTERVAL
                while time.monotonic() < gone_by:
                    self.check(step)
                    time.sleep(0.2)
                raise HostLostError(
                    f"Step {step} cannot start on host {self.launch.node_rank}: {self.describe(0)}'s "
                    f"rendezvous store stopped answering ({_first_line(error)}). Check that host's tango "
                    "process and log, then run the same command on every host again."
                ) from None
            self.check(step)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what()} within {self.timeout:.0f} s ({RENDEZVOUS_TIMEOUT_VARIABLE}).")
            time.sleep(0.2)

    # --- The thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            store = self._connect()
        except BaseException as error:  # noqa: BLE001 - told by the rendezvous, in its thread
            self._error = error
            self._connected.set()
            return
        self._store = store
        self._connected.set()
        try:
            if self.launch.node_rank != 0:
                # Requests that host 0 does not answer fail within a bound (not the rendezvous timeout).
                assert self.endpoint is not None
                store = _store(self.endpoint[0], self.endpoint[1], self._answer_within)
                self._store = store
            self._watch(store)
        except Exception as error:  # noqa: BLE001 - host 0's store, in its process, is gone
            if not self._stop.is_set() and self.launch.node_rank != 0:
                self._lose(0, f"its tango process stopped answering ({_first_line(error)})")

    def _connect(self) -> dist.TCPStore:
        launch, me = self.launch, self.launch.node_rank
        if me == 0:
            store = _serve(launch, self.address, self.timeout)
            _claim(store, 0)
            if launch.agent_store:
                agent = _store(launch.master_addr, launch.master_port, self.timeout)
                generation = int(agent.add(f"{LAUNCH_PREFIX}/generation", 1))
                agent.set(f"{LAUNCH_PREFIX}/endpoint", f"{generation} {self.address} {store.port}")
            self.endpoint = (self.address, int(store.port))
        else:
            store = _join(launch, LAUNCH_PREFIX, self.timeout)
            self.endpoint = (store.host, int(store.port))
        store.set(f"who/{me}", f"{socket.gethostname()}, {self.address}")
        return store

    def _lose(self, node: int, why: str, kind: str = "lost") -> None:
        with self._lock:
            if node in self._gone:
                return
            self._gone[node] = (kind, why)
        if kind == "lost":
            logger.warning("Lost %s: %s.", self.describe(node), why)

    def _watch(self, store: dist.TCPStore) -> None:
        me = self.launch.node_rank
        others = [node for node in range(self.launch.num_nodes) if node != me]
        seen = {node: -1 for node in others}
        changed = {node: time.monotonic() for node in others}
        limit = lost_after(self.host_timeout)
        while True:
            store.add(f"beat/{me}", 1)
            for node in others:
                with self._lock:
                    if node in self._gone:
                        continue
                if node not in self._names and store.check([f"who/{node}"]):
                    self._names[node] = store.get(f"who/{node}").decode()
                if store.check([f"exit/{node}"]):
                    self._lose(node, store.get(f"exit/{node}").decode(), kind="exited")
                    store.set(f"ack/{node}/{me}", "1")
                    continue
                beats, now = int(store.add(f"beat/{node}", 0)), time.monotonic()
                if beats != seen[node]:
                    seen[node], changed[node] = beats, now
                elif beats > 0 and now - changed[node] > limit:
                    # Only a host that has joined: one still starting is the rendezvous timeout's.
                    self._lose(node, f"its tango process sent no heartbeat for {now - changed[node]:.0f} s")
            if self._stop.wait(HEARTBEAT_INTERVAL):
                return

    # --- The exit -------------------------------------------------------------------------------

    def close(self, outcome: Optional[str] = None) -> None:
        """
        At this process's exit: tell the other hosts how its run ended (``exit/N``); on host 0,
        wait until the hosts that still beat have read it, at most a few seconds.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=3 * HEARTBEAT_INTERVAL)
        store = self._store
        if store is None or self._thread.is_alive():
            return
        me = self.launch.node_rank
        try:
            store.set(f"exit/{me}", outcome if outcome is not None else run_outcome())
            if me == 0:
                self._linger(store)
        except Exception:  # noqa: BLE001 - host 0, and its store, may be gone
            pass

    def _linger(self, store: dist.TCPStore) -> None:
        """Host 0: until every other host that joined has exited, read ``exit/0`` or stopped beating."""

        def unread(nodes: List[int], seconds: float) -> List[int]:
            deadline = time.monotonic() + seconds
            while nodes and time.monotonic() < deadline:
                nodes = [
                    n for n in nodes if not store.check([f"exit/{n}"]) and not store.check([f"ack/0/{n}"])
                ]
                time.sleep(0.1)
            return nodes

        others = [node for node in range(1, self.launch.num_nodes) if int(store.add(f"join/{node}", 0)) > 0]
        beats = {node: int(store.add(f"beat/{node}", 0)) for node in others}
        others = unread(others, 3 * HEARTBEAT_INTERVAL)
        # Hosts that still beat get until host_timeout to read it (one that answers a heartbeat's
        # interval late); one that stopped beating is not waited for.
        beating = [node for node in others if int(store.add(f"beat/{node}", 0)) != beats[node]]
        unread(beating, self.host_timeout)


_presences: Dict[Tuple[str, int, int], LaunchPresence] = {}
_presences_lock = threading.Lock()


def launch_presence(launch: Launch, timeout: Optional[float] = None) -> LaunchPresence:
    """This process's :class:`LaunchPresence` in ``launch``, started now if it was not yet."""
    key = (launch.master_addr, launch.master_port, launch.node_rank)
    with _presences_lock:
        presence = _presences.get(key)
        if presence is None:
            env = os.environ
            presence = LaunchPresence(
                launch,
                timeout=timeout
                if timeout is not None
                else seconds_from_environment(env, RENDEZVOUS_TIMEOUT_VARIABLE, DEFAULT_RENDEZVOUS_TIMEOUT),
                host_timeout=seconds_from_environment(env, HOST_TIMEOUT_VARIABLE, DEFAULT_HOST_TIMEOUT),
            )
            presence.start()
            atexit.register(presence.close)
            _presences[key] = presence
        return presence


def close_presences(outcome: str = "ended") -> None:
    """Close every presence of this process now (tests that run hosts as threads)."""
    with _presences_lock:
        presences = list(_presences.values())
        _presences.clear()
    for presence in presences:
        atexit.unregister(presence.close)
    threads = [threading.Thread(target=presence.close, args=(outcome,)) for presence in presences]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def in_tango_run() -> bool:
    """
    Whether this is the main process of a ``tango run``: not a worker, nor a step that Tango's
    multicore executor runs in a process of its own.
    """
    if multiprocessing.parent_process() is not None or os.environ.get(WORLD_VARIABLE):
        return False
    try:
        import click
    except ImportError:  # pragma: no cover - Tango's CLI is built on click
        return False
    context = click.get_current_context(silent=True)
    if context is None or context.info_name != "run":
        return False
    return not getattr(context.obj, "called_by_executor", False)


def start_in_tango_run(env: Any = None) -> Optional[LaunchPresence]:
    """
    When ``tango run`` imports the package as one host of a launch across hosts: start this
    host's :class:`LaunchPresence` now, before its first step. Anything wrong with the launch's
    environment is left to the training step, which says it in one line.
    """
    if not in_tango_run():
        return None
    try:
        launch = detect_launch(os.environ if env is None else env)
        return launch_presence(launch) if launch is not None else None
    except (ConfigurationError, OSError, RuntimeError, ValueError) as error:
        logger.debug("No launch presence at import: %s", error)
        return None
