"""
Tango components for the benchmarks: random token data, a measuring callback, and the engines
and callback of the capacity benchmark (a per-worker memory budget), and the capacity benchmark's
model families beside the GPT-2 of ``examples/train_gpt2`` (``"gpt2::from_config"``): a wide
residual MLP (``"benchmark::residual_mlp"``) and a Llama (``"benchmark::llama"``).
"""

import json
import re
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from tango import Step
from tango.common.dataset_dict import DatasetDict
from tango.integrations.torch import Model, TorchTrainingEngine, TrainCallback, TrainingEngine

from benchmarks.common import state_bytes
from tango_fairscale.compiling import stats as compiling_stats
from tango_fairscale.cpu.timing import COLLECTIVES, NAMES, CollectiveTotals
from tango_fairscale.devices import worker_computes_on_cpu
from tango_fairscale.engine import FairScaleTrainingEngine


@Step.register("benchmark::random_tokens")
class RandomTokens(Step):
    """Random token sequences (language-model inputs and labels), generated from a seed."""

    DETERMINISTIC = True
    CACHEABLE = True

    def run(self, vocab_size: int, sequence_length: int, count: int, seed: int = 0) -> DatasetDict:  # type: ignore[override]
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(vocab_size, (count, sequence_length), generator=generator)
        return DatasetDict(splits={"train": [{"input_ids": t, "labels": t} for t in tokens]})


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _times_collectives(engine: TrainingEngine) -> bool:
    """
    Whether the engine's FSDP collectives go through the timed CPU rings
    (:mod:`tango_fairscale.cpu.timing`): the ``"fairscale"`` engine on CPU workers, either backend.
    DDP's all-reduces are not timed; on GPUs NCCL runs them asynchronously (wall time around them
    means nothing).
    """
    return isinstance(engine, FairScaleTrainingEngine) and worker_computes_on_cpu()


