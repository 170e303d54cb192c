"""
``python -m tango_fairscale plan``: the wrap plan, and its estimates against real 2-worker
trainings (in the test's own workers, :mod:`tests.harness`): the model state, and the peak of a
training step, measured as the CPU allocator counts tensors (``torch.profiler``'s memory events)
and as the worker's resident memory grows.
"""

import contextlib
import ctypes
import gc
import json
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from tango.common import Lazy, Params
from tango.integrations.torch import Model, TrainingEngine
from tango.integrations.torch.util import set_seed_all

from tango_fairscale.plan import make_plan, parse_memory, render
from tests import harness
from tests.helpers import peak_allocated_bytes, tango_env, train_config


def run_plan(config: Dict[str, Any], tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "tango_fairscale", "plan", str(config_path)]
    command += ["-i", "examples.toy.components", *extra]
    return subprocess.run(command, cwd=tmp_path, env=tango_env(), capture_output=True, text=True, check=False)


def plan(config: Dict[str, Any], tmp_path: Path, *extra: str) -> Dict[str, Any]:
    result = run_plan(config, tmp_path, "--json", str(tmp_path / "plan.json"), *extra)
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    return {"text": result.stdout, **json.loads((tmp_path / "plan.json").read_text())}


def test_plan_tree_and_estimates(tmp_path: Path) -> None:
    result = plan(train_config(wrap="nested_ckpt"), tmp_path, "--world-size", "4")
    names: List[str] = [unit["name"] for unit in result["units"]]
    assert names == ["", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert all(unit["checkpointed"] for unit in result["units"][1:])
    # 8*32+32 (input) + 32+1 (head) in the root; 32*32+32 per block.
    assert [unit["parameters"] for unit in result["units"]] == [321, 1056, 1056, 1056, 1056]
    assert [unit["shard_parameters"] for unit in result["units"]] == [81, 264, 264, 264, 264]
    assert result["parameters"] == 321 + 4 * 1056
    assert result["world_size"] == 4
    assert "built on the meta device" in result["text"]
    (built,) = [line for line in result["text"].splitlines() if line.startswith("Built on the meta device:")]
    assert "allocated no memory for the model" in built and "init_on_meta: false" in built
    assert "└── blocks.3 (FeedForward)" in result["text"]
    ddp = result["ddp_bytes_per_worker"]["total"]
    assert ddp == result["parameters"] * 4 * (1 + 1 + 2)  # fp32 params, grads, AdamW's 2 moments
    assert result["bytes_per_worker"]["total"] / ddp == pytest.approx(0.25, abs=0.01)


def test_plan_without_fsdp_units_is_root_only(tmp_path: Path) -> None:
    result = plan(train_config(wrap="root"), tmp_path)
    assert [unit["name"] for unit in result["units"]] == [""]
    assert result["world_size"] == 2  # the step's device_count


def test_plan_errors_name_the_problem(tmp_path: Path) -> None:
    config = train_config(wrap="nested")
    config["steps"]["train"]["model"]["modules_to_wrap"] = ["nope"]
    result = run_plan(config, tmp_path)
    assert result.returncode == 2
    assert "'nope' matches no submodule of ToyRegressor" in result.stderr


def test_plan_refuses_a_tie_split_across_units_as_tango_run_does(tmp_path: Path) -> None:
    config = train_config(wrap="nested", model={"type": "test::tied_lm"})
    config["steps"]["train"]["model"]["modules_to_wrap"] = ["embed", "blocks\\.[0-9]+"]
    result = run_plan(config, tmp_path, "-i", "tests.components")
    assert result.returncode == 2, result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert "would be split across FSDP units" in line and "embed.weight in FSDP unit 'embed'" in line, line


def test_plan_of_a_ddp_step_says_nothing_is_sharded(tmp_path: Path) -> None:
    result = plan(train_config(engine="torch", wrap="none"), tmp_path)
    assert [unit["shard_parameters"] for unit in result["units"]] == [
        unit["parameters"] for unit in result["units"]
    ]
    assert result["bytes_per_worker"]["total"] == result["ddp_bytes_per_worker"]["total"]
    assert 'The training engine "torch" does not shard' in result["text"]


def test_plan_of_a_model_whose_constructor_raises_is_one_line(tmp_path: Path) -> None:
    config = train_config(wrap="root")
    config["steps"]["train"]["model"] = {"type": "test::raises_in_constructor"}
    result = run_plan(config, tmp_path, "-i", "tests.components")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: model: building 'test::raises_in_constructor' raised ValueError: checkpoint file "
        "/nowhere/model.bin not found"
    ], result.stderr


