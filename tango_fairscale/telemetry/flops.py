"""
:class:`FlopMeter`: a worker's model FLOPs per step, counted once per run with
:class:`torch.utils.flop_counter.FlopCounterMode` and scaled to the other steps.
"""

from typing import Any, Dict, Optional, Tuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..versions import _TORCH_GREATER_EQUAL_2_15
from .tokens import BatchCount

__all__ = ["FlopMeter", "KERNEL_AND_COMPOSITE_OPS"]

#: The aten ops (torch 2.13) with a kernel of their own for CPU or CUDA tensors and also a
#: CompositeImplicitAutograd one: those reach FlopCounterMode's dispatch mode, which runs the
#: composite form of an op it has no formula for instead of the kernel. The composite form rounds
#: otherwise: ``silu_backward`` (Llama's MLP) made the counted step's gradients differ from every
#: other step's in the last bits, so a resumed run (which counts its first step, not step 0) and
#: Tango's DDP engine (which counts nothing) ended 1e-7 to 1e-6 away from the uninterrupted FSDP
#: run. None of these ops is or holds a matrix product, so they count no FLOPs either way: given a
#: formula of their own (zero) they run as without the counter, and the count is FlopCounterMode's.
#: ``tests/test_resume_exact.py`` enumerates them again from torch's dispatcher and its
#: ``native_functions.yaml`` (for the CUDA kernels a CPU build does not register).
KERNEL_AND_COMPOSITE_OPS = (
    "_fused_rms_norm",  # CUDA only: torch.nn.RMSNorm on GPUs
    "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d",
    "mish_backward",
    "native_batch_norm",
    "native_channel_shuffle",
    "silu_backward",
    "upsample_nearest1d",
    "upsample_nearest2d",
    "upsample_nearest3d",
)


def _no_flops(*args: Any, **kwargs: Any) -> int:
    return 0


def flop_counter() -> FlopCounterMode:
    """
    A :class:`~torch.utils.flop_counter.FlopCounterMode` under which every op runs the kernel it
    runs without one (see :data:`KERNEL_AND_COMPOSITE_OPS`), so that the counted step computes
    the same numbers, bit for bit, as any other. Its count is FlopCounterMode's.
    """
    # Keyed as the mode looks an op up before decomposing it: by the overload up to torch 2.14,
    # by the overload packet from 2.15. (Its own formulas are keyed by the packet, and only those
    # are counted: an entry here counts zero, as the op without one does.)
    packets = [getattr(torch.ops.aten, name) for name in KERNEL_AND_COMPOSITE_OPS]
    keys = packets if _TORCH_GREATER_EQUAL_2_15 else [packet.default for packet in packets]
    return FlopCounterMode(display=False, custom_mapping=dict.fromkeys(keys, _no_flops))


class FlopMeter:
    """
    The model FLOPs of one worker's steps in one training run.

    :class:`~torch.utils.flop_counter.FlopCounterMode` is active from the start of the first step
    given to :meth:`start` to the end of that step's backward passes (:meth:`stop`), so it counts
    the forward and backward passes of its micro-batches as executed (the optimizer step is not
    model FLOPs). With activation checkpointing the recomputed forward passes are executed, so they
    are counted too. Other steps' FLOPs are that count scaled by their sequence positions (or
    samples) over the counted step's: the same for batches of one shape. The counted step computes
    what it computes without the counter, bit for bit (:func:`flop_counter`): a resumed run counts
    its first step, and must train as the uninterrupted run did.
    """

    def __init__(self) -> None:
        self._counter: Optional[FlopCounterMode] = None
        self._counting: Optional[Tuple[int, BatchCount]] = None
        self._counted: Optional[Tuple[int, BatchCount, float]] = None
        self._failure: Optional[str] = None

    def start(self, step: int, batch: BatchCount) -> None:
        """Tango's step ``step`` begins, with ``batch``: counted if it is the first."""
        if self._counted is not None or self._counter is not None or self._failure is not None:
            return
        counter = flop_counter()
        try:
            counter.__enter__()
        except Exception as error:  # noqa: BLE001 - throughput must never stop training
            self._failure = f"FlopCounterMode could not start: {error}"
            return
        self._counter, self._counting = counter, (step, batch)

    def stop(self, step: int) -> None:
        """Step ``step``'s backward passes are done: the counted step's count is complete."""
        counter, counting = self._counter, self._counting
        if counter is None or counting is None or counting[0] != step:
            return
        self._counter = None
        counter.__exit__(None, None, None)
        self._counted = (step, counting[1], float(counter.get_total_flops()))

    def flops(self, step: int, batch: BatchCount) -> Optional[float]:
        """The model FLOPs (forward and backward) of step ``step`` of ``batch``; None before a count."""
        if self._counted is None:
            return None
        counted_step, counted, flops = self._counted
        if counted_step == step:
            return flops
        if counted.tokens is not None and batch.tokens is not None and counted.tokens.positions:
            return flops * batch.tokens.positions / counted.tokens.positions
        if counted.samples:
            return flops * batch.samples / counted.samples
        return None

    def describe(self) -> str:
        """How the FLOPs are counted, for the metrics log's run line."""
        if self._counted is None:
            return self._failure or "not counted yet"
        step, batch, _ = self._counted
        return (
            f"FlopCounterMode: forward and backward of step {step + 1} as executed "
            "(activation recomputation included); other steps scaled by their "
            + ("sequence positions" if batch.tokens is not None else "samples")
        )

    def counted(self) -> Dict[str, Any]:
        """The counted step (1-based), its FLOPs and samples; empty before the count."""
        if self._counted is None:
            return {}
        step, batch, flops = self._counted
        return {"step": step + 1, "flops": flops, "samples": batch.samples}