@TrainCallback.register("benchmark::measure")
class Measure(TrainCallback):
    """
    Per worker: model-state bytes (parameters, gradients, optimizer state held after a step),
    peak resident set size, and the time of each training step, wall and CPU (every thread of the
    worker: on shared cores, what it computed apart from what it waited); written to
    ``benchmark_worker{N}.json`` in the work directory at the end.
    """

    def __init__(self, *args: Any, warmup_steps: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.warmup_steps = warmup_steps
        self.step_times: List[float] = []
        self.cpu_times: List[float] = []
        self.last_start: Optional[float] = None
        self.last_cpu: Optional[float] = None
        self.state: Dict[str, int] = {}
        # Per optimizer step (one batch: all of its grad_accum micro-batches), in FSDP's
        # collectives: the seconds in all of them, and the seconds and calls of each of NAMES
        # (all-gather, reduce-scatter).
        self.collective_times: List[float] = []
        self.collective_times_by_name: Dict[str, List[float]] = {name: [] for name in NAMES}
        self.collective_calls_by_name: Dict[str, List[int]] = {name: [] for name in NAMES}
        self.timed = False
        self.mark: Optional[CollectiveTotals] = None

    def pre_train_loop(self) -> None:
        # The high-water mark after building the model and the engine, before any step.
        self.setup_peak = _peak_rss_bytes()
        self.timed = _times_collectives(self.training_engine)

    def pre_batch(self, step: int, epoch: int, batch: Any) -> None:
        # Once per optimizer step: ``batch`` holds the step's grad_accum micro-batches.
        if step == 1:
            self.first_step_peak = _peak_rss_bytes()
        now, cpu = time.perf_counter(), time.process_time()
        totals = COLLECTIVES.totals()
        if self.last_start is not None and self.last_cpu is not None:
            self.step_times.append(now - self.last_start)
            self.cpu_times.append(cpu - self.last_cpu)
            if self.timed and self.mark is not None:
                done = totals.since(self.mark)  # the step that just ended
                self.collective_times.append(done.total_seconds)
                for name in NAMES:
                    self.collective_times_by_name[name].append(done.seconds[name])
                    self.collective_calls_by_name[name].append(done.calls[name])
        self.last_start, self.last_cpu = now, cpu
        self.mark = totals
        if step > 0:  # after an optimizer step, all state exists
            self.state = state_bytes(self.training_engine)

    def _median_after_warmup(self, values: List[float]) -> Optional[float]:
        measured = values[self.warmup_steps :] or values
        return statistics.median(measured) if measured else None

    def post_train_loop(self, step: int, epoch: int) -> None:
        by_name = self.collective_times_by_name
        record = {
            "worker": self.train_config.worker_id,
            "world_size": self.train_config.world_size,
            "state_bytes": self.state,
            "state_bytes_total": sum(self.state.values()),
            "peak_rss_bytes": _peak_rss_bytes(),
            "peak_rss_after_setup_bytes": getattr(self, "setup_peak", None),
            "peak_rss_after_first_step_bytes": getattr(self, "first_step_peak", None),
            "step_time_s": self._median_after_warmup(self.step_times),
            "step_times_s": self.step_times,
            # CPU seconds of the worker's threads per step (median after the warm-up, then each).
            "cpu_time_s": self._median_after_warmup(self.cpu_times),
            "cpu_times_s": self.cpu_times,
            # Seconds per optimizer step spent in FSDP's all-gathers and reduce-scatters (CPU
            # workers of the "fairscale" engine, either backend; None otherwise): together, then each.
            "collectives_time_s": self._median_after_warmup(self.collective_times),
            "all_gather_time_s": self._median_after_warmup(by_name["all_gather"]),
            "reduce_scatter_time_s": self._median_after_warmup(by_name["reduce_scatter"]),
            # The calls of each, step by step (warm-up included; empty where not timed).
            "collective_calls_per_step": self.collective_calls_by_name,
            "parameters": sum(
                getattr(p, "_local_tensor", p).numel() for p in self.training_engine.model.parameters()
            ),
            # What compiling the units cost this worker (with_wrapped_modules.compile; zeros without).
            "compile": compiling_stats().as_dict(),
        }
        if torch.cuda.is_available() and self.train_config.device_type == "cuda":
            record["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
        path = Path(self.train_config.work_dir) / f"benchmark_worker{self.train_config.worker_id}.json"
        path.write_text(json.dumps(record))


# Per-worker memory budgets: benchmarks/capacity.py and examples/capacity.
#
# The budget is RLIMIT_DATA, set by the engine in each worker before the model is built. Since
# Linux 4.7 it caps a process's private writable mappings (heap, anonymous mmaps: every tensor,
# Python object and malloc arena in use), which is what training allocates, and leaves out the
# shared libraries and PROT_NONE reservations that make RLIMIT_AS useless for a PyTorch process
# (benchmarks/capacity.py --probe-limits measures both). An allocation past the budget fails with
# ENOMEM: PyTorch raises "DefaultCPUAllocator: can't allocate memory", Python MemoryError.

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_bytes(value: Union[int, str]) -> int:
    """``1536``, ``"1536MiB"``, ``"1.5 GiB"`` -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", value)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"Not a memory size: {value!r} (use bytes or e.g. '1536MiB', '1.5GiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _status_bytes(key: str) -> int:
    """A size from ``/proc/self/status``: VmData (what RLIMIT_DATA is checked against), VmPeak..."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    return 0


def _data_limit() -> Optional[int]:
    """This process's soft ``RLIMIT_DATA`` in bytes; ``None`` when there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    return None if soft == resource.RLIM_INFINITY else soft


def _vm_data_bytes() -> int:
    """The process's current private writable memory: what RLIMIT_DATA is checked against."""
    return _status_bytes("VmData")


def _status_fields(keys: Sequence[str]) -> Dict[str, int]:
    """Several sizes of ``/proc/self/status`` in bytes, read in one pass (0 for one it lacks)."""
    found = dict.fromkeys(keys, 0)
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(":", 1)[0]
            if key in found:
                found[key] = int(line.split()[1]) * 1024
    return found


class _PeakSampler:
    """
    Samples VmData every few milliseconds in a daemon thread: the kernel keeps a high-water mark
    for resident memory (ru_maxrss) but none for VmData, which the budget is about. Spikes
    shorter than the interval can be missed, so the figure is a lower bound of the true peak.
    RssAnon (private memory actually resident, which VmHWM mixes with mapped file pages) is
    sampled beside it.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self.peak_rss_anon = 0
        self.started = False

    def start(self) -> None:
        if self.started:
            return
        import threading

        self.started = True
        threading.Thread(target=self._run, name="vm-data-sampler", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._sample()
            time.sleep(self.interval_s)

    def _sample(self) -> None:
        now = _status_fields(("VmData", "RssAnon"))
        self.peak = max(self.peak, now["VmData"])
        self.peak_rss_anon = max(self.peak_rss_anon, now["RssAnon"])

    def reset(self) -> int:
        """The VmData peak so far (including now); starts a new one (of RssAnon's too)."""
        self._sample()
        peak = self.peak
        self.peak = self.peak_rss_anon = 0
        return peak


_SAMPLER = _PeakSampler()
#: What the limited engines recorded in this worker, for the ``benchmark::capacity_record`` callback.
_LIMIT_RECORD: Dict[str, Any] = {}


def limit_worker_memory(limit: Union[int, str, None]) -> Optional[int]:
    """
    Cap this process's RLIMIT_DATA at ``limit`` (soft limit only: the hard limit stays, so that
    :func:`lift_worker_memory_limit` can raise it again) and start sampling VmData.
    """
    _SAMPLER.start()
    # The runtime (Python, PyTorch, Tango, the data), before the model: part of the budget too.
    runtime = _status_fields(("VmData", "VmRSS", "RssAnon"))
    _LIMIT_RECORD["vm_data_at_limit_bytes"] = runtime["VmData"]
    _LIMIT_RECORD["rss_at_limit_bytes"] = runtime["VmRSS"]
    _LIMIT_RECORD["rss_anon_at_limit_bytes"] = runtime["RssAnon"]
    if limit is None:
        return None
    limit_bytes = parse_bytes(limit)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, hard))
    _LIMIT_RECORD["limit_bytes"] = limit_bytes
    return limit_bytes


def lift_worker_memory_limit() -> None:
    """
    Back to the hard limit, once training and its checkpoint are done: what comes after is
    Tango's consolidation of ``weights.pt`` on worker 0, outside the budget (see capacity.py).
    """
    _LIMIT_RECORD["peak_vm_data_training_bytes"] = _SAMPLER.reset()
    _LIMIT_RECORD["peak_rss_training_bytes"] = _peak_rss_bytes()
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))


