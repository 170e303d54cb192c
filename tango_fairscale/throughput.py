"""
Throughput as training runs are compared: tokens per second, model FLOPs per step, model FLOPs
utilisation (MFU) against the device's peak, and time in collectives.

- :func:`count_tokens`: the tokens of a micro-batch (``attention_mask`` or ``input_ids``);
- :func:`gpu_peak` (a table of dense peaks by GPU and dtype) and :func:`measure_cpu_peak` (a
  short matmul on this process's threads): a worker's peak FLOP/s, as a :class:`Peak`;
- :class:`WorkerMeter`: one per worker and training run, shared by the callbacks that report
  throughput (``fairscale::metrics``, ``fairscale::memory``, the loggers), which counts the model's
  FLOPs with :class:`torch.utils.flop_counter.FlopCounterMode` on the first step the run takes;
- :class:`Window` and :func:`combine`: one worker's figures over some steps, and the arithmetic
  that turns every worker's into the step's tokens/s, FLOP/s, MFU and time in collectives.
"""

import logging
import math
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from .cpu.timing import COLLECTIVES, CollectiveTotals

logger = logging.getLogger(__name__)

__all__ = [
    "GPU_PEAK_TFLOPS",
    "Peak",
    "StepWindow",
    "Window",
    "WorkerMeter",
    "combine",
    "count_tokens",
    "gpu_peak",
    "measure_cpu_peak",
    "meter_for",
    "mfu",
]

# --- peaks ------------------------------------------------------------------------------------------

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
        size = 1024 if dtype in (torch.float32, torch.float64) else 512
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


def mfu(flops_per_second: Optional[float], peak_flops_per_second: Optional[float]) -> Optional[float]:
    """Achieved model FLOP/s over the peak; None where either is unknown or the peak is not positive."""
    if flops_per_second is None or peak_flops_per_second is None or not peak_flops_per_second > 0:
        return None
    return flops_per_second / peak_flops_per_second


# --- tokens -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenCount:
    """The tokens of a micro-batch."""

    tokens: int
    """Tokens that count for tokens/s: non-padding ones where there is an attention mask."""

    positions: int
    """Sequence positions the model computes on, padding included (what its FLOPs scale with)."""

    source: str
    """``"attention_mask"`` or ``"input_ids"``."""


def count_tokens(micro_batch: Any) -> Optional[TokenCount]:
    """
    The tokens of a collated micro-batch of a sequence model: a dict with an ``attention_mask``
    (tokens: its non-zero entries; positions: its size) or ``input_ids`` (every entry is a token),
    of two or more dimensions (batch, sequence, ...). None for anything else: its throughput is
    reported in samples/s only.
    """
    if not isinstance(micro_batch, Mapping):
        return None
    mask = micro_batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() >= 2:
        return TokenCount(int(torch.count_nonzero(mask).item()), mask.numel(), "attention_mask")
    ids = micro_batch.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        return TokenCount(ids.numel(), ids.numel(), "input_ids")
    return None


def batch_size(micro_batch: Any) -> int:
    """The number of samples in a collated micro-batch: the first dimension of its first tensor."""
    if isinstance(micro_batch, torch.Tensor):
        return micro_batch.size(0) if micro_batch.dim() else 1
    if isinstance(micro_batch, Mapping):
        values: Iterable[Any] = micro_batch.values()
    elif isinstance(micro_batch, (list, tuple)):
        values = micro_batch
    else:
        return 0
    for value in values:
        size = batch_size(value)
        if size:
            return size
    return 0


# --- one worker's figures ----------------------------------------------------------------------------


@dataclass
class Window:
    """
    One worker's figures over consecutive training steps (those since the previous line of a
    log): what :func:`combine` turns into the step's throughput.
    """

    steps: int = 0
    samples: int = 0
    tokens: Optional[int] = None
    """None when the batches have no tokens (see :func:`count_tokens`)."""
    seconds: float = 0.0
    """Wall time of the steps: from the start of each to the start of the next."""
    flops: Optional[float] = None
    """Model FLOPs of the steps (forward and backward), None until they are counted."""
    peak_flops_per_second: Optional[float] = None
    collective_seconds: Optional[float] = None
    """Seconds in FSDP's all-gathers and reduce-scatters, None where they are not timed."""

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _total(values: Sequence[Optional[float]]) -> Optional[float]:
    """The sum, or None if any is None (a total that leaves out a worker would mislead)."""
    if not values or any(value is None for value in values):
        return None
    return float(sum(value for value in values if value is not None))


