"""
Several hosts: the rendezvous of the hosts' ``tango`` processes, and the session that names a
lost or failed host.
"""

import dataclasses
import json
import logging
import os
import re
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence, Tuple

import torch.distributed as dist
from tango.common.exceptions import ConfigurationError

from .failures import HostFailedError, HostLostError, _first_line
from .launchers import (
    DEFAULT_HOST_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HOST_TIMEOUT_VARIABLE,
    SHARED_CHECKPOINTS_VARIABLE,
    Launch,
)
from .monitor import HostMonitor
from .presence import launch_presence
from .store import _store
from .world import HostInfo, HostWorld, seconds_from_environment

logger = logging.getLogger(__name__)


_TOKEN_DIRECTORY = ".tango_fairscale_hosts"


def _write_token(work_dir: Path, node_rank: int, token: str) -> None:
    directory = Path(work_dir) / _TOKEN_DIRECTORY
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"node{node_rank}").write_text(token)


def _sees(work_dir: str, node_rank: int, token: str) -> bool:
    """Whether host ``node_rank``'s work directory is readable here (its token file holds ``token``)."""
    try:
        return (Path(work_dir) / _TOKEN_DIRECTORY / f"node{node_rank}").read_text() == token
    except OSError:
        return False


def check_hosts(hosts: Sequence[HostInfo], node_rank: int) -> None:
    """Refuse hosts that run another step or ``device_count``, or that share a work directory."""
    mine = hosts[node_rank]
    # The most specific difference first: device_count and the version change the step id too.
    for other, info in enumerate(hosts):
        for field, what in (("version", "tango-fairscale"), ("torch", "torch"), ("python", "Python")):
            theirs, ours = getattr(info, field), getattr(mine, field)
            if theirs != ours:
                raise ConfigurationError(
                    f"Host {other} ({info.hostname}) runs {what} {theirs} where host {node_rank} runs "
                    f"{ours}: install the same {what} on every host."
                )
        if info.device_count != mine.device_count:
            raise ConfigurationError(
                f"device_count: host {other} ({info.hostname}) has {info.device_count} workers, host "
                f"{node_rank} has {mine.device_count}. device_count is the number of workers per host and "
                "must be the same on every host."
            )
        if info.step_id != mine.step_id:
            raise ConfigurationError(
                f"Host {other} ({info.hostname}) runs step {info.step_id} where host {node_rank} runs "
                f"{mine.step_id}: the step's config differs between the hosts (the id is a hash of every "
                "value in it). Every host must run the same config."
            )
        if info.base_files != mine.base_files:
            raise ConfigurationError(
                f"Host {other} ({info.hostname}) reads other pretrained files than host {node_rank} at the "
                f"same path (fingerprints {info.base_files or 'none'} and {mine.base_files or 'none'}): "
                "each host would train the shards of another model. Copy the same files to every host."
            )
        if other != node_rank and _sees(mine.work_dir, other, info.token):
            raise ConfigurationError(
                f"Hosts {node_rank} and {other} use the same work directory {mine.work_dir}: give each host "
                "its own Tango workspace (-w), e.g. one directory per host on a shared filesystem."
            )