def _write_consolidation_record(work_dir: Path, start: float) -> None:
    record = {
        "peak_vm_data_consolidation_bytes": _SAMPLER.reset(),
        "peak_rss_bytes": _peak_rss_bytes(),
        "seconds": time.monotonic() - start,
    }
    output_dir = Path(_LIMIT_RECORD.get("output_dir", work_dir))
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "capacity_consolidation.json").write_text(json.dumps(record))


def _limited_save_complete_weights(
    engine: TrainingEngine, save: Callable[[Path, Path], None], checkpoint_dir: Path, weights_path: Path
) -> None:
    lift_worker_memory_limit()
    start = time.monotonic()
    save(checkpoint_dir, weights_path)
    _write_consolidation_record(engine.train_config.work_dir, start)


@TrainingEngine.register("benchmark::torch_limited")
class LimitedTorchTrainingEngine(TorchTrainingEngine):
    """
    Tango's ``"torch"`` engine (DDP) in a worker whose memory is capped at ``memory_limit``
    (bytes, or e.g. ``"1536MiB"``) from before the model is built until the last checkpoint is
    written. Otherwise unchanged.
    """

    def __init__(self, *args: Any, memory_limit: Union[int, str, None] = None, **kwargs: Any) -> None:
        limit_worker_memory(memory_limit)
        super().__init__(*args, **kwargs)

    def save_complete_weights_from_checkpoint(self, checkpoint_dir: Path, weights_path: Path) -> None:
        _limited_save_complete_weights(
            self, super().save_complete_weights_from_checkpoint, checkpoint_dir, weights_path
        )


