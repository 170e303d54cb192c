"""
A worker's peak FLOP/s, the denominator of MFU: a table of dense peaks by GPU and dtype
(:func:`gpu_peak`), a short matmul timed on this process's threads on CPU workers
(:func:`measure_cpu_peak`), one per host (:func:`host_cpu_peak`), or a peak given in a callback's
config (:func:`find_peak` picks).
"""

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

__all__ = [
    "GPU_PEAK_TFLOPS",
    "Peak",
    "dtype_name",
    "find_peak",
    "gpu_peak",
    "host_cpu_peak",
    "measure_cpu_peak",
]

#: Dense (no structured sparsity) peak TFLOP/s by GPU, from the vendors' data sheets: a fragment of
#: ``torch.cuda.get_device_name()`` and the peak per compute dtype (``"tf32"``: float32 matmuls on
#: tensor cores, when ``torch.backends.cuda.matmul.allow_tf32`` is on). The first fragment found in
#: the device's name wins, so the specific forms (``"H100 PCIe"``) come before the general ones.
#: NVIDIA publishes most figures "with sparsity": the dense peak is half of those.
#: The A10G (AWS's variant of the A10) has no NVIDIA data sheet: its figures are AWS's as
#: commonly reported (70 TFLOP/s half precision, 35 float32), about half the A10's tensor rate.
GPU_PEAK_TFLOPS: List[Tuple[str, Dict[str, float]]] = [
    ("H200 NVL", {"bfloat16": 835.5, "float16": 835.5, "tf32": 417.5, "float32": 60.0}),
    ("H200", {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 67.0}),
    ("H100 NVL", {"bfloat16": 835.5, "float16": 835.5, "tf32": 417.5, "float32": 60.0}),
    ("H100 PCIe", {"bfloat16": 756.5, "float16": 756.5, "tf32": 378.0, "float32": 51.2}),
    ("H100", {"bfloat16": 989.4, "float16": 989.4, "tf32": 494.7, "float32": 67.0}),  # SXM5
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "tf32": 156.0, "float32": 19.5}),  # SXM4 and PCIe
    ("L40S", {"bfloat16": 362.1, "float16": 362.1, "tf32": 183.2, "float32": 91.6}),
    ("L4", {"bfloat16": 121.0, "float16": 121.0, "tf32": 60.0, "float32": 30.3}),
    ("A10G", {"bfloat16": 70.0, "float16": 70.0, "tf32": 35.0, "float32": 35.0}),
    ("A10", {"bfloat16": 125.0, "float16": 125.0, "tf32": 62.5, "float32": 31.2}),
]


