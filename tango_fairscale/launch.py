"""
How the workers of a ``torch::train`` step find each other, on one host or on several.

**One host.** Tango's step starts its workers' process group at ``127.0.0.1:distributed_port``
(default 54761). Two runs on one machine with the default would collide with ``EADDRINUSE`` in
every worker. :func:`rendezvous_store` runs in the main process, before the workers are
spawned, and serves the rendezvous store itself.

**Several hosts.** Each host runs one ``tango run`` under a launcher (``torchrun
--nproc-per-node=1`` or ``srun --ntasks-per-node=1``), and each of those spawns
``device_count`` workers, so the world has ``hosts x device_count`` workers and the global rank
of a worker is ``node_rank x device_count + local_rank``. What this module decides:

- :func:`detect_launch` reads the launcher's environment (pure; tested with dicts). Without a
  launcher, or with a launch of one host, it returns ``None`` and nothing changes.
- :func:`host_rendezvous` runs in every host's ``tango`` process before its workers start. Host
  0's serves a fresh rendezvous store for this attempt, on a port of its own (torchrun's agent
  already listens on ``MASTER_PORT``) that it publishes through the agent's store under a
  generation number; under SLURM it serves at ``MASTER_ADDR:MASTER_PORT``. A fresh store per
  attempt means no key of an earlier attempt (``torchrun --max-restarts``) can be read by a new
  one. The hosts register there, check that they agree (same step, same ``device_count``, each
  its own work directory), and learn which other hosts' work directories they can read (a
  shared filesystem): the :class:`HostWorld` every worker of the host then gets.
- :class:`HostMonitor`: heartbeats between the hosts' ``tango`` processes through that store,
  so that a host that disappears is named, and the workers of the others are stopped within
  seconds even when no collective notices (a host that loses power sends no FIN).
- :func:`worker_train_config` and :func:`worker_environment`: what a spawned worker's
  ``TrainConfig`` and environment become (global rank and world size, devices indexed per
  host, ``is_local_main_process`` true for each host's first worker).
- :func:`stop_workers_on_signals`: SIGINT or SIGTERM to a ``tango`` process stops its workers.
"""

import ctypes
import dataclasses
import fcntl
import ipaddress
import json
import logging
import multiprocessing
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch.distributed as dist
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import TrainConfig

logger = logging.getLogger(__name__)

#: The address Tango's workers rendezvous at (``TrainConfig.distributed_address``).
LOCAL_ADDRESS = "127.0.0.1"
#: Makes every rank of PyTorch's ``tcp://`` rendezvous a client of an existing store.
AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"


