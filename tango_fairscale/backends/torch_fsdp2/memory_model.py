"""
What PyTorch's FSDP2 holds of a training step's memory, for ``plan``
(:class:`~tango_fairscale.backends.base.MemoryModel`): each parameter sharded on its own (no flat
parameter), a unit gathered in its compute dtype, and each unit's gradient reduce-scattered on its
own (``bucket_cap_mb`` has no FSDP2 counterpart: :mod:`.sharding` takes only FairScale's ``0``
and its default, both one reduce-scatter per unit), its shard kept.
"""

import dataclasses
from typing import Sequence

from ...fsdp_options import FSDPOptions
from ..base import MemoryLedger, MemoryModel, ReduceScatter, UnitShape

__all__ = ["TorchMemoryModel"]


@dataclasses.dataclass(frozen=True)
class TorchMemoryModel(MemoryModel):
    """FSDP2: per-parameter shards, one reduce-scatter per unit, no bucket."""

    @classmethod
    def from_config(
        cls, fsdp_config: FSDPOptions, units: Sequence[UnitShape], world_size: int, element_size: int
    ) -> "TorchMemoryModel":
        return cls(
            world_size=world_size,
            element_size=element_size,
            fp32_reduce_scatter=fsdp_config.fp32_reduce_scatter,
        )

    def gradient_bytes(self, units: Sequence[UnitShape], world_size: int) -> int:
        """A shard of each trainable parameter."""
        return sum(unit.shards(world_size)[0] for unit in units) * self.element_size

    def reduce_scatter(self, ledger: MemoryLedger, accumulating: bool) -> ReduceScatter:
        return ReduceScatter(self, ledger, accumulating)


#: This backend's memory model (:meth:`~tango_fairscale.backends.base.Backend.memory_model`).
MEMORY_MODEL = TorchMemoryModel