@TrainingEngine.register("benchmark::fairscale_limited")
class LimitedFairScaleTrainingEngine(FairScaleTrainingEngine):
    """
    This plugin's ``"fairscale"`` engine under a per-worker ``memory_limit``, as above; it also
    notes the worker's memory right before the model is built (the process group started).
    """

    def __init__(self, *args: Any, memory_limit: Union[int, str, None] = None, **kwargs: Any) -> None:
        limit_worker_memory(memory_limit)
        super().__init__(*args, **kwargs)

    def _construct_model(self, model: Any) -> Any:
        _LIMIT_RECORD["before_model"] = _status_fields(("VmData", "VmRSS", "RssAnon"))
        return super()._construct_model(model)

    def save_complete_weights_from_checkpoint(self, checkpoint_dir: Path, weights_path: Path) -> None:
        _limited_save_complete_weights(
            self, super().save_complete_weights_from_checkpoint, checkpoint_dir, weights_path
        )


@TrainCallback.register("benchmark::capacity_record")
class CapacityRecord(TrainCallback):
    """
    Per worker, after the last step: the training loss of every step, the memory figures of the
    budget (the sampled VmData peak, the resident peak) and the model's size; written to
    ``capacity_worker{N}.json`` in ``output_dir`` (default: the step's work directory).
    """

    def __init__(self, *args: Any, output_dir: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: List[float] = []
        # An uncached step's work directory is a temporary one, gone when the run ends.
        self.output_dir = Path(output_dir) if output_dir else Path(self.train_config.work_dir)
        _LIMIT_RECORD["output_dir"] = str(self.output_dir)

    def post_batch(
        self, step: int, epoch: int, batch_loss: float, batch_outputs: List[Dict[str, Any]]
    ) -> None:
        self.losses.append(float(batch_loss))

    def post_train_loop(self, step: int, epoch: int) -> None:
        model = self.training_engine.model
        record = {
            "worker": self.train_config.worker_id,
            "world_size": self.train_config.world_size,
            "losses": self.losses,
            # This worker's share (a shard under FSDP, everything under DDP).
            "local_parameters": sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters()),
            # The engine's memory_limit, else the limit the process was started under (ulimit -d).
            "limit_bytes": _LIMIT_RECORD.get("limit_bytes") or _data_limit(),
            "vm_data_at_limit_bytes": _LIMIT_RECORD.get("vm_data_at_limit_bytes"),
            # The high-water marks so far: the limit is still on (it is lifted after this).
            "peak_vm_data_bytes": max(_SAMPLER.peak, _vm_data_bytes()),
            "peak_rss_bytes": _peak_rss_bytes(),
            "vm_data_bytes": _vm_data_bytes(),
            # Parameters, gradients and optimizer state, counted tensor by tensor.
            "state_bytes": sum(state_bytes(self.training_engine).values()),
            # The peak virtual size, what RLIMIT_AS would have to allow: shared libraries and
            # address space reserved but never touched come on top of the real use.
            "peak_vm_size_bytes": _status_bytes("VmPeak"),
        }
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / f"capacity_worker{self.train_config.worker_id}.json").write_text(
            json.dumps(record)
        )


def _memory_so_far() -> Dict[str, int]:
    """This worker's memory now and its peaks since the limited engine started (see below)."""
    _SAMPLER._sample()
    now = _status_fields(("VmData", "VmRSS", "RssAnon", "RssFile", "VmHWM"))
    return {
        "vm_data_bytes": now["VmData"],
        "rss_bytes": now["VmRSS"],
        "rss_anon_bytes": now["RssAnon"],
        "rss_file_bytes": now["RssFile"],
        "peak_vm_data_bytes": _SAMPLER.peak,
        "peak_rss_anon_bytes": _SAMPLER.peak_rss_anon,
        # The kernel's own high-water mark of the resident set (file pages included), exact.
        "peak_rss_bytes": now["VmHWM"],
    }