def combine(windows: Sequence[Window]) -> Dict[str, Optional[float]]:
    """
    The throughput of every worker's ``windows`` (one per worker, over the same steps):

    - ``step_time_s``: seconds per step of the slowest worker, which sets the pace;
    - ``tokens_per_step``: the tokens of one step, all workers together (None without tokens),
      and ``tokens_per_second`` = ``tokens_per_step / step_time_s``;
    - ``model_flops_per_step``: every worker's model FLOPs of one step, and
      ``model_flops_per_second`` = ``model_flops_per_step / step_time_s``;
    - ``mfu``: ``model_flops_per_second`` over the sum of the workers' peaks (None where a peak
      is unknown);
    - ``collective_time_s``: seconds per step in collectives, slowest worker (None where not timed).
    """
    steps = max((w.steps for w in windows), default=0)
    step_time = max((w.seconds / w.steps for w in windows if w.steps), default=0.0)

    def per_step(total: Optional[float]) -> Optional[float]:
        return total / steps if total is not None and steps else None

    def per_second(value: Optional[float]) -> Optional[float]:
        return value / step_time if value is not None and step_time > 0 else None

    tokens = per_step(_total([w.tokens for w in windows]))
    flops = per_step(_total([w.flops for w in windows]))
    collective = [
        w.collective_seconds / w.steps for w in windows if w.collective_seconds is not None and w.steps
    ]
    return {
        "step_time_s": step_time if step_time > 0 else None,
        "tokens_per_step": tokens,
        "tokens_per_second": per_second(tokens),
        "model_flops_per_step": flops,
        "model_flops_per_second": per_second(flops),
        "mfu": mfu(per_second(flops), _total([w.peak_flops_per_second for w in windows])),
        "collective_time_s": max(collective) if collective and len(collective) == len(windows) else None,
    }


def worker_figures(window: Window) -> Dict[str, Optional[float]]:
    """One worker's own tokens/s, samples/s, MFU and seconds per step in collectives."""
    seconds = window.seconds if window.seconds > 0 else None
    rate = lambda value: value / seconds if value is not None and seconds else None  # noqa: E731
    flops_per_second = rate(window.flops)
    return {
        "samples_per_second": rate(float(window.samples)),
        "tokens_per_second": rate(None if window.tokens is None else float(window.tokens)),
        "mfu": mfu(flops_per_second, window.peak_flops_per_second),
        "collective_time_s": (
            window.collective_seconds / window.steps
            if window.collective_seconds is not None and window.steps
            else None
        ),
    }


# --- the worker's meter ---------------------------------------------------------------------------------


@dataclass
class _StepCount:
    step: int
    samples: int
    tokens: Optional[TokenCount]


@dataclass
class MeterInfo:
    """What a worker's meter found out once per run: reported in the metrics log's ``run`` line."""

    device: str
    compute_dtype: str
    peak_flops_per_second: Optional[float]
    peak: str
    flops: str
    tokens: str
    collectives: str
    counted: Dict[str, Any] = field(default_factory=dict)


