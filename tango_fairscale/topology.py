"""
Who is where: the workers of a run grouped by host, and the one rule for which worker leads a
host (maintains its work directory, writes its checkpoint marker and ``weights.pt``, exchanges
files with the other hosts). Every module that needs the rule asks a :class:`Topology`.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Topology:
    """``world_size`` workers, ``workers_per_host`` on each host, global ranks host by host."""

    #: Workers in the run, every host's.
    world_size: int
    #: Workers on each host (the same on every host).
    workers_per_host: int

    def __post_init__(self) -> None:
        if self.workers_per_host < 1 or self.world_size < 1 or self.world_size % self.workers_per_host:
            raise ValueError(
                f"Topology: {self.world_size} workers cannot be split into hosts of {self.workers_per_host}."
            )

    @classmethod
    def one_host(cls, world_size: int) -> "Topology":
        return cls(world_size, world_size)

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.workers_per_host

    def host_of(self, rank: int) -> int:
        return rank // self.workers_per_host

    def ranks_of(self, host: int) -> range:
        return range(host * self.workers_per_host, (host + 1) * self.workers_per_host)

    def leader_of(self, host: int) -> int:
        """The global rank of ``host``'s leader: its first worker."""
        return host * self.workers_per_host

    def is_leader(self, rank: int) -> bool:
        return self.leader_of(self.host_of(rank)) == rank