@dataclass(frozen=True)
class Peak:
    """A worker's peak FLOP/s for its compute dtype, and where the figure comes from."""

    flops_per_second: Optional[float]
    """None where it is not known: MFU is then left empty."""

    source: str
    """How it was found (the table row, the measurement), or why it is not known."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")


def gpu_peak(device_name: str, dtype: torch.dtype, tf32: bool = False) -> Peak:
    """
    The dense peak of the GPU named ``device_name`` for matmuls in ``dtype`` (float32 ones on
    tensor cores when ``tf32``), from :data:`GPU_PEAK_TFLOPS`; unknown GPUs and dtypes give a
    :class:`Peak` of ``None`` that says so.
    """
    key = "tf32" if dtype == torch.float32 and tf32 else dtype_name(dtype)
    for fragment, peaks in GPU_PEAK_TFLOPS:
        if fragment in device_name:
            if key not in peaks:
                return Peak(None, f"no {key} peak for {device_name} in the table: MFU left empty")
            return Peak(peaks[key] * 1e12, f"table: {fragment}, dense {key}, {peaks[key]:g} TFLOP/s")
    return Peak(
        None,
        f"{device_name} is not in the table of GPU peaks: MFU left empty "
        "(give the peak with the callback's peak_tflops)",
    )


def measure_cpu_peak(
    dtype: torch.dtype = torch.float32, seconds: float = 0.2, size: Optional[int] = None
) -> Peak:
    """
    The FLOP/s of a square matmul in ``dtype`` on this process's threads (``torch.get_num_threads()``):
    the best of the repetitions that fit in about ``seconds`` after one warm-up, so that a slow
    repetition (another process taking the core) does not lower it. ``size`` defaults to 1024
    (2.1 GFLOP a product), 512 for dtypes other than float32 and float64, which many CPUs
    compute far more slowly.
    """
    if size is None:
        size = _matmul_size(dtype)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: thread pool, kernels, caches
    flops = 2 * size**3
    best, repetitions = 0.0, 0
    # The deadline on the monotonic clock, bounded in repetitions too: a frozen perf_counter (as
    # tests make it) must not loop forever.
    deadline = time.monotonic() + seconds
    while repetitions < 3 or (time.monotonic() < deadline and repetitions < 200):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        elapsed = time.perf_counter() - start
        best = max(best, flops / elapsed) if elapsed > 0 else best
        repetitions += 1
    threads = torch.get_num_threads()
    if not best > 0:
        return Peak(None, "measured: no matmul took measurable time: MFU left empty")
    return Peak(
        best,
        f"measured: {size}x{size} {dtype_name(dtype)} matmul on {threads} thread(s), "
        f"best of {repetitions}, {best / 1e9:.1f} GFLOP/s",
    )


def host_cpu_peak(dtype: torch.dtype, workers_per_host: int) -> Peak:
    """
    One peak for each host's CPU workers, in a process group (every worker calls it at the same
    point): all workers measure at once, after a barrier, each on its own threads with every core
    busy as in training, and each host's workers take the best of their host's figures
    (:func:`measure_cpu_peak` keeps a worker's best repetition for the same reason: another process
    taking a core only lowers a figure). Measured by each worker whenever it got there, on a shared
    machine, two workers stepping at the same speed reported MFU 29.7 % and 61.2 %.
    """
    import torch.distributed as dist  # only CPU workers in a process group get here

    dist.barrier()
    own = measure_cpu_peak(dtype)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    figures = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(figures, torch.tensor([own.flops_per_second or 0.0], dtype=torch.float64))
    first = rank // workers_per_host * workers_per_host
    best = max(float(figure) for figure in figures[first : first + workers_per_host])
    if not best > 0:
        return own
    return Peak(
        best,
        f"measured: {_matmul_size(dtype)}x{_matmul_size(dtype)} {dtype_name(dtype)} matmul on "
        f"{torch.get_num_threads()} thread(s) by each of the host's {workers_per_host} worker(s) at "
        f"once, the host's best: {best / 1e9:.1f} GFLOP/s",
    )


def _matmul_size(dtype: torch.dtype) -> int:
    return 1024 if dtype in (torch.float32, torch.float64) else 512


def find_peak(
    device: torch.device, dtype: torch.dtype, given: Optional[float] = None, workers_per_host: int = 0
) -> Peak:
    """
    The peak of a worker computing in ``dtype`` on ``device``: ``given`` (FLOP/s) when a callback's
    config gives it, else :func:`gpu_peak` on GPUs and on CPU workers a measurement: one per host
    (:func:`host_cpu_peak`) for the workers of a process group with ``workers_per_host`` on each
    host, else this process's own (:func:`measure_cpu_peak`).
    """
    if given is not None:
        return Peak(given, f"given: {given / 1e12:g} TFLOP/s")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return gpu_peak(name, dtype, tf32=bool(torch.backends.cuda.matmul.allow_tf32))
    if device.type == "cpu":
        import torch.distributed as dist  # lazy, as above

        if (
            workers_per_host > 0
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            return host_cpu_peak(dtype, workers_per_host)
        return measure_cpu_peak(dtype)
    return Peak(None, f"no peak for {device.type} devices: MFU left empty")
