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

    def gathered_bytes(self, unit: UnitShape) -> int:
        # Under mixed precision the shard is cast to the compute dtype for the all-gather too.
        shard = sum(unit.shards(self.world_size)) if unit.compute_element_size != self.element_size else 0
        return (unit.numel + shard) * unit.compute_element_size

    def reducing_bytes(self, unit: UnitShape, gradients: int) -> int:
        # The unit's gradients copied into one reduce-scatter input; with fp32_reduce_scatter
        # (reduce_dtype float32) a float32 copy besides.
        if self.fp32_reduce_scatter and unit.compute_element_size < self.element_size:
            gradients += unit.trainable_numel * self.element_size
        return gradients

    def gradient_bytes(self, units: Sequence[UnitShape], world_size: int) -> int:
        """A shard of each trainable parameter."""
        return sum(unit.shards(world_size)[0] for unit in units) * self.element_size

    def reduce_scatter(self, ledger: MemoryLedger, accumulating: bool) -> ReduceScatter:
        return ReduceScatter(self, ledger, accumulating)


#: This backend's memory model (:meth:`~tango_fairscale.backends.base.Backend.memory_model`).
MEMORY_MODEL = TorchMemoryModel
