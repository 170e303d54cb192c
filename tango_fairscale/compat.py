"""
CPU support for FairScale's :class:`~fairscale.nn.FullyShardedDataParallel`.

FairScale's FSDP was written for CUDA only: it overlaps communication with compute on CUDA
streams (``torch.cuda.Stream``, ``torch.cuda.stream(...)``, ``Tensor.record_stream``) and
never checks whether CUDA is there. The collectives themselves are ordinary
``torch.distributed`` calls that the gloo backend implements, so the only thing standing
between FSDP and CPU workers is the stream bookkeeping, which on a CPU is meaningless: CPU
kernels run synchronously, in program order, so there is nothing to overlap or to wait for.

:func:`enable_cpu_fsdp` removes that obstacle with three scoped changes:

1. Inside FairScale's FSDP module only, the name ``torch`` is rebound to a stand-in whose
   ``cuda`` attribute answers the stream calls with no-op CPU streams. Every other attribute
   (and ``torch.cuda`` everywhere else in the process) is the real thing.
2. ``aten::record_stream`` gets a no-op kernel for CPU tensors (it has none). Recording a
   stream only tells the CUDA caching allocator not to reuse memory too early; CPU memory
   is not managed that way, so doing nothing is the exact meaning of the call on a CPU.
3. FairScale's own switch for its "base" collectives (``ENABLE_NCCL_BASE_COLLECTIVES=0``,
   read into a module flag at import) is turned off in its two modules, so that it all-gathers
   and reduce-scatters with the list forms. Gloo's single-tensor reduce-scatter wants the input
   shaped ``[world_size * n]`` where FairScale passes ``[world_size, n]``; the list forms
   carry the same data and are what gloo implements.

It is only ever called in processes whose FSDP instances compute on the CPU (Tango's CPU
workers), so a CUDA run keeps FairScale's code path byte for byte.
"""

import logging
import threading
import types
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_enabled = False
# Held for the life of the process: dropping the Library object would unregister the kernel.
_record_stream_library: Optional[torch.library.Library] = None


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


class _CudaStreamsOnCpu(types.ModuleType):
    """What FairScale's FSDP module sees as ``torch.cuda`` once CPU support is enabled."""

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


class _TorchWithCpuStreams(types.ModuleType):
    """What FairScale's FSDP module sees as ``torch`` once CPU support is enabled."""

    cuda = _CudaStreamsOnCpu("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _noop_record_stream(tensor: torch.Tensor, stream: Any) -> None:
    pass


def enable_cpu_fsdp() -> None:
    """
    Make FairScale's FSDP run with a CPU compute device over the gloo backend.
    Idempotent and thread-safe; see the module docstring for exactly what it changes.
    """
    global _enabled, _record_stream_library
    with _lock:
        if _enabled:
            return
        from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module

        fsdp_module.torch = _TorchWithCpuStreams("torch")  # type: ignore[attr-defined]
        _set_base_collectives(False)
        library = torch.library.Library("aten", "IMPL")
        library.impl("record_stream", _noop_record_stream, "CPU")
        _record_stream_library = library
        _enabled = True
        logger.debug("Enabled FairScale FSDP on CPU workers")


def disable_cpu_fsdp() -> None:
    """Undo :func:`enable_cpu_fsdp` (used by tests that check the CUDA path is untouched)."""
    global _enabled, _record_stream_library
    with _lock:
        if not _enabled:
            return
        from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module

        fsdp_module.torch = torch  # type: ignore[attr-defined]
        _set_base_collectives(_base_collectives_default)
        if _record_stream_library is not None:
            _record_stream_library._destroy()
            _record_stream_library = None
        _enabled = False


def cpu_fsdp_enabled() -> bool:
    """Whether :func:`enable_cpu_fsdp` is in effect in this process."""
    return _enabled


def _set_base_collectives(enabled: bool) -> None:
    from fairscale.internal import reduce_scatter_bucketer
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module

    fsdp_module.enable_nccl_base_collectives = enabled  # type: ignore[attr-defined]
    reduce_scatter_bucketer.enable_nccl_base_collectives = enabled  # type: ignore[attr-defined]


def _read_base_collectives_default() -> bool:
    from fairscale.internal import reduce_scatter_bucketer

    return bool(reduce_scatter_bucketer.enable_nccl_base_collectives)


_base_collectives_default = _read_base_collectives_default()


def fsdp_compute_device_is_cpu() -> bool:
    """
    Whether FSDP instances created now should compute on the CPU: true when CUDA is missing,
    or when the default process group runs on gloo (Tango's choice for CPU workers, also on
    machines that have fewer GPUs than ``device_count``).
    """
    if not torch.cuda.is_available():
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


# glibc's mallopt parameter for the mmap threshold (malloc.h).
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 1 << 20


def limit_cpu_heap_growth() -> bool:
    """
    Serve allocations of 1 MiB and more with their own memory mappings, returned to the system
    when freed. FSDP on CPU allocates and frees whole-unit buffers (gathered parameters, their
    gradients) every step; glibc's default raises its mmap threshold after the first such free,
    so later ones come from the heap, where they fragment and stay resident: measured on a
    124 M-parameter GPT-2, a worker's peak RSS went from 2.8 to 2.0 GiB with this. It is what
    ``MALLOC_MMAP_THRESHOLD_=1048576`` does, so a value set there is left alone. Linux/glibc only;
    returns whether the setting was applied.
    """
    import ctypes
    import os
    import sys

    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # not glibc
        return False
