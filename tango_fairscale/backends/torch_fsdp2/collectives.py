"""
FSDP2's all-gather and reduce-scatter on CPU meshes, as the same rings of gloo point-to-point
transfers that the fairscale backend uses (:mod:`tango_fairscale.cpu.collectives`), installed
through FSDP2's public hooks (``FSDPModule.set_custom_all_gather`` and
``set_custom_reduce_scatter``): no patch of torch.

Why: FSDP2's defaults call gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, which
on CPU allocate scratch copies of the whole buffer and move more bytes than a ring; models that
fit under the fairscale backend ran out of memory inside them, and steps took longer. A ring
writes each received chunk straight into its place in FSDP2's own buffers.

Before each collective, the workers all-gather what each is about to run
(:class:`CollectiveAgreement`): workers that disagree (a forward that skips a wrapped module on
one worker only) end with one line naming both collectives (:class:`CollectiveMismatchError`),
where gloo received a ring chunk of the wrong size and aborted the worker from its I/O thread
(``process 1 terminated with signal SIGABRT``, nothing else said).

Kept apart from :mod:`~tango_fairscale.cpu.collectives` so that the fairscale backend never
imports FSDP2.
"""

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ...cpu.collectives import GlooCollectives, ring_compatible
from ...cpu.memory import long_lived_allocations
from ...cpu.timing import timed

