"""Several hosts: the world of one attempt, and what a worker's ``TrainConfig`` and environment become."""

import dataclasses
import json
import platform
from typing import Dict, Mapping, Optional, Tuple

import torch
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import TrainConfig

from ..topology import Topology
from ..version import VERSION
from .launchers import WORLD_VARIABLE
from .store import AGENT_STORE_VARIABLE


@dataclasses.dataclass(frozen=True)
class HostInfo:
    """What each host's ``tango`` process registers at the rendezvous."""

    hostname: str
    address: str
    work_dir: str
    device_count: int
    step_id: str
    token: str
    #: The tango-fairscale version the host runs (hosts must agree).
    version: str = VERSION
    #: The torch release and the Python version the host runs (hosts must agree: checkpoints and
    #: collectives differ between releases).
    torch: str = dataclasses.field(default_factory=lambda: str(torch.__version__))
    python: str = dataclasses.field(default_factory=lambda: platform.python_version())
    #: A fingerprint of the pretrained files the step's model reads on this host ("" for none):
    #: hosts reading different files at the same path would train a model cut along the shards.
    base_files: str = ""


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

    @property
    def topology(self) -> Topology:
        return Topology(self.world_size, self.local_world_size)

    def global_rank(self, local_rank: int, node_rank: Optional[int] = None) -> int:
        node = self.node_rank if node_rank is None else node_rank
        return self.topology.leader_of(node) + local_rank

    def ranks_of(self, node_rank: int) -> range:
        return self.topology.ranks_of(node_rank)

    def node_of(self, rank: int) -> int:
        return self.topology.host_of(rank)

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
        return Topology(self.world_size, self.local_world_size).is_leader(self.worker_id)


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