def free_port(address: str = LOCAL_ADDRESS) -> int:
    """A port the OS reports free on ``address`` (another process may still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def _check_port_number(port: Any) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigurationError(f"distributed_port: must be a TCP port number (1-65535), got {port!r}.")


def _listen(port: int, timeout: timedelta) -> Optional[dist.TCPStore]:
    """A store server on ``LOCAL_ADDRESS:port``, or ``None`` when the port is taken."""
    try:
        return dist.TCPStore(LOCAL_ADDRESS, port, is_master=True, wait_for_workers=False, timeout=timeout)
    except (RuntimeError, OSError) as error:
        if "address already in use" in str(error).lower() or "EADDRINUSE" in str(error):
            return None
        raise


@contextmanager
def rendezvous_store(
    port: int, *, set_in_config: bool, timeout: timedelta = timedelta(minutes=5)
) -> Iterator[int]:
    """
    Serve the process group's rendezvous store from Tango's main process, for the duration of
    the step, and yield its port; the spawned workers connect to it as clients.

    Binding is the test of whether a port is free, so two runs started at the same moment cannot
    both take one. Tango's default port is kept when free and otherwise replaced by one the OS
    picks; a port the config set is kept, and refused when taken, since the user may rely on it.

    The workers reach the store as they would a launcher's agent store: PyTorch's ``tcp://``
    rendezvous makes every rank a client when ``TORCHELASTIC_USE_AGENT_STORE`` is ``True``, which
    is set for the spawned workers only (they inherit the environment at spawn).
    """
    _check_port_number(port)
    store = _listen(port, timeout)
    if store is None:
        if set_in_config:
            raise ConfigurationError(
                f"distributed_port: port {port} on {LOCAL_ADDRESS} is already in use (another training "
                "run on this machine?). Choose another port, or remove distributed_port from the step "
                "to have a free one picked."
            )
        store = _listen(0, timeout)
        assert store is not None
        logger.warning(
            "Port %d (torch::train's default distributed_port) is in use, probably by another run on "
            "this machine; the workers of this step rendezvous at port %d instead.",
            port,
            store.port,
        )
    previous = os.environ.get(AGENT_STORE_VARIABLE)
    os.environ[AGENT_STORE_VARIABLE] = str(True)
    try:
        yield int(store.port)
    finally:
        if previous is None:
            os.environ.pop(AGENT_STORE_VARIABLE, None)
        else:
            os.environ[AGENT_STORE_VARIABLE] = previous
        del store


# --- Several hosts: the launcher's environment --------------------------------------------------

#: ``0`` turns launcher detection off: every host then trains on its own, as without a launcher.
MULTIHOST_VARIABLE = "TANGO_FAIRSCALE_MULTIHOST"
#: Seconds the hosts' ``tango`` processes wait for each other before training (default 30 min:
#: the steps before the training step may take longer on one host than on another).
RENDEZVOUS_TIMEOUT_VARIABLE = "TANGO_FAIRSCALE_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_TIMEOUT = 1800.0
#: Seconds without a heartbeat after which a host counts as lost (default 10).
HOST_TIMEOUT_VARIABLE = "TANGO_FAIRSCALE_HOST_TIMEOUT"
DEFAULT_HOST_TIMEOUT = 10.0
HEARTBEAT_INTERVAL = 1.0
#: ``0``: treat the other hosts' work directories as unreadable even on a shared filesystem, so
#: that checkpoints stay per-host parts (see :mod:`tango_fairscale.multihost`).
SHARED_CHECKPOINTS_VARIABLE = "TANGO_FAIRSCALE_SHARED_CHECKPOINTS"
#: What a spawned worker learns about the hosts (JSON of :class:`HostWorld`).
WORLD_VARIABLE = "TANGO_FAIRSCALE_HOST_WORLD"
#: Under SLURM without ``MASTER_PORT``: host 0 serves at ``base + SLURM_JOB_ID % span``, below
#: Linux's ephemeral range (32768-60999), the same on every host of the job.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000


@dataclasses.dataclass(frozen=True)
class Launch:
    """This host's place in a launch of one ``tango run`` per host, read from the launcher's environment."""

    launcher: str  # "torchrun" or "slurm"
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    #: torchrun's agent serves a store at ``master_addr:master_port``: host 0 publishes its own
    #: store's address there. Otherwise host 0 serves at ``master_addr:master_port`` itself.
    agent_store: bool


def _integer(env: Mapping[str, str], *names: str) -> Optional[int]:
    """The first of ``names`` set in ``env``, as an int; a value that is not one is an error naming it."""
    for name in names:
        value = env.get(name)
        if value is None or value == "":
            continue
        try:
            return int(value)
        except ValueError:
            raise ConfigurationError(f"{name}={value!r} in the environment is not a whole number.") from None
    return None


def _required(value: Optional[Any], what: str) -> Any:
    if value is None:
        raise ConfigurationError(
            f"{what} is not set in the environment, so this host cannot find the others."
        )
    return value


def detect_launch(env: Mapping[str, str]) -> Optional[Launch]:
    """
    This host's :class:`Launch` when ``tango`` runs once per host under torchrun (``TORCHELASTIC_RUN_ID``
    is set) or srun (``SLURM_STEP_ID``/``SLURM_STEP_NUM_NODES``), else ``None``: no launcher, a
    launch of one host, or ``TANGO_FAIRSCALE_MULTIHOST=0``. A launch that starts several ``tango``
    processes per host is an error: each spawns ``device_count`` workers itself.
    """
    if env.get(MULTIHOST_VARIABLE) == "0":
        return None
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        launch = _torchrun_launch(env)
    elif env.get("SLURM_STEP_ID") is not None or env.get("SLURM_STEP_NUM_NODES") is not None:
        launch = _slurm_launch(env)
    else:
        return None
    return launch if launch is not None and launch.num_nodes > 1 else None


def _torchrun_launch(env: Mapping[str, str]) -> Optional[Launch]:
    per_node = _integer(env, "LOCAL_WORLD_SIZE")
    if per_node is not None and per_node != 1:
        raise ConfigurationError(
            f"torchrun started {per_node} tango processes on this host (LOCAL_WORLD_SIZE={per_node}). Run "
            "torchrun with --nproc-per-node=1: each tango process spawns the step's device_count workers "
            "itself, so device_count is the number of workers per host."
        )
    num_nodes = _required(_integer(env, "GROUP_WORLD_SIZE", "WORLD_SIZE"), "GROUP_WORLD_SIZE (torchrun)")
    if num_nodes <= 1:
        return None
    # With one process per host, torchrun's node rank (GROUP_RANK) is also its RANK.
    node_rank = _required(_integer(env, "GROUP_RANK", "RANK"), "GROUP_RANK (torchrun)")
    return Launch(
        launcher="torchrun",
        node_rank=_check_node_rank(node_rank, num_nodes, "GROUP_RANK"),
        num_nodes=num_nodes,
        master_addr=_required(env.get("MASTER_ADDR"), "MASTER_ADDR (torchrun)"),
        master_port=_required(_integer(env, "MASTER_PORT"), "MASTER_PORT (torchrun)"),
        agent_store=env.get(AGENT_STORE_VARIABLE) == str(True),
    )


def _slurm_launch(env: Mapping[str, str]) -> Optional[Launch]:
    num_nodes = _required(_integer(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES"), "SLURM_NNODES")
    tasks = _integer(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if tasks is not None and tasks != num_nodes:
        raise ConfigurationError(
            f"srun started {tasks} tasks on {num_nodes} node(s) (SLURM_NTASKS={tasks}). Run one tango per "
            "host: srun --ntasks-per-node=1. Each tango spawns the step's device_count workers itself."
        )
    if num_nodes <= 1:
        return None
    node_rank = _required(_integer(env, "SLURM_NODEID"), "SLURM_NODEID")
    master_addr = env.get("MASTER_ADDR")
    if not master_addr:
        nodelist = (
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        )
        hosts = expand_nodelist(_required(nodelist, "SLURM_JOB_NODELIST (or MASTER_ADDR)"))
        if not hosts:
            raise ConfigurationError(f"SLURM_JOB_NODELIST={nodelist!r} names no host; set MASTER_ADDR.")
        master_addr = hosts[0]
    master_port = _integer(env, "MASTER_PORT")
    if master_port is None:
        job_id = _required(_integer(env, "SLURM_JOB_ID"), "SLURM_JOB_ID (or MASTER_PORT)")
        master_port = SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    return Launch(
        launcher="slurm",
        node_rank=_check_node_rank(node_rank, num_nodes, "SLURM_NODEID"),
        num_nodes=num_nodes,
        master_addr=master_addr,
        master_port=master_port,
        agent_store=False,
    )


def _check_node_rank(node_rank: int, num_nodes: int, name: str) -> int:
    if not 0 <= node_rank < num_nodes:
        raise ConfigurationError(f"{name}={node_rank} is not a node rank of a launch of {num_nodes} hosts.")
    return node_rank


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> List[str]:
    """
    The host names of a SLURM host list, in order: ``"node[01-03,07],gpu5"`` is
    ``["node01", "node02", "node03", "node07", "gpu5"]``. Zero padding is kept; several bracket
    groups in one name (``"rack[1-2]-n[1-2]"``) expand to every combination, as Slurm does.
    """
    names: List[str] = []
    for item in _split_top_level(nodelist.strip()):
        names.extend(_expand_host(item))
    return names


def _split_top_level(text: str) -> List[str]:
    """Split at commas outside brackets."""
    items, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ConfigurationError(f"SLURM host list {text!r} has unbalanced brackets.")
    items.append(current)
    return [item for item in items if item]


def _expand_host(pattern: str) -> List[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    prefix, suffix = pattern[: match.start()], pattern[match.end() :]
    expanded = []
    for part in match.group(1).split(","):
        bounds = _RANGE.match(part.strip())
        if bounds is None:
            raise ConfigurationError(f"SLURM host list range {part!r} in {pattern!r} is not N or N-M.")
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        width = len(low)
        for number in range(int(low), int(high) + 1):
            expanded.extend(_expand_host(f"{prefix}{number:0{width}d}{suffix}"))
    return expanded


# --- Several hosts: which network interface ----------------------------------------------------------


def local_address_towards(host: str, port: int) -> str:
    """
    This host's address on the interface that routes to ``host``: the local end of a UDP socket
    connected to it (connecting a UDP socket only picks a route; nothing is sent).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as error:
        raise ConfigurationError(f"Cannot resolve the master address {host!r}: {error}.") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def interface_addresses() -> Dict[str, List[str]]:
    """Each network interface's addresses (Linux: IPv4 by ``SIOCGIFADDR``, IPv6 from ``/proc``)."""
    if not sys.platform.startswith("linux"):
        return {}
    table: Dict[str, List[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            table.setdefault(name, []).append(socket.inet_ntoa(packed[20:24]))
    try:
        with open("/proc/net/if_inet6") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) == 6:
                    table.setdefault(fields[5], []).append(str(ipaddress.IPv6Address(int(fields[0], 16))))
    except OSError:
        pass
    return table


def interface_with_address(address: str, table: Mapping[str, Sequence[str]]) -> Optional[str]:
    """The interface that has ``address``, or ``None``."""
    wanted = ipaddress.ip_address(address.split("%")[0])
    for name, addresses in table.items():
        if any(ipaddress.ip_address(a.split("%")[0]) == wanted for a in addresses):
            return name
    return None


def socket_interface_environment(
    env: Mapping[str, str], local_address: str, table: Mapping[str, Sequence[str]]
) -> Dict[str, str]:
    """
    ``{"GLOO_SOCKET_IFNAME": interface}`` for the interface holding ``local_address`` (the one
    that reaches the master), unless the user set ``GLOO_SOCKET_IFNAME``. Without it gloo binds to
    the address its host name resolves to, which on a host with several interfaces (or in a
    network namespace) may be one the other hosts cannot reach. NCCL's ``NCCL_SOCKET_IFNAME`` is
    left to NCCL, whose own choice skips loopback and docker interfaces.
    """
    if env.get("GLOO_SOCKET_IFNAME"):
        return {}
    name = interface_with_address(local_address, table)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


# --- Several hosts: the world of one attempt ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """What each host's ``tango`` process registers at the rendezvous."""

    hostname: str
    address: str
    work_dir: str
    device_count: int
    step_id: str
    token: str


@dataclasses.dataclass(frozen=True)
class HostWorld:
    """The hosts of one attempt, as a host's workers see them."""

    node_rank: int
    local_world_size: int
    store_address: str
    store_port: int
    #: Unique per attempt: parts of a checkpoint written by different attempts never mix.
    attempt: str
    hosts: Tuple[HostInfo, ...]
    #: Whether this host reads each host's work directory (itself included): a shared filesystem,
    #: unless ``TANGO_FAIRSCALE_SHARED_CHECKPOINTS=0``.
    visible: Tuple[bool, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.local_world_size

    def global_rank(self, local_rank: int, node_rank: Optional[int] = None) -> int:
        node = self.node_rank if node_rank is None else node_rank
        return node * self.local_world_size + local_rank

    def ranks_of(self, node_rank: int) -> range:
        return range(self.global_rank(0, node_rank), self.global_rank(self.local_world_size, node_rank))

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def describe(self, node_rank: int) -> str:
        """``host 1 (name, 10.0.0.2; node rank 1, global ranks 2-3)``: how errors name a host."""
        info, ranks = self.hosts[node_rank], self.ranks_of(node_rank)
        return (
            f"host {node_rank} ({info.hostname}, {info.address}; node rank {node_rank}, "
            f"global ranks {ranks.start}-{ranks.stop - 1})"
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "HostWorld":
        data = json.loads(text)
        data["hosts"] = tuple(HostInfo(**host) for host in data["hosts"])
        data["visible"] = tuple(data["visible"])
        return cls(**data)

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> Optional["HostWorld"]:
        text = env.get(WORLD_VARIABLE)
        return cls.from_json(text) if text else None


@dataclasses.dataclass
class HostTrainConfig(TrainConfig):
    """
    A worker's ``TrainConfig`` in a launch across hosts. Tango treats worker 0 as the one that
    maintains the work directory (``checkpoint_state_latest``, stale checkpoints, ``weights.pt``);
    every host has its own work directory, so that is each host's first worker here.
    """

    node_rank: int = 0
    local_world_size: int = 1

    @property
    def is_local_main_process(self) -> bool:
        return self.worker_id == self.node_rank * self.local_world_size


def worker_train_config(config: TrainConfig, world: HostWorld) -> HostTrainConfig:
    """
    The ``TrainConfig`` of one of this host's workers: the global world size, the rendezvous
    store of the attempt, and the device list repeated per host, so that Tango's
    ``devices[worker_id]`` with a global rank is the local device.
    """
    values = {field.name: getattr(config, field.name) for field in dataclasses.fields(TrainConfig)}
    values.update(
        world_size=world.world_size,
        devices=list(config.devices or [-1] * world.local_world_size) * world.num_nodes,
        distributed_address=world.store_address,
        distributed_port=world.store_port,
        # Cached from worker 0's point of view if the main process ever asked.
        _worker_local_default_device=None,
        _device_type=None,
    )
    return HostTrainConfig(**values, node_rank=world.node_rank, local_world_size=world.local_world_size)


def worker_environment(world: HostWorld, local_rank: int) -> Dict[str, str]:
    """
    The launcher variables as they hold for one worker (torchrun set them for the ``tango``
    process): code that reads ``RANK`` or ``WORLD_SIZE`` sees the worker's own.
    """
    return {
        "RANK": str(world.global_rank(local_rank)),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world.world_size),
        "LOCAL_WORLD_SIZE": str(world.local_world_size),
        "GROUP_RANK": str(world.node_rank),
        "MASTER_ADDR": world.store_address,
        "MASTER_PORT": str(world.store_port),
        AGENT_STORE_VARIABLE: str(True),
    }


def seconds_from_environment(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ConfigurationError(f"{name}={value!r}: must be a positive number of seconds.")
    return seconds


# --- Several hosts: the rendezvous of the hosts' tango processes ----------------------------------

_TOKEN_DIRECTORY = ".tango_fairscale_hosts"


def _store(address: str, port: int, timeout: float, *, server: bool = False) -> dist.TCPStore:
    return dist.TCPStore(
        address, port, is_master=server, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )


def _reachable(address: str, port: int, timeout: float = 2.0) -> bool:
    """Whether something listens at ``address:port``; a TCPStore client would retry noisily instead."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def _get(store: dist.Store, key: str, deadline: float) -> str:
    store.wait([key], timedelta(seconds=max(1.0, deadline - time.monotonic())))
    return store.get(key).decode()


class HostLostError(RuntimeError):
    """Training stopped because another host of the launch stopped answering."""


class HostFailedError(RuntimeError):
    """Training stopped because another host of the launch failed first (its error is quoted)."""


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
    for other, info in enumerate(hosts):
        if info.step_id != mine.step_id:
            raise ConfigurationError(
                f"Host {other} ({info.hostname}) runs step {info.step_id} where host {node_rank} runs "
                f"{mine.step_id}: every host must run the same config."
            )
        if info.device_count != mine.device_count:
            raise ConfigurationError(
                f"device_count: host {other} ({info.hostname}) has {info.device_count} workers, host "
                f"{node_rank} has {mine.device_count}. device_count is the number of workers per host and "
                "must be the same on every host."
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


def _first_line(error: BaseException) -> str:
    """
    One line saying what went wrong: for a worker's failure (torch's spawn quotes the worker's
    traceback) the exception line at its end, e.g. ``RuntimeError: nan loss encountered``.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        return lines[-1][:300]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


@contextmanager
def host_rendezvous(
    launch: Launch, *, step_id: str, work_dir: Path, device_count: int, timeout: float
) -> Iterator[HostSession]:
    """
    Meet the other hosts' ``tango`` processes for this step (see the module docstring), and yield
    this host's :class:`HostSession`. Host 0 serves the attempt's store until every host is done.
    """
    address = local_address_towards(launch.master_addr, launch.master_port)
    prefix = f"tango_fairscale/{step_id}"
    server: Optional[dist.TCPStore] = None
    if launch.node_rank == 0:
        server = _serve(launch, address, timeout)
        server.set("attempt", uuid.uuid4().hex)
        _claim(server, 0)
        if launch.agent_store:
            agent = _store(launch.master_addr, launch.master_port, timeout)
            generation = int(agent.add(f"{prefix}/generation", 1))
            agent.set(f"{prefix}/endpoint", f"{generation} {address} {server.port}")
        store, store_address, store_port = server, address, int(server.port)
        logger.info("Serving the rendezvous of %d hosts at %s:%d", launch.num_nodes, address, store_port)
    else:
        store = _join(launch, prefix, timeout)
        store_address, store_port = store.host, int(store.port)
    deadline = time.monotonic() + timeout
    attempt = _get(store, "attempt", deadline)
    token = uuid.uuid4().hex
    _write_token(work_dir, launch.node_rank, token)
    mine = HostInfo(
        socket.gethostname(), address, str(Path(work_dir).resolve()), device_count, step_id, token
    )
    store.set(f"info/{launch.node_rank}", json.dumps(dataclasses.asdict(mine)))
    hosts = tuple(
        HostInfo(**json.loads(_get(store, f"info/{node}", deadline))) for node in range(launch.num_nodes)
    )
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


# --- Workers: signals and orphans -----------------------------------------------------------------


def terminate_workers(grace: float = 5.0) -> int:
    """
    Stop this process's child processes (the step's workers): SIGTERM, then SIGKILL for any still
    there after ``grace`` seconds. Returns how many there were.
    """
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.kill()
            child.join(5)
    return len(children)


@contextmanager
def stop_workers_on_signals(grace: float = 5.0) -> Iterator[None]:
    """
    While the workers run: SIGINT or SIGTERM to this (``tango``) process stops them, within
    ``grace`` seconds, and then ends the step with ``KeyboardInterrupt`` (SIGINT) or exit status
    128 + 15 (SIGTERM). Without this, Python's default SIGTERM would kill this process alone, and
    SIGINT would leave it waiting for workers that go on training. No checkpoint is written: the
    last complete one is where a rerun resumes. A second signal acts as the first would have
    without this. Only the main thread can set handlers; elsewhere nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def stop(signum: int, frame: Any) -> None:
        restore()
        count = terminate_workers(grace)
        name = signal.Signals(signum).name
        logger.error(
            "%s: stopped %d worker(s). No checkpoint was written for this interruption; a rerun "
            "resumes from the last complete checkpoint.",
            name,
            count,
        )
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    for sig in signals:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        restore()


@contextmanager
def environment(updates: Mapping[str, str]) -> Iterator[None]:
    """Set ``updates`` in ``os.environ`` (inherited by the workers spawned meanwhile), then restore."""
    previous = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def die_with_parent() -> None:
    """
    In a worker: be killed (SIGKILL) when the ``tango`` process that spawned it dies, however it
    dies. torch's spawn asks for SIGINT, which a worker waiting inside a collective only sees once
    the collective returns, possibly at its timeout. Linux only; elsewhere nothing happens.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request: nobody would kill us
        os.kill(os.getpid(), signal.SIGKILL)
