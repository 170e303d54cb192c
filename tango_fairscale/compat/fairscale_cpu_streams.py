"""
CPU stand-ins for the CUDA stream API that FairScale's FSDP calls unconditionally.

CPU kernels run synchronously, in program order, so there is nothing to overlap or to wait
for: every synchronisation method here does nothing, which is the exact meaning of the call
on a CPU. :mod:`tango_fairscale.compat` shows these to FairScale's FSDP module only.
"""

import threading
import types
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch


class NullStream(torch.Stream):
    """
    A CPU stand-in for ``torch.cuda.Stream``. It is a real :class:`torch.Stream` (so that
    ``Tensor.record_stream`` accepts it) whose synchronisation methods do nothing, because
    CPU work is already ordered.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "NullStream":
        return super().__new__(cls, device="cpu")

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_default_stream = NullStream()
_current = threading.local()


def _current_stream(device: Any = None) -> NullStream:
    return getattr(_current, "stream", _default_stream)


@contextmanager
def _use_stream(stream: Optional[NullStream]) -> Iterator[None]:
    # FairScale asserts ``current_stream() == the stream it entered`` inside these blocks,
    # so the stand-in has to track the current stream, per thread, like CUDA does.
    previous = _current_stream()
    _current.stream = stream if stream is not None else previous
    try:
        yield
    finally:
        _current.stream = previous


def _synchronize(device: Any = None) -> None:
    pass


class CudaStreamsOnCpu(types.ModuleType):
    """What FairScale's FSDP module sees as ``torch.cuda`` on CPU workers."""

    Stream = NullStream
    current_stream = staticmethod(_current_stream)
    stream = staticmethod(_use_stream)
    synchronize = staticmethod(_synchronize)

    @staticmethod
    def is_available() -> bool:
        # FairScale only creates its streams (and its gradient reducer) when this is true.
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class TorchWithCpuStreams(types.ModuleType):
    """What FairScale's FSDP module sees as ``torch`` on CPU workers."""

    cuda = CudaStreamsOnCpu("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def noop_record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """
    ``aten::record_stream`` for CPU tensors. Recording a stream only tells the CUDA caching
    allocator not to reuse memory too early; CPU memory is not managed that way.
    """
