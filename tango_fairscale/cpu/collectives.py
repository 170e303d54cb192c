"""
All-gather and reduce-scatter as rings of gloo point-to-point transfers, for FairScale's FSDP
on CPU workers.

Each worker sends to the next and receives from the previous, ``world_size - 1`` times, so
every worker moves ``(world_size - 1) / world_size`` of the buffer each way: the least any
all-gather or reduce-scatter can move, and half of what an all-reduce moves. Measured on 2
workers and 64 MiB: all-gather 18 ms (gloo's own 94 ms, an all-reduce 45 ms), reduce-scatter
24 ms; on 4 workers 49 and 64 ms against 137 ms for an all-reduce. Gathering copies, so its
values are gloo's bit for bit; each reduce-scatter sum has a fixed order, so results are
deterministic, and with 2 workers (one addition, which commutes) equal to gloo's and DDP's.
"""

import types
from datetime import timedelta
from typing import Any, List, Optional, cast

import torch
import torch.distributed as dist

from .timing import timed


class GlooCollectives(types.ModuleType):
    """
    What FairScale's FSDP module and its reduce-scatter bucketer see as ``torch.distributed``
    on CPU workers: all-gather and reduce-scatter as rings of point-to-point transfers.

    Each worker sends to the next and receives from the previous, ``world_size - 1`` times,
    one chunk at a time, so every worker moves ``(world_size - 1) / world_size`` of the buffer
    each way: the least any all-gather or reduce-scatter can move, and half of what an all-reduce
    moves. Every call that FairScale makes synchronously with equal-sized contiguous pieces takes
    the ring; anything else goes to gloo's own collective. Which path is taken depends only on
    shapes, dtypes and layouts, which are the same on every worker, so workers never disagree.
    Each call, either path, is timed (:mod:`tango_fairscale.cpu.timing`).
    """

    @staticmethod
    def all_gather(
        tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        with timed("all_gather"):
            return GlooCollectives._all_gather(tensor_list, tensor, group, async_op)

    @staticmethod
    def _all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Any, async_op: bool) -> Any:
        ring = Ring(group)
        if async_op or not ring_compatible(tensor_list, tensor, ring.size):
            return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        mine = tensor_list[ring.rank]
        if mine.data_ptr() != tensor.data_ptr():
            mine.copy_(tensor.view_as(mine))
        # Step s passes on the chunk received in step s - 1 (our own first).
        for step in range(ring.size - 1):
            ring.exchange(send=tensor_list[ring.chunk(-step)], receive=tensor_list[ring.chunk(-step - 1)])
        return None

    @staticmethod
    def reduce_scatter(
        output: torch.Tensor,
        input_list: List[torch.Tensor],
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        with timed("reduce_scatter"):
            return GlooCollectives._reduce_scatter(output, input_list, op, group, async_op)

    @staticmethod
    def _reduce_scatter(
        output: torch.Tensor, input_list: List[torch.Tensor], op: Any, group: Any, async_op: bool
    ) -> Any:
        ring = Ring(group)
        if (
            async_op
            or op != dist.ReduceOp.SUM
            or not ring_compatible(input_list, output, ring.size)
            or any(overlaps(output, piece) for piece in input_list)
        ):
            return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        # FairScale's inputs are scratch (a gradient bucket, or chunks of a gradient it drops
        # right after), so partial sums are accumulated in them. ``output`` is the receive
        # buffer: a partial sum arrives there, is added to our own piece of that chunk, and the
        # total goes on to the next worker. The chunk this worker keeps arrives last.
        for step in range(ring.size - 1):
            ring.exchange(send=input_list[ring.chunk(-step - 1)], receive=output)
            if step < ring.size - 2:
                target = input_list[ring.chunk(-step - 2)]
                target.add_(output.view_as(target))
        # Floating-point addition commutes exactly, so this is the same sum either way round.
        mine = input_list[ring.rank].view_as(output)
        if ring.size == 1:
            output.copy_(mine)
        else:
            output.add_(mine)
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


class CollectiveTimeoutError(RuntimeError):
    """A ring transfer's peer did not answer within the process group's timeout."""


def group_timeout(group: dist.ProcessGroup) -> Optional[timedelta]:
    """
    The timeout the process group was started with (the engine's ``collective_timeout``), which
    gloo applies to its collectives but not to a point-to-point transfer's ``wait()``: without it
    a ring whose peer never sends (workers that disagree on which collectives to run) waited
    forever. ``None`` where the group's backend does not say.
    """
    try:
        backend = group._get_backend(torch.device("cpu"))
        timeout = backend.options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) and timeout > timedelta(0) else None


class Ring:
    """The workers of a process group in rank order, closed into a ring."""

    def __init__(self, group: Any) -> None:
        self.group = cast(dist.ProcessGroup, group if group is not None else dist.group.WORLD)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self._next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self._previous = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        # The default group's: FairScale makes its groups with new_group(), which gives them
        # torch's 30-minute default rather than the engine's collective_timeout.
        self._timeout = group_timeout(cast(dist.ProcessGroup, dist.group.WORLD))

    def chunk(self, offset: int) -> int:
        """Index of the chunk ``offset`` places from this worker's own."""
        return (self.rank + offset) % self.size

    def exchange(self, send: torch.Tensor, receive: torch.Tensor) -> None:
        """Send ``send`` to the next worker while receiving ``receive`` from the previous one."""
        sending = dist.isend(send, self._next, group=self.group)
        receiving = dist.irecv(receive, self._previous, group=self.group)
        for request, peer, what in (
            (sending, self._next, "send to"),
            (receiving, self._previous, "receive from"),
        ):
            if request is None:  # None only for workers outside the group
                continue
            if self._timeout is None:
                request.wait()
                continue
            try:
                request.wait(self._timeout)
            except RuntimeError as error:
                if "imed out" not in str(error):
                    raise
                seconds = self._timeout.total_seconds()
                raise CollectiveTimeoutError(
                    f"worker {dist.get_rank()} waited {seconds:g} s (collective_timeout) "
                    f"to {what} worker {peer} in a ring all-gather or reduce-scatter of FSDP on CPU workers: "
                    "the workers ran different collectives (e.g. a forward that skips a wrapped module on "
                    "some workers only), or that worker is stuck."
                ) from None


def ring_compatible(pieces: List[torch.Tensor], single: torch.Tensor, world_size: int) -> bool:
    """
    Whether ``pieces`` (one per worker) and ``single`` are equal-sized, same-dtype, contiguous
    CPU tensors.
    """
    return (
        len(pieces) == world_size
        and single.is_contiguous()
        and all(
            piece.is_contiguous()
            and piece.device.type == "cpu"
            and piece.dtype == single.dtype
            and piece.numel() == single.numel()
            for piece in pieces
        )
    )


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share any bytes of memory."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + a.numel() * a.element_size()
    b_end = b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end