@TrainCallback.register("benchmark::load_memory")
class LoadMemory(TrainCallback):
    """
    Per worker, for ``benchmarks/pretrained_memory.py``: the memory of a
    ``benchmark::fairscale_limited`` engine's worker (without a limit) when it started, and right
    before it built the model (the runtime); after the model is loaded and sharded and the engine
    built (``pre_train_loop``: the loading peaks); and after the last step (the run's peaks).
    Written to ``load_memory_worker{N}.json`` in ``output_dir``.
    """

    def __init__(self, *args: Any, output_dir: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.output_dir = Path(output_dir)
        self.loaded: Dict[str, int] = {}

    def pre_train_loop(self) -> None:
        self.loaded = _memory_so_far()

    def post_train_loop(self, step: int, epoch: int) -> None:
        model = self.training_engine.model
        before_model = _LIMIT_RECORD["before_model"]
        record = {
            "worker": self.train_config.worker_id,
            "world_size": self.train_config.world_size,
            # When the engine started, before the process group and the model.
            "engine_start": {
                "vm_data_bytes": _LIMIT_RECORD.get("vm_data_at_limit_bytes"),
                "rss_bytes": _LIMIT_RECORD.get("rss_at_limit_bytes"),
                "rss_anon_bytes": _LIMIT_RECORD.get("rss_anon_at_limit_bytes"),
            },
            # Right before the model is built: the runtime the model comes on top of.
            "runtime": {
                "vm_data_bytes": before_model["VmData"],
                "rss_bytes": before_model["VmRSS"],
                "rss_anon_bytes": before_model["RssAnon"],
            },
            "loaded": self.loaded,
            "run": _memory_so_far(),
            # This worker's share of the parameters (a shard under FSDP), in bytes.
            "local_parameter_bytes": sum(
                getattr(p, "_local_tensor", p).numel() * p.element_size() for p in model.parameters()
            ),
        }
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / f"load_memory_worker{self.train_config.worker_id}.json").write_text(
            json.dumps(record)
        )


# The capacity benchmark's model families beside GPT-2 (benchmarks/capacity.py --family): each a
# language model over random tokens (``benchmark::random_tokens``), so that every family trains
# on the same data step and loss, with a depth of identical blocks, one FSDP unit per block.


class ResidualMLPBlock(torch.nn.Module):
    """``x + W2 GELU(W1 LayerNorm(x))``, ``W1``: ``width`` -> 4 ``width``: a transformer's MLP alone."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(torch.nn.functional.gelu(self.up(self.norm(hidden))))


@Model.register("benchmark::residual_mlp")
class ResidualMLP(Model):
    """
    A wide MLP of ``depth`` residual blocks (:class:`ResidualMLPBlock`) between a token embedding
    and its tied output head, trained on next-token prediction: nearly all of its parameters are
    in the blocks, whose flat parameter is 8 ``width`` ^ 2 floats (32 MiB at width 1024), and its
    activations are a few MiB per block.
    """

    def __init__(self, vocab_size: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, width)
        # GPT-2's scale: with Embedding's default (1.0) the tied head's logits grow with the width.
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = torch.nn.ModuleList(ResidualMLPBlock(width) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        logits = self.head(self.norm(hidden))
        # Position t predicts token t + 1, as the GPT-2 family's loss.
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)
        )
        return {"loss": loss}


@Model.register("benchmark::llama")
class LlamaLanguageModel(Model):
    """
    ``transformers``' ``LlamaForCausalLM`` built from a ``LlamaConfig`` of these fields (RMSNorm,
    SiLU-gated MLP, rotary positions, grouped-query attention, the output head tied to the token
    embedding), randomly initialised; ``num_hidden_layers`` ``LlamaDecoderLayer`` blocks. No
    key-value cache: training never reads one.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        intermediate_size: int,
        num_hidden_layers: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        max_position_embeddings: int,
    ) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=True,
            use_cache=False,
        )
        self.llama = LlamaForCausalLM(config)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"loss": self.llama(input_ids=input_ids, labels=labels).loss}