def test_estimate_matches_a_real_two_worker_run(tmp_path: Path) -> None:
    config = train_config(wrap="nested_ckpt", train_steps=4, checkpoint_every=4)
    estimate = plan(config, tmp_path / "plan")
    work_dir = tmp_path / "work"
    harness.train(config, work_dir)
    for path in sorted(work_dir.glob("state_sizes_worker*.json")):
        measured = json.loads(path.read_text())
        measured_total = measured["param_bytes"] + measured["grad_bytes"] + measured["optimizer_bytes"]
        estimated_total = estimate["bytes_per_worker"]["total"]
        print(f"worker {measured['worker']}: measured {measured_total} B, estimated {estimated_total} B")
        assert abs(estimated_total - measured_total) <= 0.10 * measured_total


# --- the peak of a training step -------------------------------------------------------------------


@Model.register("test::plan_llama", exist_ok=True)
class PlanLlama(Model):
    """A ``LlamaForCausalLM`` built from config numbers (grouped-query attention, SwiGLU, RMSNorm)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        layers: int,
        heads: int,
        kv_heads: int,
        vocab: int,
        positions: int,
    ) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            vocab_size=vocab,
            max_position_embeddings=positions,
        )
        self.llama = LlamaForCausalLM(config)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"loss": self.llama(input_ids=input_ids, labels=labels).loss}


@dataclass
class PeakCase:
    """A training config whose peak is estimated by ``plan`` and measured in a 2-worker training."""

    name: str
    experiment: Dict[str, Any]
    #: The batches the workers train on: what the config's data would give each worker.
    batches: List[Dict[str, torch.Tensor]]
    #: ``plan``'s --sequence-length; ``None``: --sample-data (the toy's data step is cheap).
    sequence_length: Optional[int]

    def plan(self) -> Any:
        train = self.experiment["steps"]["train"]
        return make_plan(
            "train",
            train,
            steps=self.experiment["steps"],
            sequence_length=self.sequence_length,
            sample_data=self.sequence_length is None,
            device="cpu",
        )


def peak_cases(large: bool) -> List[PeakCase]:
    """
    The toy regressor (4 or 6 blocks), a GPT-2 and a Llama (with and without activation
    checkpointing), each block its own FSDP unit, AdamW: small for the default suite, larger for
    the comparison with resident memory (docs/plan.md), where the runtime's own growth is small
    beside the tensors.
    """
    generator = torch.Generator().manual_seed(0)
    width, blocks, examples = (1536, 6, 512) if large else (256, 4, 64)
    toy = train_config(
        wrap="nested",
        model={"type": "toy::regressor", "in_features": 8, "width": width, "num_blocks": blocks},
    )
    toy["steps"]["data"]["train_size"] = 2 * examples
    toy["steps"]["train"]["train_dataloader"]["batch_size"] = examples
    toy_batches = [
        {"x": torch.randn(examples, 8, generator=generator), "y": torch.randn(examples, generator=generator)}
        for _ in range(2)
    ]
    batch, length, vocab = (8, 128, 8192) if large else (16, 128, 2048)
    width, layers = (384, 4) if large else (256, 2)
    tokens = [torch.randint(0, vocab, (batch, length), generator=generator) for _ in range(2)]
    lm_batches = [{"input_ids": ids, "labels": ids} for ids in tokens]
    gpt2 = {
        "type": "test::hf_gpt2",
        "n_layer": layers,
        "n_embd": width,
        "n_head": width // 64,
        "vocab_size": vocab,
        "n_positions": length,
    }
    llama = {
        "type": "test::plan_llama",
        "hidden": width,
        "intermediate": width * 8 // 3,
        "layers": layers,
        "heads": width // 64,
        "kv_heads": 2,
        "vocab": vocab,
        "positions": length,
    }

    def lm(model: Dict[str, Any], blocks: str, checkpointing: bool) -> Dict[str, Any]:
        config = train_config(wrap="nested_ckpt" if checkpointing else "nested", model=model)
        config["steps"]["train"]["model"]["modules_to_wrap"] = [blocks]
        config["steps"]["train"]["train_dataloader"]["batch_size"] = batch
        return config

    return [
        PeakCase("toy regressor", toy, toy_batches, None),
        PeakCase("GPT-2", lm(gpt2, "gpt2\\.transformer\\.h\\.[0-9]+", False), lm_batches, length),
        PeakCase("Llama", lm(llama, "llama\\.model\\.layers\\.[0-9]+", False), lm_batches, length),
        PeakCase(
            "Llama, checkpointed", lm(llama, "llama\\.model\\.layers\\.[0-9]+", True), lm_batches, length
        ),
    ]


def _status(key: str) -> int:
    """A field of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _settle() -> None:
    """Garbage and the heap's free pages given back, so that what follows starts from what is live."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure_peak(
    worker: harness.Worker, case: PeakCase, work_dir: Path, profiled: bool, steps: int = 2
) -> int:
    """
    One worker's peak in ``steps`` training steps of ``case`` (the engine built as Tango's loop
    builds it, then ``forward_train``, ``backward`` and ``step`` as the loop calls them), above what
    the process held before the model was built, so that the runtime (interpreter, libraries, the
    test's own objects) is left out, as the plan leaves it out:

    - ``profiled``: tensors, as the CPU allocator counts them (``torch.profiler``'s memory events,
      every allocation and free of the process's main thread, kernels' workspaces included): the
      most bytes alive at once during the training steps (the build's own peak left out);
    - else the resident memory (``VmHWM`` reset after the build, minus ``VmRSS`` before it), with
      what the allocator keeps beyond live tensors.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    harness._close_process_group()
    _settle()
    before = _status("VmRSS")
    train = case.experiment["steps"]["train"]
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with profiler if profiled else contextlib.nullcontext():
        config = worker.train_config(case.experiment, work_dir)
        set_seed_all(config.seed)
        engine = Lazy(TrainingEngine, Params(dict(train["training_engine"]))).construct(
            train_config=config, model=Lazy(Model, Params(dict(train["model"])))
        )
        _settle()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
        accum = int(train.get("grad_accum", 1))
        for index in range(steps):
            with record_function("train_step"):
                for micro in range(accum):
                    batch = case.batches[(index * accum + micro) % len(case.batches)]
                    loss, _ = engine.forward_train(batch, micro, accum)
                    engine.backward(loss)
                engine.step()
    resident = _status("VmHWM") - before
    del engine
    if not profiled:
        return resident
    events = profiler.profiler.kineto_results.events()
    steps_at = [(e.start_ns(), e.end_ns()) for e in events if e.name() == "train_step"]
    return peak_allocated_bytes(profiler, within=steps_at)


def compare_peaks(
    cases: List[PeakCase], tmp_path: Path, resident: bool
) -> List[Tuple[str, int, List[int], List[int]]]:
    """Each case's estimate, and each worker's measured tensor peak (and resident peak, with ``resident``)."""
    jobs = []
    for case in cases:
        jobs.append(harness.Call(measure_peak, (case, tmp_path / case.name, True)))
        if resident:
            jobs.append(harness.Call(measure_peak, (case, tmp_path / case.name, False)))
    results = iter(harness.run(jobs, 2, out=tmp_path / "harness", timeout=900))
    rows = []
    for case in cases:
        tensors = next(results).check(exited=False).values
        rss = next(results).check(exited=False).values if resident else []
        estimate = case.plan().peak()
        rows.append((case.name, estimate, tensors, rss))
        measured = ", ".join(f"{t / 2**20:.1f}" for t in tensors)
        print(f"{case.name}: estimate {estimate / 2**20:.1f} MiB, tensors per worker {measured} MiB", end="")
        print(f", resident {', '.join(f'{r / 2**20:.1f}' for r in rss)} MiB" if rss else "")
    return rows


def test_peak_estimate_matches_the_tensors_of_a_real_two_worker_run(tmp_path: Path) -> None:
    # Measured as the allocator counts them (what the plan estimates, and what CUDA's
    # max_memory_allocated reports on GPUs): 1 to 4 % apart here, where 25 % was asked for.
    for name, estimate, tensors, _ in compare_peaks(peak_cases(large=False), tmp_path, resident=False):
        for measured in tensors:
            assert abs(estimate - measured) <= 0.10 * measured, (name, estimate, measured)


@pytest.mark.extended
def test_peak_estimate_against_resident_memory(tmp_path: Path) -> None:
    """
    docs/plan.md's table: larger models, the workers first warmed up on the small ones (so that
    the libraries' pages a first training touches are not counted), the tensors within 10 %, and
    the resident memory at least the estimate.
    """
    warm_up = [harness.Call(measure_peak, (case, tmp_path / "warm", False, 1)) for case in peak_cases(False)]
    for result in harness.run(warm_up, 2, out=tmp_path / "warm-harness", timeout=900):
        result.check(exited=False)
    for name, estimate, tensors, rss in compare_peaks(peak_cases(large=True), tmp_path, resident=True):
        for measured in tensors:
            assert abs(estimate - measured) <= 0.10 * measured, (name, estimate, measured)
        for measured in rss:
            assert measured >= 0.9 * estimate, (name, estimate, measured)


# --- the verdict, the optimizer, frozen parameters ----------------------------------------------------


def activation_heavy_toy() -> Dict[str, Any]:
    """The toy with a large batch and no reduce-scatter bucket: activations are most of its peak."""
    config = train_config(wrap="nested", fsdp_config={"bucket_cap_mb": 0})
    config["steps"]["train"]["train_dataloader"]["batch_size"] = 4096
    # Enough examples for a full batch on each of the 2 workers: the run's pre-flight (which plan
    # runs) refuses fewer.
    config["steps"]["data"]["train_size"] = 2 * 4096
    return config


def planned(config: Dict[str, Any], **options: Any) -> Dict[str, Any]:
    """``plan``'s JSON and text of ``config``'s training step, made in this process."""
    result = make_plan("train", config["steps"]["train"], steps=config["steps"], device="cpu", **options)
    return {"text": render(result), **result.as_dict()}


def test_plan_says_whether_the_step_fits_and_what_to_change(tmp_path: Path) -> None:
    # Through the command line once: its options reach the plan.
    fits = plan(
        activation_heavy_toy(), tmp_path, "--sample-data", "--device-memory", "1GiB", "--device", "cpu"
    )
    parts = fits["peak_bytes_per_worker"]
    total = parts["total"]
    assert total == sum(value for key, value in parts.items() if key not in ("total", "phase"))
    assert parts["activations"] > parts["parameters"] + parts["optimizer_state"]
    assert fits["batch"]["batch_size"] == 4096 and fits["batch"]["tensors"]["x"]["shape"] == [4096, 8]
    assert fits["device_memory"] == {
        "bytes": 2**30,
        "fits": True,
        "headroom": 2**30 - total,
        "suggestions": [],
    }
    assert "Against 1.0 GiB per device: fits" in fits["text"]

    memory = total * 3 // 4
    over = planned(activation_heavy_toy(), sample_data=True, device_memory=memory)
    assert over["peak_bytes_per_worker"]["total"] == total
    assert over["device_memory"]["fits"] is False and over["device_memory"]["headroom"] == memory - total
    suggestions = over["device_memory"]["suggestions"]
    assert "does not fit" in over["text"] and all(f"  - {line}" in over["text"] for line in suggestions)
    # Each suggestion is judged by the estimate: checkpointing the blocks, or fewer examples at a time.
    (checkpointing,) = [line for line in suggestions if line.startswith("activation_checkpointing")]
    with_ckpt = over["step_peak"]["with_checkpointing"]
    assert with_ckpt["activations_alone"] < over["step_peak"]["without_checkpointing"]["activations_alone"]
    (smaller,) = [line for line in suggestions if line.startswith("train_dataloader.batch_size")]
    size, accum = (int(word) for word in smaller.replace(",", "").split() if word.isdigit())
    assert size * accum == 4096 and size < 4096
    config = activation_heavy_toy()
    config["steps"]["train"]["train_dataloader"]["batch_size"] = size
    assert planned(config, sample_data=True)["peak_bytes_per_worker"]["total"] <= memory


def test_plan_without_a_batch_shape_says_how_to_give_one() -> None:
    result = planned(train_config(wrap="nested"), device_memory=80 << 30)
    assert result["peak_bytes_per_worker"]["activations"] is None
    assert result["peak_bytes_per_worker"]["total"] is None and result["device_memory"]["fits"] is None
    assert "give --sequence-length N" in result["batch_note"] and "--sample-data" in result["batch_note"]
    assert "cannot say" in result["text"]


def test_plan_measures_the_optimizer_state_and_never_assumes_adam() -> None:
    def state(optimizer: Dict[str, Any], **options: Any) -> Any:
        config = train_config(wrap="nested", engine_extra={"optimizer": optimizer})
        return make_plan("train", config["steps"]["train"], measure=False, **options)

    adamw = state({"type": "torch::AdamW", "lr": 0.01}).bytes_per_worker()
    assert adamw["optimizer_state"] == 2 * adamw["parameters"]
    momentum = state({"type": "torch::SGD", "lr": 0.1, "momentum": 0.9}).bytes_per_worker()
    assert momentum["optimizer_state"] == momentum["parameters"]
    assert state({"type": "torch::SGD", "lr": 0.1}).bytes_per_worker()["optimizer_state"] == 0
    amsgrad = state({"type": "torch::Adam", "lr": 0.01, "amsgrad": True}).bytes_per_worker()
    assert amsgrad["optimizer_state"] == 3 * amsgrad["parameters"]
    # LBFGS's step needs a closure: its state cannot be measured, and is not guessed.
    lbfgs = state({"type": "torch::LBFGS", "lr": 0.1})
    assert lbfgs.bytes_per_worker()["optimizer_state"] is None and lbfgs.peak() is None
    assert "unknown for optimizer 'torch::LBFGS'" in lbfgs.optimizer_note
    assert "give --optimizer-states N" in lbfgs.optimizer_note
    given = state({"type": "torch::LBFGS", "lr": 0.1}, optimizer_states=2).bytes_per_worker()
    assert given == adamw


def test_frozen_parameters_get_no_gradient_or_optimizer_state() -> None:
    gpt2 = {
        "type": "test::hf_gpt2",
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 2,
        "vocab_size": 512,
        "n_positions": 32,
    }
    lora = {"type": "fairscale::with_lora", "model": gpt2, "r": 4, "target_modules": ["c_attn"]}
    config = train_config(wrap="nested", model=lora)
    config["steps"]["train"]["model"]["modules_to_wrap"] = [
        "base_model\\.model\\.gpt2\\.transformer\\.h\\.[0-9]+"
    ]
    result = make_plan(
        "train", config["steps"]["train"], steps=config["steps"], sequence_length=32, device="cpu"
    )
    # peft's adapters on c_attn: A (64 x 4) and B (4 x 192) in each of the 2 blocks.
    assert result.trainable_numel == 2 * (64 * 4 + 4 * 192) < result.total_numel
    state = result.bytes_per_worker()
    assert state["gradients"] == 4 * sum(-(-unit.trainable_numel // 2) for unit in result.units)
    assert state["optimizer_state"] == 2 * state["gradients"]
    assert state["parameters"] > 50 * state["gradients"]
    assert result.peak() is not None
    # FairScale's bucket as the backend sizes it: the adapters' gradients (KiBs) in its least, 1 MiB.
    assert result.bucket_cap_mb == 1
    _, parts = result.peak_components()
    assert parts["gathered_gradients"] is not None and parts["gathered_gradients"] < 4 << 20


class Ledger:
    """What a memory model's reduce-scatters hold, by kind (a stand-in for ``LiveTensorBytes``)."""

    def __init__(self) -> None:
        self.held: Dict[str, int] = {}
        self.most: Dict[str, int] = {}

    def hold(self, kind: str, size: int) -> None:
        self.held[kind] = self.held.get(kind, 0) + size
        self.most[kind] = max(self.most.get(kind, 0), self.held[kind])


def test_each_backend_answers_for_its_own_memory() -> None:
    """``plan`` asks the engine's backend (``Backend.memory_model``) what it holds, naming neither."""
    from tango_fairscale.backends.base import GATHERED_GRADIENTS, GRADIENTS
    from tango_fairscale.backends.lookup import backend_class
    from tango_fairscale.config import FSDPConfig
    from tango_fairscale.plan import Unit

    # A gradient of 4,000 bytes, which fits FairScale's 25 MiB bucket, and one of 32 MiB, which does not.
    small = Unit("small", "Linear", numel=1000, shard_numel=500, checkpointed=False, trainable_numel=1000)
    large = Unit(
        "large", "Linear", numel=8 << 20, shard_numel=4 << 20, checkpointed=False, trainable_numel=8 << 20
    )
    units = [small, large]
    fairscale = backend_class("fairscale").memory_model(FSDPConfig(), units, 2, 4)
    fsdp2 = backend_class("torch").memory_model(FSDPConfig(), units, 2, 4)
    assert fairscale.flat and fairscale.reduce_scatter_bucket
    assert not fsdp2.flat and not fsdp2.reduce_scatter_bucket and fsdp2.bucket_cap_mb == 0
    # The bucket as the backend sizes it: the 4,000 bytes that go into it, in its least, 1 MiB.
    assert fairscale.bucket_cap_mb == 1
    assert fairscale.bucketed(small) and not fairscale.bucketed(large)
    output = (1 << 20) // 2
    # After backward the small gradient's shard keeps the bucket's whole output (a view of it).
    assert fairscale.gradient_bytes(units, 2) == output + (4 << 20) * 4
    assert fsdp2.gradient_bytes(units, 2) == (500 + (4 << 20)) * 4
    for model in (fairscale, fsdp2):
        assert model.gathered_bytes(large) == (8 << 20) * 4
        # Under mixed precision the shard is cast to the compute dtype for the gather too.
        assert model.gathered_bytes(replace(large, compute_element_size=2)) == ((8 << 20) + (4 << 20)) * 2
        ledger = Ledger()
        reduce_scatter = model.reduce_scatter(ledger, accumulating=False)
        for unit in units:
            reduce_scatter.gradient_joined(unit)
            reduce_scatter.gradient_reduced(unit)
        reduce_scatter.finish()
        # What stays after backward is what the model says a worker holds; FairScale's bucket (its
        # input and its output) held for a while, then freed.
        assert ledger.held[GRADIENTS] == model.gradient_bytes(units, 2)
        assert ledger.held.get(GATHERED_GRADIENTS, 0) == 0
        assert ledger.most.get(GATHERED_GRADIENTS, 0) == (3 * output if model.reduce_scatter_bucket else 0)

    # The plan's own: the backend the config names.
    config = train_config(wrap="nested", engine_extra={"backend": "torch"})
    torch_plan = make_plan("train", config["steps"]["train"], measure=False)
    assert not torch_plan.flat and torch_plan.bucket_cap_mb == 0 and torch_plan.backend == "torch"
    default = make_plan("train", train_config(wrap="nested")["steps"]["train"], measure=False)
    assert default.flat and default.bucket_cap_mb == 1 and default.backend == "fairscale"


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("80GiB", 80 << 30),
        ("80G", 80 << 30),
        ("80gb", 80 * 10**9),
        ("24000MiB", 24000 << 20),
        ("1.5 GiB", 3 << 29),
    ]
    + [("4096", 4096), ("512k", 512 << 10), ("2TB", 2 * 10**12)],
)
def test_memory_sizes(text: str, size: int) -> None:
    assert parse_memory(text) == size


@pytest.mark.parametrize("text", ["80 GiBs", "lots", "1iB", "", "-1G"])
def test_memory_sizes_refused(text: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a memory size: write e.g. 80GiB"):
        parse_memory(text)


@Model.register("test::plan_reads_values", exist_ok=True)
class ReadsValues(Model):
    """A model whose constructor and forward read tensor values: neither works on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(()).item()  # a value read while building: not on meta
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        if x.abs().sum().item() > 0:  # a value read in forward: not on fake tensors
            x = x * self.scale
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)}


def test_a_model_that_reads_values_is_planned_without_its_activations() -> None:
    config = train_config(wrap="root", model={"type": "test::plan_reads_values"})
    eager = planned(config, sample_data=True)
    assert eager["built_on"] == "cpu" and "could not be built on the meta device" in eager["text"]
    config["steps"]["train"]["training_engine"]["init_on_meta"] = True
    result = planned(config, sample_data=True)
    # As the workers build it under init_on_meta: its parameters on meta.
    assert result["built_on"] == "meta_parameters" and "init_on_meta: true" in result["text"]
    assert result["peak_bytes_per_worker"]["activations"] is None
    note = result["step_peak"]["note"]
    assert note.startswith("not measured: the forward and backward on fake tensors raised"), note
    assert result["peak_bytes_per_worker"]["total"] is None
