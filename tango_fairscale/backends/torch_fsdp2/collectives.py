"""
FSDP2's all-gather and reduce-scatter on CPU meshes, as the same rings of gloo point-to-point
transfers that the fairscale backend uses (:mod:`tango_fairscale.cpu.collectives`), installed
through FSDP2's public hooks (``FSDPModule.set_custom_all_gather`` and
``set_custom_reduce_scatter``): no patch of torch.

Why: FSDP2's defaults call gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, which
on CPU allocate scratch copies of the whole buffer and move more bytes than a ring; models that
fit under the fairscale backend ran out of memory inside them, and steps took longer. A ring
writes each received chunk straight into its place in FSDP2's own buffers.

Kept apart from :mod:`~tango_fairscale.cpu.collectives` so that the fairscale backend never
imports FSDP2.
"""

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ...cpu.collectives import GlooCollectives, ring_compatible
from ...cpu.timing import timed


class _Allocate:
    """A fresh buffer per call: FSDP2's default, and what a ring needs (no shared scratch)."""

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class RingAllGather(_Allocate, AllGather):
    """All-gather of FSDP2 units on CPU meshes: the gloo ring, synchronous (CPU has no streams)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        world_size = dist.get_world_size(group)
        pieces = list(output_tensor.chunk(world_size))
        if not ring_compatible(pieces, input_tensor, world_size):
            with timed("all_gather"):
                return dist.all_gather_into_tensor(
                    output_tensor, input_tensor, group=group, async_op=async_op
                )
        GlooCollectives.all_gather(pieces, input_tensor, group=group)  # timed there
        return None  # done: FSDP2 waits only on a Work


class RingReduceScatter(_Allocate, ReduceScatter):
    """
    Reduce-scatter of FSDP2 units' gradients on CPU meshes: the gloo ring for a sum or an
    average (a sum divided by the number of workers, as gloo's average is), gloo's own otherwise.
    FSDP2's input is a scratch copy of the gradients, which the ring accumulates partial sums in.
    """

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        world_size = dist.get_world_size(group)
        pieces = list(input_tensor.chunk(world_size))
        average = op == dist.ReduceOp.AVG
        with timed("reduce_scatter"):
            if not (average or op == dist.ReduceOp.SUM) or not ring_compatible(
                pieces, output_tensor, world_size
            ):
                return dist.reduce_scatter_tensor(
                    output_tensor, input_tensor, op=op, group=group, async_op=async_op
                )
            GlooCollectives._reduce_scatter(output_tensor, pieces, dist.ReduceOp.SUM, group, False)
            if average:
                output_tensor.div_(world_size)
        return None


def use_ring_collectives(module: Any) -> None:
    """Make an FSDP2 unit on a CPU mesh gather and reduce-scatter with the rings."""
    module.set_custom_all_gather(RingAllGather())
    module.set_custom_reduce_scatter(RingReduceScatter())