class WorkerMeter:
    """
    This worker's throughput figures for one training run, shared by every callback of the run
    that reports them (:func:`meter_for`): each calls :meth:`start_step` in ``pre_batch`` and
    :meth:`end_forward_backward` in ``post_batch``; the first call for a step does the work.

    - FLOPs: :class:`~torch.utils.flop_counter.FlopCounterMode` is active from the first
      ``start_step`` of the run to its ``end_forward_backward``, so it counts the forward and
      backward passes of that step's micro-batches as executed (the optimizer step is not model
      FLOPs). With activation checkpointing the recomputed forward passes are executed, so they
      are counted too. Other steps' FLOPs are that count scaled by their sequence positions (or
      samples) over the counted step's: the same for batches of one shape.
    - The peak: :func:`gpu_peak` on GPUs, :func:`measure_cpu_peak` on CPU workers, once, in the
      worker's compute dtype (the AMP dtype, else the mixed-precision compute dtype, else the
      parameters'), unless ``peak_flops_per_second`` is given.
    - Time in collectives: :data:`~tango_fairscale.cpu.timing.COLLECTIVES` (CPU workers only).
    """

    def __init__(self, train_config: Any, training_engine: Any) -> None:
        self.train_config = train_config
        self.training_engine = training_engine
        self._lock = threading.Lock()
        self._peak: Optional[Peak] = None
        self._override: Optional[float] = None
        self._current: Optional[_StepCount] = None
        self._counter: Optional[FlopCounterMode] = None
        self._counted: Optional[Tuple[_StepCount, float]] = None
        self._count_failed: Optional[str] = None
        self._token_source: Optional[str] = None

    # --- per step -----------------------------------------------------------------------------------

    def start_step(self, step: int, batch: Sequence[Any]) -> None:
        """Counts the step's samples and tokens; on the run's first step, starts counting FLOPs."""
        with self._lock:
            if self._current is not None and self._current.step == step:
                return
            counts = [count_tokens(micro_batch) for micro_batch in batch]
            tokens: Optional[TokenCount] = None
            if counts and all(count is not None for count in counts):
                tokens = TokenCount(
                    sum(c.tokens for c in counts if c is not None),
                    sum(c.positions for c in counts if c is not None),
                    counts[0].source if counts[0] is not None else "",
                )
                self._token_source = tokens.source
            self._current = _StepCount(step, sum(batch_size(micro_batch) for micro_batch in batch), tokens)
            if self._counted is None and self._counter is None and self._count_failed is None:
                counter = FlopCounterMode(display=False)
                try:
                    counter.__enter__()
                except Exception as error:  # noqa: BLE001 - throughput must never stop training
                    self._count_failed = f"FlopCounterMode could not start: {error}"
                else:
                    self._counter = counter

    def end_forward_backward(self, step: int) -> None:
        """After the step's backward passes: stops the FLOP counter of the counted step."""
        with self._lock:
            counter, current = self._counter, self._current
            if counter is None or current is None or current.step != step:
                return
            self._counter = None
            counter.__exit__(None, None, None)
            self._counted = (current, float(counter.get_total_flops()))

    def step_samples(self) -> int:
        return self._current.samples if self._current is not None else 0

    def step_tokens(self) -> Optional[int]:
        """The current step's tokens, None when its batches have none."""
        current = self._current
        return current.tokens.tokens if current is not None and current.tokens is not None else None

    def step_flops(self) -> Optional[float]:
        """The current step's model FLOPs (forward and backward), None before any step was counted."""
        if self._counted is None or self._current is None:
            return None
        counted, flops = self._counted
        current = self._current
        if counted.step == current.step:
            return flops
        if counted.tokens is not None and current.tokens is not None and counted.tokens.positions:
            return flops * current.tokens.positions / counted.tokens.positions
        if counted.samples:
            return flops * current.samples / counted.samples
        return None

    # --- once per run -------------------------------------------------------------------------------

    def set_peak(self, peak_flops_per_second: Optional[float]) -> None:
        """A peak given in a callback's config: used instead of the table or a measurement."""
        if peak_flops_per_second is not None:
            self._override = peak_flops_per_second

    @property
    def device(self) -> torch.device:
        return torch.device(self.train_config.worker_local_default_device)

    def compute_dtype(self) -> torch.dtype:
        """The dtype the worker's matmuls run in: AMP's, else FSDP's mixed precision, else the parameters'."""
        engine = self.training_engine
        if getattr(engine, "amp", False) and isinstance(getattr(engine, "amp_dtype", None), torch.dtype):
            return engine.amp_dtype
        fsdp_config = getattr(engine, "fsdp_config", None)
        if fsdp_config is not None and getattr(fsdp_config, "mixed_precision", False):
            return fsdp_config.resolved_compute_dtype(self.device.type == "cpu")
        model = getattr(engine, "model", None)
        if isinstance(model, torch.nn.Module):
            for parameter in model.parameters():
                if parameter.is_floating_point():
                    return parameter.dtype
        return torch.float32

    def peak(self) -> Peak:
        """This worker's peak FLOP/s (measured on the first call on a CPU worker)."""
        with self._lock:
            if self._peak is None:
                self._peak = self._find_peak()
            return self._peak

    def _find_peak(self) -> Peak:
        if self._override is not None:
            return Peak(self._override, f"given: {self._override / 1e12:g} TFLOP/s")
        dtype = self.compute_dtype()
        device = self.device
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            return gpu_peak(name, dtype, tf32=bool(torch.backends.cuda.matmul.allow_tf32))
        if device.type == "cpu":
            return measure_cpu_peak(dtype)
        return Peak(None, f"no peak for {device.type} devices: MFU left empty")

    def collectives(self) -> CollectiveTotals:
        """The process's totals of timed collectives (subtract two for an interval)."""
        return COLLECTIVES.totals()

    def collectives_timed(self) -> bool:
        """
        Whether this worker's FSDP collectives go through the timed rings: CPU workers of the
        ``"fairscale"`` engine, either backend (not DDP's all-reduces, not NCCL on GPUs).
        """
        from .engine import FairScaleTrainingEngine  # not at import: the engine imports this module's users

        return self.device.type == "cpu" and isinstance(self.training_engine, FairScaleTrainingEngine)

    def info(self) -> MeterInfo:
        """What the run line of the metrics log says about this worker's figures."""
        peak = self.peak()
        counted = self._counted
        if counted is not None:
            flops = (
                f"FlopCounterMode: forward and backward of step {counted[0].step + 1} as executed "
                "(activation recomputation included); other steps scaled by their "
                + ("sequence positions" if counted[0].tokens is not None else "samples")
            )
        else:
            flops = self._count_failed or "not counted yet"
        if self._token_source == "attention_mask":
            tokens = "attention_mask: its non-zero entries"
        elif self._token_source == "input_ids":
            tokens = "input_ids: every entry"
        else:
            tokens = "none: the batches have no input_ids or attention_mask, so throughput is samples/s only"
        if self.collectives_timed():
            collectives = (
                "wall time in FSDP's all-gathers and reduce-scatters (gloo rings), waiting for the "
                "other workers included"
            )
        elif self.device.type == "cuda":
            collectives = (
                "not measured on GPUs: NCCL runs them asynchronously on its own streams "
                "(see fairscale::profile for their kernels)"
            )
        else:
            collectives = "not measured: this engine's collectives do not go through the timed rings"
        info = MeterInfo(
            device=str(self.device),
            compute_dtype=dtype_name(self.compute_dtype()),
            peak_flops_per_second=peak.flops_per_second,
            peak=peak.source,
            flops=flops,
            tokens=tokens,
            collectives=collectives,
        )
        if counted is not None:
            info.counted = {"step": counted[0].step + 1, "flops": counted[1], "samples": counted[0].samples}
        return info