#: torch's all-gather into one tensor and reduce-scatter from one: ``all_gather_single`` and
#: ``reduce_scatter_single`` in torch 2.13, which deprecates ``all_gather_into_tensor`` and
#: ``reduce_scatter_tensor`` with a FutureWarning per worker (the older names are what torch 2.11,
#: on the GPU machines, has).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class UnitBuffer:
    """
    One buffer that the FSDP2 units of a model on a CPU mesh take turns with, for one purpose (the
    all-gather outputs, or the reduce-scatter inputs): the next unit gets the same memory, and a
    new buffer is allocated only when the size or dtype changes.

    Why it is safe: collectives on a CPU mesh are synchronous rings, and FSDP2 reads each of these
    buffers only before the next unit asks for one.

    - All-gather outputs: FSDP2 reads one once, when it copies the gathered shards out into the
      unit's parameters. In forward each unit gathers and copies out in its own pre-forward; in
      backward a unit's pre-backward copies out its own (prefetched) gather before it prefetches
      the next. One order breaks this: units inside a checkpointed unit gather again while it
      is recomputed, after its pre-backward prefetched the next unit and before that unit copies
      out. So a gather asked for while another's output in the buffer is not copied out yet
      (FSDP2's param group still holds its ``_all_gather_result``) gets a tensor of its own
      (:meth:`RingAllGather.allocate`). FSDP2 keeps a finished output referenced a little longer
      only so that, on GPUs, the next all-gather on another stream can overlap the copy-out; on
      CPU there is no such overlap.
    - Reduce-scatter inputs: FSDP2 copies a unit's gradients in, the ring reduces them, and the
      sum is in the (separate) output before the ring returns; FSDP2 keeps the input referenced
      until the next unit's reduce-scatter only so that, on GPUs, its memory is not reused while
      the collective's stream may still read it.

    Why: a fresh buffer per collective is a fresh memory mapping (a unit's worth per unit and
    per pass: gigabytes per step for a GPT-2), each page faulted in and zeroed again; and
    FSDP2's deferred free keeps two alive at a time.

    The buffer is a long-lived allocation (:func:`~tango_fairscale.cpu.memory.long_lived_allocations`):
    it has its own mapping, out of the heap that a step's short-lived tensors reuse.
    """

    def __init__(self) -> None:
        self._buffer: Optional[torch.Tensor] = None
        #: How many buffers it has allocated: one per change of size or dtype, not one per unit.
        self.allocations = 0

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(int(s) for s in size)
        buffer = self._buffer
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.device != device:
            self._buffer = None  # ours is let go before the next is taken
            # A normal tensor even when the first all-gather is a validation forward under
            # inference_mode: an inference tensor could not be written by a later training step.
            with torch.inference_mode(False), long_lived_allocations():
                buffer = self._buffer = torch.empty(numel, dtype=dtype, device=device)
            self.allocations += 1
        return buffer.view(*size)

    @property
    def nbytes(self) -> int:
        """The bytes it holds (0 when it holds no buffer)."""
        return 0 if self._buffer is None else self._buffer.untyped_storage().nbytes()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) the current buffer."""
        buffer = self._buffer
        return (
            buffer is not None and tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        )

    def release(self) -> None:
        """Let go of the buffer (FSDP2 may still hold it until its next collective)."""
        self._buffer = None


class CollectiveMismatchError(RuntimeError):
    """Workers of a CPU mesh were about to run different FSDP2 collectives."""


#: The collectives, as :class:`CollectiveAgreement` sends them.
_KINDS = {1: "all-gather", 2: "reduce-scatter"}


@dataclass
class CollectiveAgreement:
    """
    What the FSDP2 units of one model on a CPU mesh have run: their names in the order they were
    sharded (the same on every worker), and how many collectives they have run. Before a
    collective, the workers all-gather ``[kind, unit, elements, number]`` and each compares every
    worker's with its own: a message of a fixed size, which gloo delivers whatever the workers
    disagree on, where a ring chunk of another size aborts the receiving worker. Every worker sees
    the same rows, so all of them raise, and none is left waiting in a ring.
    """

    units: List[str] = field(default_factory=list)
    calls: int = 0

    def add(self, name: Optional[str]) -> int:
        self.units.append(name or f"unit {len(self.units)}")
        return len(self.units) - 1

    def check(self, kind: int, unit: int, elements: int, group: dist.ProcessGroup) -> None:
        """Raise :class:`CollectiveMismatchError` if another worker of ``group`` runs another collective."""
        world_size = dist.get_world_size(group)
        if world_size == 1:
            return
        self.calls += 1
        mine = torch.tensor([kind, unit, elements, self.calls], dtype=torch.int64)
        everyone = torch.empty(world_size * mine.numel(), dtype=torch.int64)
        # gloo's own collective of a fixed size: it applies the group's timeout (collective_timeout),
        # and it costs about a small all-reduce, a fraction of a ring transfer's wait.
        _all_gather_single(everyone, mine, group=group)
        for index, theirs in enumerate(everyone.view(world_size, -1)):
            if not torch.equal(theirs, mine):
                raise CollectiveMismatchError(
                    f"worker {dist.get_rank()} was to run {self._describe(mine)} where worker "
                    f"{dist.get_global_rank(group, index)} ran {self._describe(theirs)}: the workers "
                    "ran different collectives (e.g. a forward that skips a wrapped module on some workers "
                    "only). Every worker must run the same FSDP units, in the same order."
                )

    def _describe(self, message: torch.Tensor) -> str:
        kind, unit, elements, number = (int(value) for value in message)
        name = self.units[unit] if 0 <= unit < len(self.units) else f"unit {unit}"
        what = _KINDS.get(kind, f"collective {kind}")
        return f"collective #{number}, the {what} of {name} ({elements} elements)"


class RingAllGather(AllGather):
    """All-gather of FSDP2 units on CPU meshes: the gloo ring, synchronous (CPU has no streams)."""

    def __init__(
        self,
        buffer: Optional[UnitBuffer] = None,
        agreement: Optional[CollectiveAgreement] = None,
        unit: int = 0,
        param_groups: Optional[List[Any]] = None,
    ) -> None:
        self.buffer = buffer if buffer is not None else UnitBuffer()
        self.agreement = agreement
        self.unit = unit
        #: FSDP2's param groups of the units that share ``buffer`` (``UnitBuffers.param_groups``).
        self.param_groups: List[Any] = param_groups if param_groups is not None else []

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if any(self.buffer.holds(output) for output in self._not_copied_out()):
            # The shared buffer still holds a gather FSDP2 has not copied out (see UnitBuffer).
            with torch.inference_mode(False):
                return torch.empty(*size, dtype=dtype, device=device)
        return self.buffer.allocate(size, dtype=dtype, device=device)

    def _not_copied_out(self) -> Iterator[torch.Tensor]:
        """The all-gather outputs of the units sharing the buffer that FSDP2 has not copied out."""
        for group in self.param_groups:
            result = getattr(group, "_all_gather_result", None)
            if result is not None:
                yield result.all_gather_output

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        if self.agreement is not None:
            self.agreement.check(1, self.unit, input_tensor.numel(), group)
        world_size = dist.get_world_size(group)
        pieces = list(output_tensor.chunk(world_size))
        if not ring_compatible(pieces, input_tensor, world_size):
            with timed("all_gather"):
                # Synchronous, like the ring: the shared buffer relies on it (UnitBuffer).
                _all_gather_single(output_tensor, input_tensor, group=group)
            return None
        GlooCollectives.all_gather(pieces, input_tensor, group=group)  # timed there
        return None  # done: FSDP2 waits only on a Work


class RingReduceScatter(ReduceScatter):
    """
    Reduce-scatter of FSDP2 units' gradients on CPU meshes: the gloo ring for a sum or an
    average (a sum divided by the number of workers, as gloo's average is), gloo's own otherwise.

    FSDP2 asks for two tensors per reduce-scatter, the input (a unit's gradients, copied in) and
    then the output (the unit's new gradient shards, which live until the optimizer has used
    them).

    - The input: the nested units of a model take turns with one :class:`UnitBuffer`
      (``inputs``). The root (``ends_backward``) reduces last in backward, its parameters
      (embeddings, say) being the first in forward: its input is a tensor of its own, freed when
      its ring returns, and then the shared buffer is let go, so that no gradient-sized buffer is
      held through the optimizer step and the next forward. (A root reduced earlier lets go of a
      buffer the units take again: only a fresh mapping is lost.) Without ``inputs`` every input
      is a tensor of its own, freed when its ring returns.
    - The output is a long-lived allocation (:func:`~tango_fairscale.cpu.memory.long_lived_allocations`):
      it becomes the gradient shards. (Where FSDP2 reduces in another dtype than the parameters',
      or adds it to gradients already there, it casts or adds it into another tensor and frees
      this one: a mapping allocated for nothing, not a wrong result.)

    Where the root does not reduce-scatter (no trainable parameters of its own, or a shard group
    of one worker, where FSDP2 copies instead of calling the collective), the shared input buffer
    is kept through the optimizer step: memory, not a wrong result.
    """

    def __init__(
        self,
        inputs: Optional[UnitBuffer] = None,
        *,
        ends_backward: bool = False,
        agreement: Optional[CollectiveAgreement] = None,
        unit: int = 0,
    ) -> None:
        self.inputs = inputs
        self.ends_backward = ends_backward
        self.agreement = agreement
        self.unit = unit
        #: Whether the next allocation is an output (the input of the same reduce-scatter was given).
        self._input_given = False

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if not self._input_given:
            if self.inputs is not None and not self.ends_backward:
                given = self.inputs.allocate(size, dtype=dtype, device=device)
            else:
                given = torch.empty(*size, dtype=dtype, device=device)
            self._input_given = True  # only once it was given: a failed allocation leaves no step
            return given
        # Before allocating: an output that cannot be allocated leaves the next call an input.
        self._input_given = False
        with long_lived_allocations():
            return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        self._input_given = False
        if self.inputs is not None and self.inputs.holds(output_tensor):
            # FSDP2 (torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce) asks
            # for the input first: an output in the shared buffer would be overwritten.
            raise RuntimeError(
                "FSDP2 asked for a reduce-scatter's output before its input (torch "
                f"{torch.__version__}): the torch backend's CPU collectives expect FSDP2's "
                "foreach_reduce to allocate the input first, then the output."
            )
        if self.agreement is not None:
            self.agreement.check(2, self.unit, output_tensor.numel(), group)
        world_size = dist.get_world_size(group)
        pieces = list(input_tensor.chunk(world_size))
        average = op == dist.ReduceOp.AVG
        with timed("reduce_scatter"):
            if not (average or op == dist.ReduceOp.SUM) or not ring_compatible(
                pieces, output_tensor, world_size
            ):
                _reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)
            else:
                GlooCollectives._reduce_scatter(output_tensor, pieces, dist.ReduceOp.SUM, group, False)
                if average:
                    output_tensor.div_(world_size)
        if self.inputs is None or not self.inputs.holds(input_tensor):
            # Its own: freed now rather than when FSDP2 lets go of it, after the next unit's
            # backward (a unit's gradients' worth of memory).
            input_tensor.untyped_storage().resize_(0)
        if self.ends_backward and self.inputs is not None:
            self.inputs.release()
        return None


def param_groups(module: Any) -> List[Any]:
    """
    FSDP2's param groups of a sharded ``module`` (none for a unit without parameters of its own):
    a list from torch 2.13 (``_fsdp_param_groups``), a single optional one before
    (``_fsdp_param_group``, which later releases keep as a property for one group).
    """
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


@dataclass
class UnitBuffers:
    """The buffers the FSDP2 units of one model share: all-gather outputs, reduce-scatter inputs."""

    gathers: UnitBuffer = field(default_factory=UnitBuffer)
    scatters: UnitBuffer = field(default_factory=UnitBuffer)
    #: The units' collectives, checked to agree across the workers before each one.
    agreement: CollectiveAgreement = field(default_factory=CollectiveAgreement)
    #: FSDP2's param group of each unit sharing ``gathers``, whose pending all-gather it checks.
    param_groups: List[Any] = field(default_factory=list)


def use_ring_collectives(
    module: Any, buffers: UnitBuffers, *, root: bool, name: Optional[str] = None
) -> None:
    """
    Make an FSDP2 unit on a CPU mesh gather and reduce-scatter with the rings; the units of one
    model share ``buffers`` (:class:`UnitBuffer`), ``root`` says whether this is the model's root,
    ``name`` is the unit's, for errors (:class:`CollectiveAgreement`).
    """
    unit = buffers.agreement.add(name)
    for group in param_groups(module):
        if not hasattr(group, "_all_gather_result"):
            raise RuntimeError(
                f"FSDP2's param group has no _all_gather_result on torch {torch.__version__}: the torch "
                "backend's CPU all-gathers cannot tell a pending gather from a copied-out one."
            )
        buffers.param_groups.append(group)
    module.set_custom_all_gather(
        RingAllGather(buffers.gathers, buffers.agreement, unit, buffers.param_groups)
    )
    module.set_custom_reduce_scatter(
        RingReduceScatter(buffers.scatters, ends_backward=root, agreement=buffers.agreement, unit=unit)
    )
