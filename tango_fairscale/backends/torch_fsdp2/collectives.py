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

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ...cpu.collectives import GlooCollectives, ring_compatible
from ...cpu.timing import timed


class GatherBuffer:
    """
    The one all-gather output buffer the FSDP2 units of a model on a CPU mesh share, reused from
    one unit's all-gather to the next (a new one only when the size or dtype changes).

    Why it is safe: FSDP2 reads a unit's all-gather output once, when it copies the gathered
    shards out into the unit's parameters, and with FSDP2's implicit prefetching and synchronous
    collectives (a ring on CPU) that copy-out always happens before the next all-gather is
    allocated: in forward each unit gathers and copies out in its own pre-forward; in backward
    a unit's pre-backward copies out its own (prefetched) gather before it prefetches the next.
    FSDP2 keeps a finished output referenced a little longer only so that, on GPUs, the next
    all-gather on another stream can overlap the copy-out; on CPU there is no such overlap.

    Why: a fresh buffer per all-gather is a fresh memory mapping (hundreds of MiB per step for a
    GPT-2, each page faulted in again), and FSDP2's deferred free keeps two alive in forward.
    """

    def __init__(self) -> None:
        self._buffer: Optional[torch.Tensor] = None
        #: How many buffers it has allocated: one per change of size or dtype, not one per all-gather.
        self.allocations = 0

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(int(s) for s in size)
        buffer = self._buffer
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.device != device:
            self._buffer = None  # ours is let go before the next is taken
            # A normal tensor even when the first all-gather is a validation forward under
            # inference_mode: an inference tensor could not be written by a later training step.
            with torch.inference_mode(False):
                buffer = self._buffer = torch.empty(numel, dtype=dtype, device=device)
            self.allocations += 1
        return buffer.view(*size)

    def release(self) -> None:
        """Let go of the buffer (FSDP2 may still hold it until its next all-gather)."""
        self._buffer = None


class RingAllGather(AllGather):
    """All-gather of FSDP2 units on CPU meshes: the gloo ring, synchronous (CPU has no streams)."""

    def __init__(self, buffer: Optional[GatherBuffer] = None) -> None:
        self.buffer = buffer if buffer is not None else GatherBuffer()

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.buffer.allocate(size, dtype=dtype, device=device)

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
                # Synchronous, like the ring: the shared buffer relies on it (GatherBuffer).
                dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)
            return None
        GlooCollectives.all_gather(pieces, input_tensor, group=group)  # timed there
        return None  # done: FSDP2 waits only on a Work


class RingReduceScatter(ReduceScatter):
    """
    Reduce-scatter of FSDP2 units' gradients on CPU meshes: the gloo ring for a sum or an
    average (a sum divided by the number of workers, as gloo's average is), gloo's own otherwise.
    FSDP2's input is a scratch copy of the gradients, which the ring accumulates partial sums in;
    once the ring is done its memory is freed. (FSDP2 keeps each input referenced until the next
    unit's reduce-scatter so that on GPUs the memory is not reused while the collective's stream
    may still read it; a synchronous ring on CPU has finished with it, and holding it would keep a
    whole unit's gradients' worth of memory through the next unit's backward.) The output is a
    fresh tensor: it becomes the unit's sharded gradients.
    """

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

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
                dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            else:
                GlooCollectives._reduce_scatter(output_tensor, pieces, dist.ReduceOp.SUM, group, False)
                if average:
                    output_tensor.div_(world_size)
        input_tensor.untyped_storage().resize_(0)
        return None


def use_ring_collectives(module: Any, buffer: Optional[GatherBuffer] = None) -> None:
    """
    Make an FSDP2 unit on a CPU mesh gather and reduce-scatter with the rings; the units of one
    model share one ``buffer`` for their all-gathers (:class:`GatherBuffer`).
    """
    module.set_custom_all_gather(RingAllGather(buffer))
    module.set_custom_reduce_scatter(RingReduceScatter())