class StepWindow:
    """
    One callback's running window of this worker's figures over the steps since it last closed
    it (a line of the metrics log, a row of a logger): the callback's own clock and counts, the
    worker's shared :class:`WorkerMeter` for tokens, FLOPs, the peak and the collectives. The clock
    runs from the start of a step to the start of the next; :meth:`pause` stops it for a
    validation loop (whose time and collectives are not the training steps').
    """

    def __init__(self, meter: WorkerMeter) -> None:
        self.meter = meter
        self._window = Window()
        self._seconds = 0.0  # time of the window's steps, the running clock aside
        self._clock: Optional[float] = None  # perf_counter() when the running clock started
        self._mark: Optional[CollectiveTotals] = None  # the collectives' totals then
        self._flops_known = True  # every step of the window had its FLOPs

    def start_step(self, step: int, batch: Sequence[Any]) -> None:
        """In ``pre_batch``: the step's samples and tokens (and the clock, if stopped)."""
        if self._clock is None:
            self._clock = time.perf_counter()
            self._mark = self.meter.collectives()
        self.meter.start_step(step, batch)
        window = self._window
        window.steps += 1
        window.samples += self.meter.step_samples()
        tokens = self.meter.step_tokens()
        window.tokens = None if tokens is None else (window.tokens or 0) + tokens

    def end_forward_backward(self, step: int) -> None:
        """In ``post_batch``: the step's model FLOPs."""
        self.meter.end_forward_backward(step)
        flops = self.meter.step_flops()
        if flops is None:
            self._flops_known = False
        else:
            self._window.flops = (self._window.flops or 0.0) + flops

    def pause(self) -> None:
        """Stop the clock (a validation loop begins)."""
        if self._clock is not None:
            self._seconds += time.perf_counter() - self._clock
            self._clock = None
            self._add_collectives(self._window)

    def close(self) -> Window:
        """The window's figures; a new window starts now."""
        now = time.perf_counter()
        window, self._window = self._window, Window()
        window.seconds = self._seconds + (now - self._clock if self._clock is not None else 0.0)
        self._add_collectives(window)
        if not self._flops_known:
            window.flops = None
        window.peak_flops_per_second = self.meter.peak().flops_per_second
        if not self.meter.collectives_timed():
            window.collective_seconds = None
        self._seconds, self._flops_known = 0.0, True
        if self._clock is not None:
            self._clock = now
            self._mark = self.meter.collectives()
        return window

    def _add_collectives(self, window: Window) -> None:
        if self._mark is None:
            return
        seconds = self.meter.collectives().since(self._mark).total_seconds
        window.collective_seconds = (window.collective_seconds or 0.0) + seconds
        self._mark = None


#: id(train_config) -> (a weak reference to it, its meter). TrainConfig is an unhashable
#: dataclass, so it cannot key a WeakKeyDictionary; the weak reference tells a reused id apart.
_meters: Dict[int, Tuple["weakref.ref[Any]", WorkerMeter]] = {}
_meters_lock = threading.Lock()


def meter_for(train_config: Any, training_engine: Any) -> WorkerMeter:
    """
    The :class:`WorkerMeter` of this training run in this worker, one per ``train_config``
    (Tango gives every callback of a run the same one), so that callbacks share one FLOP count
    and one peak measurement.
    """
    with _meters_lock:
        for key in [key for key, (ref, _) in _meters.items() if ref() is None]:
            del _meters[key]
        entry = _meters.get(id(train_config))
        if entry is not None and entry[0]() is train_config and entry[1].training_engine is training_engine:
            return entry[1]
        meter = WorkerMeter(train_config, training_engine)
        _meters[id(train_config)] = (weakref.ref(train_config), meter)
        return meter


def finite_or_none(value: Optional[float]) -> Optional[float]:
    """``value`` unless it is None, NaN or infinite."""
    return value if value is not None and math.isfinite(value) else None
