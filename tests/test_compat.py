"""The CPU support changes FairScale's FSDP module only, and only while enabled."""

import torch
from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module

from tango_fairscale import compat


def test_enable_is_scoped_and_reversible() -> None:
    compat.disable_cpu_fsdp()
    assert fsdp_module.torch is torch
    real_cuda_stream = torch.cuda.Stream
    real_is_available = torch.cuda.is_available
    try:
        compat.enable_cpu_fsdp()
        compat.enable_cpu_fsdp()  # idempotent
        assert compat.cpu_fsdp_enabled()
        # FairScale's module sees CPU streams ...
        assert fsdp_module.torch.cuda.Stream is compat.NullStream
        assert fsdp_module.torch.cuda.is_available()
        assert fsdp_module.torch.zeros is torch.zeros
        # ... the rest of the process does not.
        assert torch.cuda.Stream is real_cuda_stream
        assert torch.cuda.is_available is real_is_available
        # record_stream is a no-op on CPU tensors.
        torch.zeros(2).record_stream(compat.NullStream())
    finally:
        compat.disable_cpu_fsdp()
    assert fsdp_module.torch is torch
    assert not compat.cpu_fsdp_enabled()


def test_stream_context_tracks_the_current_stream() -> None:
    streams = compat._CudaStreamsOnCpu("torch.cuda")
    side = streams.Stream()
    before = streams.current_stream()
    with streams.stream(side):
        assert streams.current_stream() is side
    assert streams.current_stream() is before


def test_heap_limit_respects_the_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sys

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    assert compat.limit_cpu_heap_growth() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert compat.limit_cpu_heap_growth() is sys.platform.startswith("linux")


def test_ring_takes_only_equal_contiguous_pieces() -> None:
    buffer = torch.arange(12.0)
    assert compat._ring_compatible(list(buffer.chunk(3)), torch.zeros(4), 3)
    # One piece per worker, no more and no fewer.
    assert not compat._ring_compatible(list(buffer.chunk(3)), torch.zeros(4), 2)
    # Rows of a partly used 2-D bucket are contiguous each, with gaps between them: fine.
    bucket = torch.zeros(2, 6)
    assert compat._ring_compatible(list(bucket[:, :4].unbind(0)), torch.zeros(4), 2)
    # Columns are strided; sizes or dtypes that differ from the single tensor are not taken.
    assert not compat._ring_compatible(list(bucket.unbind(1)), torch.zeros(2), 6)
    assert not compat._ring_compatible([buffer[:4], buffer[4:10]], torch.zeros(4), 2)
    assert not compat._ring_compatible(list(buffer.chunk(3)), torch.zeros(4, dtype=torch.float64), 3)
    assert not compat._ring_compatible(list(buffer.chunk(3)), torch.zeros(8)[::2], 3)


def test_overlaps() -> None:
    buffer = torch.arange(12.0)
    assert compat._overlaps(buffer[:4], buffer[3:6])
    assert not compat._overlaps(buffer[:4], buffer[4:8])
    assert not compat._overlaps(torch.zeros(3), torch.zeros(3))