class HostSession:
    """
    This host's side of a launch across hosts, for the life of one training step. Every host
    reports how its step ended (``state/N`` in the store); a host is done once it has read every
    other host's report or found it lost (``done/N``). Host 0's store, which carries all of this,
    stays up until every host is done, so that no host mistakes its closing for host 0's loss.
    """

    def __init__(
        self, launch: Launch, world: HostWorld, store: dist.TCPStore, server: Optional[dist.TCPStore]
    ) -> None:
        self.launch = launch
        self.world = world
        self.store = store
        self._server = server
        self._reported = False
        self.monitor = HostMonitor(
            world,
            host_timeout=seconds_from_environment(os.environ, HOST_TIMEOUT_VARIABLE, DEFAULT_HOST_TIMEOUT),
        )

    def report(self, state: str) -> None:
        """
        Tell the other hosts that this one ``"ended"`` or ``"failed: why"``. Failures are
        numbered in the order the hosts report them (``"failed 1: why"``): the first is the one
        the others' errors name (theirs broke because its workers stopped).
        """
        self._reported = True
        try:
            if state.startswith("failed"):
                state = f"failed {int(self.store.add('failures', 1))}{state[len('failed') :]}"
            self.store.set(f"state/{self.world.node_rank}", state)
        except Exception:  # noqa: BLE001 - host 0, and the store with it, may be gone
            pass

    def wait_for_others(self, timeout: float) -> None:
        """Wait until every other host has ended, failed or been found lost, or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.monitor.all_settled() and not self.monitor.stopped():
            time.sleep(0.2)

    def failure(self, error: BaseException) -> Optional[RuntimeError]:
        """
        After this host's workers failed: report it, wait for the other hosts to settle, and
        return the error that names the host at the origin: a lost host (:class:`HostLostError`),
        or one that reported its failure before this one (:class:`HostFailedError`). ``None``:
        this host failed first, and its workers' own error says what happened.
        """
        self.report(f"failed: {_first_line(error)}")
        self.wait_for_others(self._settle_timeout)
        me = self.world.node_rank
        rerun = (
            "Run the same command on every host again: training resumes from the newest checkpoint "
            "complete on all hosts."
        )
        lost = self.monitor.lost()
        if lost:
            described = "; ".join(f"{self.world.describe(node)}: {why}" for node, why in sorted(lost.items()))
            return HostLostError(
                f"Training stopped on host {me} because it lost {described}. This host's workers were "
                f"stopped. {rerun}"
            )
        first = _first_failure(self.monitor.states(), self._own_failure_order())
        if first is None:
            return None
        node, why = first
        return HostFailedError(
            f"Training stopped on host {me} because {self.world.describe(node)} failed first: {why}. {rerun}"
        )

    def _own_failure_order(self) -> int:
        try:
            return _failure_order(self.store.get(f"state/{self.world.node_rank}").decode())
        except Exception:  # noqa: BLE001 - host 0's store is gone
            return 0

    @property
    def _settle_timeout(self) -> float:
        # A host that neither reports nor sends heartbeats is lost after host_timeout.
        return self.monitor.host_timeout + 3 * HEARTBEAT_INTERVAL

    def close(self, succeeded: bool) -> None:
        """At the end of the step: report how it ended (if not yet), and wait as the class says."""
        if not self._reported:
            self.report("ended" if succeeded else "failed: interrupted")
        # After a success the others follow shortly, or are found lost; after a failure they
        # fail too (their collectives break), or are found lost.
        self.wait_for_others(float("inf") if succeeded else self._settle_timeout)
        me = self.world.node_rank
        if self._server is None:
            self.monitor.stop()
            try:
                self.store.set(f"done/{me}", "1")
            except Exception:  # noqa: BLE001 - host 0 is gone
                pass
            return
        waiting = [f"done/{node}" for node in range(self.world.num_nodes) if node != me]
        waiting = [key for key in waiting if int(key.split("/")[1]) not in self.monitor.lost()]
        deadline = time.monotonic() + self._settle_timeout
        while waiting and time.monotonic() < deadline and not self.store.check(waiting):
            time.sleep(0.2)
        self.monitor.stop()


def _failure_order(state: str) -> int:
    """The number of a ``"failed N: why"`` report (0 for anything else)."""
    match = re.match(r"failed (\d+)", state)
    return int(match.group(1)) if match else 0


def _first_failure(states: Mapping[int, str], own_order: int) -> Optional[Tuple[int, str]]:
    """The host that reported its failure first, before ``own_order``, with why; ``None`` if none did."""
    failures = [
        (_failure_order(state), node, state) for node, state in states.items() if _failure_order(state)
    ]
    if not failures:
        return None
    order, node, state = min(failures)
    if own_order and order > own_order:
        return None
    return node, state.split(": ", 1)[1] if ": " in state else state


@contextmanager
def host_rendezvous(
    launch: Launch,
    *,
    step_id: str,
    work_dir: Path,
    device_count: int,
    timeout: float,
    step_name: Optional[str] = None,
    base_files: str = "",
) -> Iterator[HostSession]:
    """
    Meet the other hosts' ``tango`` processes for this step (see the module docstring), and yield
    this host's :class:`HostSession`. Host 0 serves the step's store until every host is done.
    The hosts compare what changes the result (:func:`check_hosts`): the versions of the package,
    torch and Python, the step (its id covers the config, the backend and the data step's
    result), ``device_count``, and ``base_files``, the fingerprint of the pretrained files read.

    The hosts find the step's store through the launch store (:mod:`.presence`), under the
    number of the training step in this process; while they wait for each other, a host whose
    run ended (an earlier step failed there) or that was lost ends the wait with an error naming it.
    """
    step = f'"{step_name}"' if step_name else step_id
    presence = launch_presence(launch, timeout)
    deadline = time.monotonic() + timeout
    launch_store = presence.client(deadline, step)
    # The step's number, not its id: hosts whose configs differ (and so their step ids) must still
    # meet, to be told so, rather than each wait for a store the other never publishes.
    endpoint_key = f"step/{presence.next_step()}/endpoint"
    address = presence.address
    server: Optional[dist.TCPStore] = None
    if launch.node_rank == 0:
        # A store of its own for each step: no key of another step's (its process group's) is read.
        server = _store(address, 0, timeout, server=True)
        server.set("attempt", uuid.uuid4().hex)
        launch_store.set(endpoint_key, f"{address} {server.port}")
        store, store_address, store_port = server, address, int(server.port)
        logger.info("Serving the rendezvous of %d hosts at %s:%d", launch.num_nodes, address, store_port)
    else:
        published = presence.wait_for(
            launch_store, endpoint_key, deadline, step, lambda: f"Host 0 did not reach step {step}"
        )
        store_address, port_text = published.split()
        store_port = int(port_text)
        store = _store(store_address, store_port, timeout)
    attempt = presence.wait_for(store, "attempt", deadline, step, lambda: "The step's store gave no attempt")
    token = uuid.uuid4().hex
    _write_token(work_dir, launch.node_rank, token)
    mine = HostInfo(
        socket.gethostname(),
        address,
        str(Path(work_dir).resolve()),
        device_count,
        step_id,
        token,
        base_files=base_files,
    )
    store.set(f"info/{launch.node_rank}", json.dumps(dataclasses.asdict(mine)))

    def info(node: int) -> HostInfo:
        late = f"Host {node} did not reach step {step}"
        return HostInfo(**json.loads(presence.wait_for(store, f"info/{node}", deadline, step, lambda: late)))

    hosts = tuple(info(node) for node in range(launch.num_nodes))
    check_hosts(hosts, launch.node_rank)
    shared = os.environ.get(SHARED_CHECKPOINTS_VARIABLE, "1") != "0"
    world = HostWorld(
        node_rank=launch.node_rank,
        local_world_size=device_count,
        store_address=store_address,
        store_port=store_port,
        attempt=attempt,
        hosts=hosts,
        visible=tuple(
            node == launch.node_rank or (shared and _sees(info.work_dir, node, info.token))
            for node, info in enumerate(hosts)
        ),
    )
    logger.info(
        "Host %d of %d (%s): global ranks %d-%d; checkpoints here %s",
        launch.node_rank,
        launch.num_nodes,
        launch.launcher,
        world.ranks_of(launch.node_rank).start,
        world.ranks_of(launch.node_rank).stop - 1,
        "complete (the other hosts' files hard-linked in)" if all(world.visible) else "this host's parts",
    )
    session = HostSession(launch, world, store, server)
    session.monitor.start()
    succeeded = False
    try:
        yield session
        succeeded = True
    finally:
        session.close(succeeded)
