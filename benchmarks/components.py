"""
Tango components for the benchmarks: random token data, a measuring callback, and
PyTorch-native FSDP2 as a peer training engine. The model is the GPT-2 of
``examples/train_gpt2`` (``"gpt2::from_config"``).
"""

import json
import resource
import statistics
import time
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from tango import Step
from tango.common import Lazy
from tango.common.dataset_dict import DatasetDict
from tango.integrations.torch import Model, TorchTrainingEngine, TrainCallback, TrainingEngine

from benchmarks.common import state_bytes


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


class _TimedCollectives(types.ModuleType):
    """``torch.distributed`` as FairScale's modules see it, with its gathers and scatters timed."""

    TIMED = ("all_gather", "reduce_scatter")

    def __init__(self, inner: Any) -> None:
        super().__init__("torch.distributed")
        self.inner = inner
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name not in self.TIMED:
            return attribute

        def timed(*args: Any, _call: Callable[..., Any] = attribute, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def _time_fairscale_collectives() -> Optional[_TimedCollectives]:
    """
    Time FairScale's all-gathers and reduce-scatters on CPU workers, where they run
    synchronously (on GPUs they are asynchronous, so wall time around them means nothing).
    """
    from tango_fairscale import compat

    if not compat.cpu_fsdp_enabled():
        return None
    timed = _TimedCollectives(compat.current_collectives())
    # The same seam the CPU support uses, so that both FairScale modules see the timed calls.
    compat.set_collectives(timed)
    return timed


@TrainCallback.register("benchmark::measure")
class Measure(TrainCallback):
    """
    Per worker: model-state bytes (parameters, gradients, optimizer state held after a step),
    peak resident set size, and the time of each training step; written to
    ``benchmark_worker{N}.json`` in the work directory at the end.
    """

    def __init__(self, *args: Any, warmup_steps: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.warmup_steps = warmup_steps
        self.step_times: List[float] = []
        self.last_start: Optional[float] = None
        self.state: Dict[str, int] = {}
        self.collective_times: List[float] = []
        self.collectives: Optional[_TimedCollectives] = None

    def pre_train_loop(self) -> None:
        # The high-water mark after building the model and the engine, before any step.
        self.setup_peak = _peak_rss_bytes()
        self.collectives = _time_fairscale_collectives()

    def pre_batch(self, step: int, epoch: int, batch: Any) -> None:
        if step == 1:
            self.first_step_peak = _peak_rss_bytes()
        now = time.perf_counter()
        if self.last_start is not None:
            self.step_times.append(now - self.last_start)
            if self.collectives is not None:
                self.collective_times.append(self.collectives.seconds)
        self.last_start = now
        if self.collectives is not None:
            self.collectives.seconds = 0.0
        if step > 0:  # after an optimizer step, all state exists
            self.state = state_bytes(self.training_engine)

    def post_train_loop(self, step: int, epoch: int) -> None:
        measured = self.step_times[self.warmup_steps :] or self.step_times
        collectives = self.collective_times[self.warmup_steps :] or self.collective_times
        record = {
            "worker": self.train_config.worker_id,
            "world_size": self.train_config.world_size,
            "state_bytes": self.state,
            "state_bytes_total": sum(self.state.values()),
            "peak_rss_bytes": _peak_rss_bytes(),
            "peak_rss_after_setup_bytes": getattr(self, "setup_peak", None),
            "peak_rss_after_first_step_bytes": getattr(self, "first_step_peak", None),
            "step_time_s": statistics.median(measured) if measured else None,
            "step_times_s": self.step_times,
            # Seconds per step spent in FairScale's all-gathers and reduce-scatters (CPU only).
            "collectives_time_s": statistics.median(collectives) if collectives else None,
            "parameters": sum(
                getattr(p, "_local_tensor", p).numel() for p in self.training_engine.model.parameters()
            ),
        }
        if torch.cuda.is_available() and self.train_config.device_type == "cuda":
            record["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
        path = Path(self.train_config.work_dir) / f"benchmark_worker{self.train_config.worker_id}.json"
        path.write_text(json.dumps(record))


@TrainingEngine.register("benchmark::fsdp2")
class FSDP2TrainingEngine(TorchTrainingEngine):
    """
    PyTorch-native FSDP2 (``torch.distributed.fsdp.fully_shard``) as a Tango engine, for the
    benchmarks only: each module whose class is in ``wrap_module_classes`` is its own unit,
    then the root. Checkpoints keep only the trainer state (benchmarks never resume).
    """

    def __init__(
        self,
        *args: Any,
        wrap_module_classes: Optional[List[str]] = None,
        reshard_after_forward: bool = True,
        **kwargs: Any,
    ) -> None:
        self.wrap_module_classes = set(wrap_module_classes or [])
        self.reshard_after_forward = reshard_after_forward
        super().__init__(*args, **kwargs)

    def _construct_model(self, model: Union[Model, Lazy[Model]]) -> Model:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if isinstance(model, Lazy):
            model = model.construct()
        device = self.train_config.worker_local_default_device
        model.to(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for module in model.modules():
            if type(module).__name__ in self.wrap_module_classes:
                fully_shard(module, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        return model

    def save_checkpoint(self, checkpoint_dir: Path, client_state: Dict[str, Any]) -> None:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        torch.save(client_state, checkpoint_dir / f"worker{self.train_config.worker_id}_trainer.pt")
        dist.barrier()

    def save_complete_weights_from_checkpoint(self, checkpoint_dir: Path, weights_path: Path) -> None:
        torch.save({}, weights_path)
