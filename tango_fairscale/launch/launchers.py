"""Several hosts: the launcher's environment (torchrun, SLURM), read without side effects."""

import dataclasses
import re
from typing import Any, Iterator, List, Mapping, Optional

from tango.common.exceptions import ConfigurationError

from .store import AGENT_STORE_VARIABLE

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
#: that checkpoints stay per-host parts (see :mod:`tango_fairscale.launch.multihost`).
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


def _port(value: Optional[int], name: str) -> Optional[int]:
    """A TCP port number, or an error naming the variable (TCPStore raised a bare TypeError)."""
    if value is not None and not 1 <= value <= 65535:
        raise ConfigurationError(f"{name}={value} in the environment is not a TCP port (1 to 65535).")
    return value


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
        master_port=_required(_port(_integer(env, "MASTER_PORT"), "MASTER_PORT"), "MASTER_PORT (torchrun)"),
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
        # Only the first host is needed: a list of millions of names is not expanded.
        first = next(iter_nodelist(_required(nodelist, "SLURM_JOB_NODELIST (or MASTER_ADDR)")), None)
        if first is None:
            raise ConfigurationError(f"SLURM_JOB_NODELIST={nodelist!r} names no host; set MASTER_ADDR.")
        master_addr = first
    master_port = _port(_integer(env, "MASTER_PORT"), "MASTER_PORT")
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
    return list(iter_nodelist(nodelist))


def iter_nodelist(nodelist: str) -> Iterator[str]:
    """:func:`expand_nodelist` one name at a time: the first host of ``node[1-100000000]`` at once."""
    for item in _split_top_level(nodelist.strip()):
        yield from _expand_host(item)


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


def _expand_host(pattern: str) -> Iterator[str]:
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        yield pattern
        return
    prefix, suffix = pattern[: match.start()], pattern[match.end() :]
    parts = match.group(1).split(",")
    for part in parts:  # every range checked before the first name is given
        if _RANGE.match(part.strip()) is None:
            raise ConfigurationError(f"SLURM host list range {part!r} in {pattern!r} is not N or N-M.")
    for part in parts:
        bounds = _RANGE.match(part.strip())
        assert bounds is not None
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        width = len(low)
        for number in range(int(low), int(high) + 1):
            yield from _expand_host(f"{prefix}{number:0{width}d}{suffix}")
