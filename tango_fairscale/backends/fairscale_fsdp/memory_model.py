"""
What FairScale's FSDP holds of a training step's memory, for ``plan``
(:class:`~tango_fairscale.backends.base.MemoryModel`): each unit's parameters one flat parameter
(``flatten_parameters``), gathered in the compute dtype, and its reduce-scatter bucket, sized as
the backend sizes it (:func:`~.bucketing.sufficient_bucket_cap_mb`), held from the first gradient
that fits in it to the end of backward, whose output a bucketed gradient's shard keeps whole.
"""

import dataclasses
import math
from typing import List, Sequence

from ...fsdp_options import FSDPOptions
from ..base import GATHERED_GRADIENTS, GRADIENTS, MemoryLedger, MemoryModel, ReduceScatter, UnitShape
from .bucketing import sufficient_bucket_cap_mb

__all__ = ["FairScaleMemoryModel"]


@dataclasses.dataclass(frozen=True)
class FairScaleMemoryModel(MemoryModel):
    """FairScale's FSDP: flat parameters, gradients that fit ``bucket_cap_mb`` reduced through its bucket."""

    reduce_scatter_bucket = True

    @classmethod
    def from_config(
        cls, fsdp_config: FSDPOptions, units: Sequence[UnitShape], world_size: int, element_size: int
    ) -> "FairScaleMemoryModel":
        model = cls(
            world_size=world_size,
            element_size=element_size,
            fp32_reduce_scatter=fsdp_config.fp32_reduce_scatter,
            flat=fsdp_config.flatten_parameters,
            bucket_cap_mb=fsdp_config.bucket_cap_mb,
        )
        # The bucket the backend makes: no larger than the gradients that go into it.
        gradients = ((unit.trainable_numel, model.gradient_element_size(unit), world_size) for unit in units)
        return dataclasses.replace(
            model, bucket_cap_mb=sufficient_bucket_cap_mb(model.bucket_cap_mb, gradients)
        )

    def bucketed(self, unit: UnitShape) -> bool:
        """Whether ``unit``'s gradient is reduced through the bucket (it fits in ``bucket_cap_mb``)."""
        size = unit.trainable_numel * self.gradient_element_size(unit)
        return 0 < size <= self.bucket_cap_mb << 20

    def gradient_bytes(self, units: Sequence[UnitShape], world_size: int) -> int:
        """
        A shard of each trainable parameter; but FairScale hands out a bucketed gradient's shard
        as a view of the bucket's output, whose whole ``bucket_cap_mb / world size`` stays with it
        (in the gradient's dtype it stays as it is; a mixed-precision gradient is copied to float32
        instead).
        """
        shards = 0
        bucket = 0
        for unit in units:
            shard = unit.shards(world_size)[0]
            if self.bucketed(unit) and self.gradient_element_size(unit) == self.element_size:
                bucket += shard * self.element_size
            else:
                shards += shard * self.element_size
        output = (self.bucket_cap_mb << 20) // world_size
        return shards + (math.ceil(bucket / output) * output if bucket else 0)

    def reduce_scatter(self, ledger: MemoryLedger, accumulating: bool) -> ReduceScatter:
        return _BucketedReduceScatter(self, ledger, accumulating)


class _BucketedReduceScatter(ReduceScatter):
    """
    FairScale's reduce-scatters in one backward: a gradient that fits ``bucket_cap_mb`` copied into
    the bucket (its input, ``bucket_cap_mb``, and its output, a shard of it), allocated at the first
    such gradient and kept to the end of backward, flushed when the next does not fit; the others
    reduced on their own.
    """

    model: FairScaleMemoryModel

    def __init__(self, model: FairScaleMemoryModel, ledger: MemoryLedger, accumulating: bool) -> None:
        super().__init__(model, ledger, accumulating)
        self.open = False
        self.offset = 0
        self.units: List[UnitShape] = []

    def gradient_joined(self, unit: UnitShape) -> None:
        if self.model.bucketed(unit):
            model = self.model
            self._into_bucket(unit, unit.shards(model.world_size)[0] * model.gradient_element_size(unit))

    def gradient_reduced(self, unit: UnitShape) -> None:
        if not self.model.bucketed(unit):
            super().gradient_reduced(unit)

    def finish(self) -> None:
        if self.open:
            self._flush()
            # FairScale's teardown: the bucket and its (new, empty) output freed.
            self.ledger.hold(GATHERED_GRADIENTS, -self._bucket_bytes())
            self.open = False

    def _bucket_bytes(self) -> int:
        """FairScale's bucket: its input (``bucket_cap_mb``) and its output (a shard of it)."""
        return self._output_bytes() * (self.model.world_size + 1)

    def _output_bytes(self) -> int:
        return (self.model.bucket_cap_mb << 20) // self.model.world_size

    def _into_bucket(self, unit: UnitShape, shard: int) -> None:
        """A gradient copied into the bucket (set up for this backward first; flushed first if full)."""
        if not self.open:
            self.open = True
            self.ledger.hold(GATHERED_GRADIENTS, self._bucket_bytes())
        if shard > self._output_bytes() - self.offset:
            self._flush()
        self.offset += shard
        self.units.append(unit)

    def _flush(self) -> None:
        """
        The bucket reduced: its units' shards taken from its output (a view that keeps the whole
        output, or a float32 copy under mixed precision; added in place to earlier micro-batches'),
        and a new output allocated.
        """
        if not self.offset:
            return
        model = self.model
        output = self._output_bytes()
        if not self.accumulating:
            if all(model.gradient_element_size(u) == model.element_size for u in self.units):
                kept = output
            else:
                kept = sum(u.shards(model.world_size)[0] for u in self.units) * model.element_size
            self.ledger.hold(GRADIENTS, kept)
        # The old output kept by the shards (counted above) or freed; a new one allocated.
        self.ledger.hold(GATHERED_GRADIENTS, -output)
        self.ledger.hold(GATHERED_GRADIENTS, output)
        self.offset = 0
        self.units = []


#: This backend's memory model (:meth:`~tango_fairscale.backends.base.Backend.memory_model`).
MEMORY_MODEL = FairScaleMemoryModel
