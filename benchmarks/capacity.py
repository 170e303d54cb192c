"""
Capacity: the largest model that each configuration trains within a per-worker memory budget.

    python benchmarks/capacity.py [--family gpt2|mlp|llama] [--budget auto|SIZE] [--world-sizes 2,4]
                                  [--configs ...] [--json PATH] [--markdown PATH] [--chart PATH]
    python benchmarks/run.py --capacity ...   (the same)
    python benchmarks/capacity.py --probe-limits   (what RLIMIT_AS and RLIMIT_DATA count)

The published searches keep their results and charts in ``benchmarks/results/`` and their tables
in ``docs/capacity.md``.

The model family is GPT-2 small's width (768, 12 heads) with a byte vocabulary (257), 64 positions
and a variable depth: each block adds 7.08 M parameters and nothing else changes, so a depth is a
clean parameter count. ``--family mlp`` searches a wide residual MLP (width 1024, 8.4 M parameters
per block) and ``--family llama`` transformers' ``LlamaForCausalLM`` (width 768, 6.3 M per block)
instead, with the same search (``Family`` says what differs). A trial is one ``tango run`` of
``torch::train``: 3 AdamW steps at 2 sequences per worker, with one checkpoint, the ``tango run``
process capped by ``RLIMIT_DATA`` (soft and hard) before it starts, so that the main process and
every worker it spawns are in the budget from start to exit. It fits if the run exits 0 with its
``weights.pt`` and its cached step result. The ``benchmark::*_limited`` engines of ``components.py``
record each worker's peaks (training, and worker 0's consolidation). For each configuration and
number of workers a search of a few trials finds the largest depth that fits and the smallest that
fails: a first guess from a memory model (learned from the searches before it), predictions from the
measured peak of each fitting trial, halving the interval when a prediction falls outside it.

``--budget auto`` (the default) first runs DDP on 2 workers without a limit on the smallest model
of 50 M parameters or more, and takes its peak, rounded up to 64 MiB, as the budget.
"""

import argparse
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
# Run as a script, this file's own folder is on sys.path, not the repository.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import chart_link, free_port, host_environment  # noqa: E402

BLOCK = "GPT2Block"
MIB = 2**20

#: The model family: the depth varies, the rest is fixed. GPT-2 small's width: at narrower widths
#: a block's flat parameter falls under the fairscale engine's 16 MiB mmap threshold and its
#: buffers fragment the heap (see docs/capacity.md), which would measure malloc, not sharding.
SHAPES: Dict[str, Dict[str, int]] = {
    "full": {"n_embd": 768, "n_head": 12, "vocab_size": 257, "n_positions": 64},
    # For the tests: trials of a few seconds.
    "quick": {"n_embd": 64, "n_head": 2, "vocab_size": 257, "n_positions": 32},
}

#: name -> (engine, engine options, wrapper options or None for the plain model, label)
CONFIGS: Dict[str, Tuple[str, Dict[str, Any], Optional[Dict[str, Any]], str]] = {
    "ddp": ("benchmark::torch_limited", {}, None, 'DDP: Tango\'s "torch" engine'),
    "fsdp": (
        "benchmark::fairscale_limited",
        {"init_on_meta": True},
        {"fsdp_config": {}},
        "FairScale FSDP: one unit per block, init_on_meta",
    ),
    "fsdp_ckpt": (
        "benchmark::fairscale_limited",
        {"init_on_meta": True},
        {"fsdp_config": {}, "activation_checkpointing": True},
        "fsdp and activation checkpointing",
    ),
    "fsdp2": (
        "benchmark::fairscale_limited",
        {"backend": "torch", "init_on_meta": True},
        {"fsdp_config": {}},
        'PyTorch FSDP2 (fully_shard) through the engine\'s backend "torch": one unit per block, init_on_meta',
    ),
    "fsdp2_ckpt": (
        "benchmark::fairscale_limited",
        {"backend": "torch", "init_on_meta": True},
        {"fsdp_config": {}, "activation_checkpointing": True},
        "fsdp2 and activation checkpointing",
    ),
}

#: Model-state bytes per parameter on one worker before sharding, for first guesses only:
#: parameters, gradients and Adam's two moments (16), and DDP's gradient buckets (4 more).
STATE_BYTES = {"ddp": 20.0, "fsdp": 16.0, "fsdp_ckpt": 16.0, "fsdp2": 16.0, "fsdp2_ckpt": 16.0}


def block_parameters(shape: Dict[str, int]) -> int:
    """One GPT-2 block: attention (4 d^2 + 4 d), MLP (8 d^2 + 5 d), two layer norms (4 d)."""
    d = shape["n_embd"]
    return 12 * d * d + 13 * d


def model_parameters(shape: Dict[str, int], depth: int) -> int:
    """The blocks, token and position embeddings and the final norm (the output layer is tied)."""
    d = shape["n_embd"]
    return depth * block_parameters(shape) + (shape["vocab_size"] + shape["n_positions"]) * d + 2 * d


def depth_for(family: "Family", shape: Dict[str, int], parameters: float) -> int:
    """The smallest depth of ``family`` with at least ``parameters`` parameters."""
    fixed = family.model_parameters(shape, 0)
    return max(1, math.ceil((parameters - fixed) / family.block_parameters(shape)))


# --------------------------------------------------------------------------------------------
# Model families (--family): what the search needs of a model, the search itself is shared


class Family:
    """
    A model family of variable depth: identical blocks (one FSDP unit each) and a fixed rest, a
    language model over random tokens of ``shape``'s ``vocab_size`` and ``sequence_length``.
    """

    name = ""
    #: The class name of a block: the wrap plan's ``wrap_module_classes``.
    unit = ""
    #: For the report: what one trial trains.
    title = ""
    shapes: Dict[str, Dict[str, int]] = {}

    def block_parameters(self, shape: Dict[str, int]) -> int:
        raise NotImplementedError

    def fixed_parameters(self, shape: Dict[str, int]) -> int:
        """Everything but the blocks."""
        raise NotImplementedError

    def model_parameters(self, shape: Dict[str, int], depth: int) -> int:
        return self.fixed_parameters(shape) + depth * self.block_parameters(shape)

    def model(self, shape: Dict[str, int], depth: int) -> Dict[str, Any]:
        """The Tango ``Model`` config of ``depth`` blocks."""
        raise NotImplementedError

    def activation_floats_per_token(self, shape: Dict[str, int]) -> float:
        """About what one block saves for backward, in float32 values per token."""
        raise NotImplementedError

    def width(self, shape: Dict[str, int]) -> int:
        """The values per token between blocks (what a checkpointed block saves)."""
        raise NotImplementedError

    def describe(self, shape: Dict[str, int]) -> str:
        """The report's first words: the family at ``shape``."""
        raise NotImplementedError

    def tokens(self, shape: Dict[str, int]) -> Tuple[int, int]:
        """(vocabulary size, sequence length) of the data."""
        return shape["vocab_size"], shape["sequence_length"]


class GPT2Family(Family):
    name, unit, title = "gpt2", BLOCK, "GPT-2"
    shapes = SHAPES

    def block_parameters(self, shape: Dict[str, int]) -> int:
        return block_parameters(shape)

    def fixed_parameters(self, shape: Dict[str, int]) -> int:
        return model_parameters(shape, 0)

    def model(self, shape: Dict[str, int], depth: int) -> Dict[str, Any]:
        return {"type": "gpt2::from_config", "dropout": 0.0, "n_layer": depth, **shape}

    def width(self, shape: Dict[str, int]) -> int:
        return shape["n_embd"]

    def activation_floats_per_token(self, shape: Dict[str, int]) -> float:
        # About 17 values of the width, and the attention probabilities (a few copies of heads x
        # positions).
        return 17 * shape["n_embd"] + 3 * shape["n_head"] * shape["n_positions"]

    def describe(self, shape: Dict[str, int]) -> str:
        return (
            f"GPT-2 of width {shape['n_embd']} ({shape['n_head']} heads, vocabulary {shape['vocab_size']}, "
            f"{shape['n_positions']} positions) and variable depth"
        )

    def tokens(self, shape: Dict[str, int]) -> Tuple[int, int]:
        return shape["vocab_size"], shape["n_positions"]


class ResidualMLPFamily(Family):
    """``benchmark::residual_mlp``: LayerNorm, Linear(d, 4d), GELU, Linear(4d, d), a residual."""

    name, unit, title = "mlp", "ResidualMLPBlock", "residual MLP"
    #: Width 1024: a block's flat parameter is 32 MiB and each of its two weights' gradients 16 MiB,
    #: the issue's shape; the data as GPT-2's (byte vocabulary, 64 positions).
    shapes = {
        "full": {"width": 1024, "vocab_size": 257, "sequence_length": 64},
        "quick": {"width": 64, "vocab_size": 257, "sequence_length": 32},
    }

    def block_parameters(self, shape: Dict[str, int]) -> int:
        d = shape["width"]
        return 8 * d * d + 7 * d  # two weights, their biases (5 d), the norm (2 d)

    def fixed_parameters(self, shape: Dict[str, int]) -> int:
        return shape["vocab_size"] * shape["width"] + 2 * shape["width"]  # tied embedding, final norm

    def model(self, shape: Dict[str, int], depth: int) -> Dict[str, Any]:
        return {
            "type": "benchmark::residual_mlp",
            "vocab_size": shape["vocab_size"],
            "width": shape["width"],
            "depth": depth,
        }

    def width(self, shape: Dict[str, int]) -> int:
        return shape["width"]

    def activation_floats_per_token(self, shape: Dict[str, int]) -> float:
        # The norm's input and output, the 4 d up-projection and its GELU.
        return 10 * shape["width"]

    def describe(self, shape: Dict[str, int]) -> str:
        d = shape["width"]
        return (
            f"Residual MLP of width {d} (each block LayerNorm, Linear({d}, {4 * d}), GELU, "
            f"Linear({4 * d}, {d}) and a residual; a tied token embedding and head, vocabulary "
            f"{shape['vocab_size']}, {shape['sequence_length']} positions) and variable depth"
        )


class LlamaFamily(Family):
    """``benchmark::llama``: transformers' ``LlamaForCausalLM``, one unit per ``LlamaDecoderLayer``."""

    name, unit, title = "llama", "LlamaDecoderLayer", "Llama"
    #: GPT-2 small's width and heads, grouped-query attention (4 key-value heads) and Llama's
    #: 8/3 d gated MLP, rounded: a block's flat parameter is 24 MiB, above the 16 MiB threshold.
    shapes = {
        "full": {
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "vocab_size": 257,
            "sequence_length": 64,
        },
        "quick": {
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 257,
            "sequence_length": 32,
        },
    }

    def block_parameters(self, shape: Dict[str, int]) -> int:
        d, heads = shape["hidden_size"], shape["num_attention_heads"]
        kv = d // heads * shape["num_key_value_heads"]
        # q and o (d^2 each), k and v (d x kv each), gate, up and down, two RMSNorms; no biases.
        return 2 * d * d + 2 * d * kv + 3 * d * shape["intermediate_size"] + 2 * d

    def fixed_parameters(self, shape: Dict[str, int]) -> int:
        return shape["vocab_size"] * shape["hidden_size"] + shape["hidden_size"]  # tied embedding, norm

    def model(self, shape: Dict[str, int], depth: int) -> Dict[str, Any]:
        fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
        return {
            "type": "benchmark::llama",
            "vocab_size": shape["vocab_size"],
            "max_position_embeddings": shape["sequence_length"],
            "num_hidden_layers": depth,
            **{key: shape[key] for key in fields},
        }

    def width(self, shape: Dict[str, int]) -> int:
        return shape["hidden_size"]

    def activation_floats_per_token(self, shape: Dict[str, int]) -> float:
        # Norms, q, k, v, the attention's output and the gated MLP's four intermediates.
        d, heads = shape["hidden_size"], shape["num_attention_heads"]
        return 8 * d + 4 * shape["intermediate_size"] + 3 * heads * shape["sequence_length"]

    def describe(self, shape: Dict[str, int]) -> str:
        return (
            f"Llama (`LlamaForCausalLM`) of width {shape['hidden_size']} ({shape['num_attention_heads']} "
            f"heads, {shape['num_key_value_heads']} key-value heads, MLP {shape['intermediate_size']}, "
            f"RMSNorm, rotary positions, tied embedding and head, vocabulary {shape['vocab_size']}, "
            f"{shape['sequence_length']} positions) and variable depth"
        )


FAMILIES: Dict[str, Family] = {f.name: f for f in (GPT2Family(), ResidualMLPFamily(), LlamaFamily())}
GPT2 = FAMILIES["gpt2"]


# --------------------------------------------------------------------------------------------
# One trial


def experiment(
    name: str, world_size: int, depth: int, args: argparse.Namespace, records: Path
) -> Dict[str, Any]:
    if name in LORA_CONFIGS:
        return lora_experiment(name, world_size, depth, args, records)
    engine_type, engine_options, wrapper, _ = CONFIGS[name]
    model = args.family.model(args.shape, depth)
    vocab_size, sequence_length = args.family.tokens(args.shape)
    if wrapper is not None:
        model = {
            "type": "fairscale::with_wrapped_modules",
            "model": model,
            "wrap_module_classes": [args.family.unit],
            **wrapper,
        }
    engine: Dict[str, Any] = {
        "type": engine_type,
        "optimizer": {"type": "torch::AdamW", "lr": 1e-4},
        **engine_options,
    }
    return {
        "steps": {
            "data": {
                "type": "benchmark::random_tokens",
                "vocab_size": vocab_size,
                "sequence_length": sequence_length,
                "count": args.batch_size * world_size * args.steps,
            },
            "train": {
                "type": "torch::train",
                "model": model,
                "training_engine": engine,
                "dataset_dict": {"type": "ref", "ref": "data"},
                "train_dataloader": {
                    "batch_size": args.batch_size,
                    "sampler": {"type": "torch::DistributedSampler", "shuffle": True, "drop_last": True},
                },
                "train_steps": args.steps,
                "checkpoint_every": args.steps,
                "log_every": args.steps,
                "device_count": world_size,
                "distributed_port": free_port(),
                "callbacks": [{"type": "benchmark::capacity_record", "output_dir": str(records)}],
                # The step's result, the trained model, is built and cached in the workspace as a
                # user's run would: it is part of what the budget has to hold.
                "cache_results": True,
            },
        }
    }


#: An out-of-memory failure in a run's output, most specific first.
MEMORY_ERRORS = [
    r"can't allocate memory: you tried to allocate (\d+) bytes",
    r"Cannot allocate memory",
    r"MemoryError",
    r"std::bad_alloc",
]
#: A worker that died of a signal (e.g. C++ code that does not check a failed allocation, or
#: the kernel's OOM killer): how torch.multiprocessing reports it.
SIGNALLED = r"process \d+ terminated with signal (SIG\w+)"
FRAME = re.compile(r'File "([^"]+)", line \d+, in (\S+)')


def failure_reason(output: str, returncode: int) -> Tuple[bool, str]:
    """(whether the run failed for memory, what failed and where)."""
    lines = output.splitlines()
    for pattern in MEMORY_ERRORS:
        hits = [i for i, line in enumerate(lines) if re.search(pattern, line)]
        if not hits:
            continue
        line = lines[hits[-1]]
        size = re.search(MEMORY_ERRORS[0], line)
        what = f"can't allocate {int(size.group(1)) / MIB:.1f} MiB (ENOMEM)" if size else line.strip()[:200]
        # The innermost frame of the failing worker's traceback: where it ran out.
        frames = [FRAME.search(lines[i]) for i in range(hits[-1] - 1, -1, -1)]
        frame = next((f for f in frames if f is not None), None)
        where = f" in {Path(frame.group(1)).name}:{frame.group(2)}" if frame else ""
        return True, what + where
    signalled = re.findall(SIGNALLED, output, flags=re.IGNORECASE)
    if signalled:
        # C++ code that aborts (std::terminate) says so first: keep its words.
        aborted = re.findall(r"terminate called[^\n]*", output)
        return True, f"a worker was killed by {signalled[-1]}" + (
            f" ({aborted[-1].strip()})" if aborted else ""
        )
    last = next((line.strip() for line in reversed(lines) if line.strip()), f"exit status {returncode}")
    return False, last[:200]


#: ``tango run`` in a process that reports its own peak resident memory: the main process,
#: which the budget leaves alone, builds the full model once more for the step's result.
TANGO_MAIN = """
import json, resource, sys, threading, time
from tango.__main__ import main

peak = [0]

def vm_data():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0

def sample():
    while True:
        peak[0] = max(peak[0], vm_data())
        time.sleep(0.005)

threading.Thread(target=sample, daemon=True).start()
try:
    main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as handle:
        json.dump(
            {
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "peak_vm_data_bytes": max(peak[0], vm_data()),
            },
            handle,
        )
"""


def _limit_data(budget: Optional[int]) -> Optional[Callable[[], None]]:
    """
    ``preexec_fn`` that caps the ``tango run`` process at ``budget`` bytes of private memory
    (``RLIMIT_DATA``, soft and hard): its workers inherit the limit, so every process of the run,
    the main process included, is in the budget from start to exit.
    """
    if budget is None:
        return None

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (budget, budget))

    return limit


@dataclass
class Trial:
    config: str
    world_size: int
    depth: int
    parameters: int
    fits: bool
    wall_s: float
    memory_error: bool = False
    error: Optional[str] = None
    # From the workers (fitting trials only), each the largest over the workers:
    #: the sampled peak of private memory, what the budget limits;
    peak_vm_data_bytes: Optional[int] = None
    #: the peak resident set and the peak virtual size (what RLIMIT_AS would have to allow);
    peak_rss_bytes: Optional[int] = None
    peak_vm_size_bytes: Optional[int] = None
    #: private memory when the engine started, before the model: the runtime;
    runtime_bytes: Optional[int] = None
    #: parameters, gradients and optimizer state after the last step, tensor by tensor.
    state_bytes: Optional[int] = None
    losses: Optional[List[float]] = None
    #: The workers' peak while training (up to the last checkpoint), the largest over the workers.
    training_vm_data_bytes: Optional[int] = None
    #: Worker 0's peak while it consolidates weights.pt after training.
    consolidation_vm_data_bytes: Optional[int] = None
    #: The main ``tango`` process, from start to exit (the step's result built and cached).
    main_peak_rss_bytes: Optional[int] = None
    main_peak_vm_data_bytes: Optional[int] = None

    @property
    def run_peak_vm_data_bytes(self) -> Optional[int]:
        """
        The largest peak of any process of the run (the workers, worker 0's consolidation, the
        main process), what the budget must hold: the search predicts from it. The workers' where
        only theirs is known.
        """
        peaks = [self.peak_vm_data_bytes, self.consolidation_vm_data_bytes, self.main_peak_vm_data_bytes]
        known = [p for p in peaks if p]
        return max(known) if self.peak_vm_data_bytes and known else self.peak_vm_data_bytes


def run_trial(
    name: str, world_size: int, depth: int, args: argparse.Namespace, scratch: Path, log: Optional[Path]
) -> Trial:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-ws{world_size}-L{depth}-", dir=scratch))
    records = run_dir / "records"
    (run_dir / "config.json").write_text(json.dumps(experiment(name, world_size, depth, args, records)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        # Workers share the cores; more threads than cores only adds contention. The engine's
        # workers default to their share, Tango's DDP workers do not: set for both. It also
        # limits numpy's OpenBLAS in the main process (docs/capacity.md).
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world_size)),
        # The uncached step's temporary work directory (checkpoints, weights) lands in run_dir,
        # which is removed below even when the run was killed.
        "TMPDIR": str(run_dir),
    }
    main_record = run_dir / "main.json"
    command = [sys.executable, "-c", TANGO_MAIN, str(main_record), "run", str(run_dir / "config.json")]
    command += ["-w", str(run_dir / "ws")]
    for package in ("tango_fairscale", "examples.train_gpt2.components", "benchmarks.components"):
        command += ["-i", package]
    start = time.monotonic()
    try:
        result = subprocess.run(
            command,
            cwd=run_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.trial_timeout,
            preexec_fn=_limit_data(args.budget_bytes),
        )
        returncode, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as error:
        returncode = -1
        # With text=True the partial output is text, but typed as bytes too.
        partial = [
            part.decode() if isinstance(part, bytes) else part or "" for part in (error.stdout, error.stderr)
        ]
        output = "".join(partial) + f"\ntimed out after {args.trial_timeout:.0f} s"
    trial = Trial(
        name,
        world_size,
        depth,
        args.family.model_parameters(args.shape, depth),
        returncode == 0,
        time.monotonic() - start,
    )
    try:
        if main_record.exists():
            main = json.loads(main_record.read_text())
            trial.main_peak_rss_bytes = main["peak_rss_bytes"]
            trial.main_peak_vm_data_bytes = main.get("peak_vm_data_bytes")
        workers = [json.loads(p.read_text()) for p in sorted(records.glob("capacity_worker*.json"))]
        # What the user needs from the run: the trained weights and the step's cached result.
        step_dirs = list((run_dir / "ws" / "cache").glob("TorchTrainStep-*"))
        finished = bool(step_dirs) and all(
            (step / "work" / "weights.pt").is_file() and (step / "data.pt").is_file() for step in step_dirs
        )
        if trial.fits and not finished:
            trial.fits, trial.error = False, "exit 0 without weights.pt and the step result"
        elif trial.fits and len(workers) != world_size:
            trial.fits, trial.error = False, f"{len(workers)} of {world_size} worker records"
        elif trial.fits:
            # The worker that needs the most decides what fits.
            trial.peak_vm_data_bytes = max(w["peak_vm_data_bytes"] for w in workers)
            trial.peak_rss_bytes = max(w["peak_rss_bytes"] for w in workers)
            trial.peak_vm_size_bytes = max(w["peak_vm_size_bytes"] for w in workers)
            trial.runtime_bytes = max(w["vm_data_at_limit_bytes"] for w in workers)
            trial.state_bytes = max(w["state_bytes"] for w in workers)
            trial.training_vm_data_bytes = max(w["peak_vm_data_bytes"] for w in workers)
            trial.losses = workers[0]["losses"]
            consolidation = records / "capacity_consolidation.json"
            if consolidation.exists():
                trial.consolidation_vm_data_bytes = json.loads(consolidation.read_text())[
                    "peak_vm_data_consolidation_bytes"
                ]
        else:
            trial.memory_error, trial.error = failure_reason(output, returncode)
            # Which process ran out: the peaks of those that got as far as recording them (every
            # worker's after training, worker 0's after weights.pt), the main process's above.
            if len(workers) == world_size:
                trial.training_vm_data_bytes = max(w["peak_vm_data_bytes"] for w in workers)
            consolidation = records / "capacity_consolidation.json"
            if consolidation.exists():
                trial.consolidation_vm_data_bytes = json.loads(consolidation.read_text())[
                    "peak_vm_data_consolidation_bytes"
                ]
        if not trial.fits and log is not None:
            with log.open("a") as handle:
                handle.write(f"\n===== {name} on {world_size} workers, depth {depth}: exit {returncode}\n")
                handle.write(output[-8000:])
    finally:
        # Checkpoints and weights: gigabytes per trial, a disk's worth over a search.
        shutil.rmtree(run_dir, ignore_errors=True)
    return trial


# --------------------------------------------------------------------------------------------
# The search


@dataclass
class Search:
    config: str
    world_size: int
    trials: List[Trial] = field(default_factory=list)

    @property
    def largest_fit(self) -> Optional[Trial]:
        return max((t for t in self.trials if t.fits), key=lambda t: t.depth, default=None)

    @property
    def smallest_failure(self) -> Optional[Trial]:
        return min((t for t in self.trials if not t.fits), key=lambda t: t.depth, default=None)

    @property
    def resolved(self) -> bool:
        fit, failure = self.largest_fit, self.smallest_failure
        if failure is None:
            return False
        return failure.depth == 1 or (fit is not None and failure.depth - fit.depth == 1)


@dataclass
class MemoryModel:
    """
    The run's peak private memory (the largest over its processes, ``Trial.run_peak_vm_data_bytes``)
    as ``intercept + depth x per_block`` for one configuration,
    where ``per_block`` is the model state of a block on one worker plus ``extra_per_block``
    (activations, buffers): for first guesses, refined by every fitting trial.
    """

    intercept: float
    extra_per_block: float

    def per_block(self, name: str, world_size: int, family: Family, shape: Dict[str, int]) -> float:
        shards = 1 if name == "ddp" else world_size
        return STATE_BYTES[name] * family.block_parameters(shape) / shards + self.extra_per_block

    @classmethod
    def learn(
        cls, search: Search, family: Family, shape: Dict[str, int], batch_size: int
    ) -> Optional["MemoryModel"]:
        fits = sorted(
            (t for t in search.trials if t.fits and t.run_peak_vm_data_bytes), key=lambda t: t.depth
        )
        if not fits:
            return None
        shards = 1 if search.config == "ddp" else search.world_size
        state = STATE_BYTES[search.config] * family.block_parameters(shape) / shards
        top = fits[-1]
        assert top.run_peak_vm_data_bytes is not None
        if len(fits) >= 2 and fits[-2].run_peak_vm_data_bytes:
            slope = (top.run_peak_vm_data_bytes - fits[-2].run_peak_vm_data_bytes) / (
                top.depth - fits[-2].depth
            )
            extra = max(0.0, slope - state)
        else:
            extra = activation_bytes_per_block(search.config, family, shape, batch_size)
        return cls(top.run_peak_vm_data_bytes - (state + extra) * top.depth, extra)


def activation_bytes_per_block(name: str, family: Family, shape: Dict[str, int], batch_size: int) -> float:
    """
    What one block saves for backward (the family's estimate per token); with activation
    checkpointing its input alone (the block's width per token, its parameters' count gives it).
    """
    tokens = batch_size * family.tokens(shape)[1]
    if name.endswith("_ckpt"):
        return tokens * family.width(shape) * 4
    return tokens * family.activation_floats_per_token(shape) * 4


def next_depth(
    search: Search, budget: int, model: MemoryModel, family: Family, shape: Dict[str, int]
) -> Optional[int]:
    """
    The next depth to try, or None once the search is resolved. With a fitting trial: its
    measured peak plus the per-block cost (the slope between two fitting trials where there are
    two) predicts the largest depth that fits. Without one: the memory model does. A prediction
    of "no more than the largest fit" tries one block more, to find the failure that resolves the
    search. A prediction at or above a failure means the model is off: near the failure (within
    4 blocks of a fit) try just below it; else back off to 80 % of the failing depth after a first
    failure (the guess was probably close), and halve the interval after that.
    """
    if search.resolved:
        return None
    fit, failure = search.largest_fit, search.smallest_failure
    low = fit.depth if fit else 0
    per_block = model.per_block(search.config, search.world_size, family, shape)
    fits = sorted((t for t in search.trials if t.fits and t.run_peak_vm_data_bytes), key=lambda t: t.depth)
    if len(fits) >= 2 and fits[-2].run_peak_vm_data_bytes and fits[-1].run_peak_vm_data_bytes:
        slope = (fits[-1].run_peak_vm_data_bytes - fits[-2].run_peak_vm_data_bytes) / (
            fits[-1].depth - fits[-2].depth
        )
        # Noise can make a measured slope tiny or negative: not below half the expected one.
        per_block = max(slope, per_block / 2)
    if fit is not None and fit.run_peak_vm_data_bytes:
        guess = fit.depth + math.floor((budget - fit.run_peak_vm_data_bytes) / per_block)
    else:
        guess = math.floor((budget - model.intercept) / per_block)
    if failure is None:
        return max(guess, low + 1)
    high = failure.depth
    if low < guess < high:
        return guess
    if guess <= low:
        return low + 1
    if fit is not None and high - low <= 4:
        return high - 1
    if fit is None and len(search.trials) == 1:
        return max(1, math.floor(high * 0.8))
    return (low + high) // 2


def search_capacity(
    name: str,
    world_size: int,
    args: argparse.Namespace,
    scratch: Path,
    model: MemoryModel,
    on_trial: Callable[[Search, Trial], None],
) -> Search:
    search = Search(name, world_size)
    for _ in range(args.max_trials):
        depth = next_depth(search, args.budget_bytes, model, args.family, args.shape)
        if depth is None or depth < 1 or depth > args.max_depth:
            break
        search.trials.append(run_trial(name, world_size, depth, args, scratch, args.log))
        on_trial(search, search.trials[-1])
    return search


def first_model(
    name: str, world_size: int, learned: Dict[str, MemoryModel], fallback: MemoryModel
) -> MemoryModel:
    """The memory model for a new search: this configuration's from another number of workers,
    else plain FSDP's for the other FSDP configurations, else the calibration's."""
    if name in learned:
        return learned[name]
    if name != "ddp" and "fsdp" in learned:
        return learned["fsdp"]
    return fallback


# --------------------------------------------------------------------------------------------
# Budget, report


def calibrate(args: argparse.Namespace, scratch: Path) -> Dict[str, Any]:
    """DDP on 2 workers without a limit, on the smallest model of ``--calibrate-parameters``."""
    depth = depth_for(args.family, args.shape, args.calibrate_parameters)
    budget, args.budget_bytes = args.budget_bytes, None
    try:
        trial = run_trial("ddp", 2, depth, args, scratch, args.log)
    finally:
        args.budget_bytes = budget
    if not trial.fits or trial.peak_vm_data_bytes is None:
        raise RuntimeError(f"The calibration run (DDP, depth {depth}, no limit) failed: {trial.error}")
    # Rounded up to 64 MiB: some headroom over the sampled peak, which can miss short spikes.
    return {
        "parameters": args.calibrate_parameters,
        "depth": depth,
        "trial": asdict(trial),
        "budget_bytes": -(-trial.peak_vm_data_bytes // (64 * MIB)) * 64 * MIB,
    }


def summarize(searches: List[Search], budget: int) -> List[Dict[str, Any]]:
    ddp = {s.world_size: s.largest_fit for s in searches if s.config == "ddp"}
    records = []
    for search in searches:
        fit, failure = search.largest_fit, search.smallest_failure
        reference = ddp.get(search.world_size)
        record: Dict[str, Any] = {
            "config": search.config,
            "world_size": search.world_size,
            "label": config_label(search.config),
            "resolved": search.resolved,
            "fit": asdict(fit) if fit else None,
            "fail": asdict(failure) if failure else None,
            "fit_parameters": fit.parameters if fit else None,
            "fail_parameters": failure.parameters if failure else None,
            "vs_ddp": fit.parameters / reference.parameters if fit and reference else None,
            "trials": [asdict(t) for t in search.trials],
            "search_wall_s": sum(t.wall_s for t in search.trials),
        }
        if fit and fit.peak_vm_data_bytes and fit.runtime_bytes and fit.state_bytes:
            # Where the budget went in the largest model that fits, per worker.
            record["breakdown_bytes"] = {
                "runtime": fit.runtime_bytes,
                "model_state": fit.state_bytes,
                "rest": fit.peak_vm_data_bytes - fit.runtime_bytes - fit.state_bytes,
                "headroom": budget - fit.peak_vm_data_bytes,
            }
        records.append(record)
    return records


def millions(value: Optional[int]) -> str:
    return f"{value / 1e6:.1f} M" if value is not None else "-"


def mib(value: Optional[float]) -> str:
    return f"{value / MIB:,.0f} MiB" if value is not None else "-"


def markdown(data: Dict[str, Any], chart_path: str = "../benchmarks/results/capacity.png") -> str:
    """The page of a capacity run, its chart linked as ``chart_path`` (from the page's folder)."""
    settings, records, budget = data["settings"], data["records"], data["budget_bytes"]
    shape = settings["shape"]
    family = FAMILIES[settings.get("family", "gpt2")]
    calibration = data.get("calibration")
    lines = [
        "# Capacity: the largest model that trains in a per-worker memory budget",
        "",
        f"{family.describe(shape)}, {family.block_parameters(shape) / 1e6:.2f} M "
        f"parameters per block. Each trial is a `tango run` of {settings['steps']} AdamW steps at "
        f"{settings['batch_size']} sequences per worker with one checkpoint, the whole run capped by "
        f"`RLIMIT_DATA` at **{mib(budget)}** per process (`ulimit -d` before `tango run`: the main "
        "process and every worker it spawns, from start to exit); it fits if the run exits 0 with "
        "its `weights.pt` and its cached step result (the trained model).",
        "",
    ]
    if calibration:
        trial = calibration["trial"]
        lines += [
            f"The budget is the peak private memory (VmData) of DDP on 2 workers, with no limit, "
            f"training the smallest model of {calibration['parameters'] / 1e6:g} M parameters or more "
            f"({millions(trial['parameters'])}, depth {calibration['depth']}): "
            f"{mib(trial['peak_vm_data_bytes'])}, rounded up to 64 MiB.",
            "",
        ]
    lines += [
        "| | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in data["environment"].items()],
        "",
        "Reproduce: `python benchmarks/run.py --capacity"
        + (f" --family {family.name}" if family is not GPT2 else "")
        + (" --quick" if settings["quick"] else "")
        + f" --world-sizes {','.join(map(str, settings['world_sizes']))}"
        # A subset of the configurations (the default is all of CONFIGS).
        + (f" --configs {','.join(settings['configs'])}" if settings["configs"] != list(CONFIGS) else "")
        + ("`" + f" (`--budget {budget}` skips the calibration)" if calibration else f" --budget {budget}`"),
        "",
        "| config | workers | trains | x DDP | fails | failure of the smaller that fails | trials |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in records:
        fit, fail = r["fit"], r["fail"]
        trains = f"{millions(fit['parameters'])} ({fit['depth']} blocks)" if fit else "nothing"
        fails = f"{millions(fail['parameters'])} ({fail['depth']} blocks)" if fail else "-"
        error = (fail["error"] or "-") if fail else "-"
        if fail and not fail["memory_error"]:
            error = "**not a memory error**: " + error
        ratio = f"{r['vs_ddp']:.2f}" if r["vs_ddp"] is not None else "-"
        unresolved = "" if r["resolved"] else " (unresolved)"
        lines.append(
            f"| `{r['config']}` | {r['world_size']} | {trains} | {ratio} | {fails} "
            f"| {error.replace('|', '/')} | {len(r['trials'])}{unresolved} |"
        )
    lines += [
        "",
        *[
            f"- `{name}`: {label}"
            for name, (_, _, _, label) in CONFIGS.items()
            if name in settings["configs"]
        ],
        "",
        "## Where the budget goes",
        "",
        "Per worker, in the largest model that trains: private memory when the engine started (the "
        "Python/PyTorch/Tango runtime, which no sharding reduces), model state after the last step "
        "(parameters, gradients and AdamW's moments, counted tensor by tensor), and the rest of the "
        "sampled peak: activations, gathered units and their gradients, buffers (DDP's gradient "
        "buckets, FairScale's reduce-scatter bucket), memory the allocator keeps. Per parameter: "
        "what each parameter cost beyond the runtime, of which model state (16 bytes on one "
        "worker, 16 / workers sharded).",
        "",
        "| config | workers | parameters | runtime | model state | rest | headroom "
        "| bytes / parameter | of which model state |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        fit, parts = r["fit"], r.get("breakdown_bytes")
        if not fit or not parts:
            continue
        used = (parts["model_state"] + parts["rest"]) / fit["parameters"]
        lines.append(
            f"| `{r['config']}` | {r['world_size']} | {millions(fit['parameters'])} "
            f"| {mib(parts['runtime'])} | {mib(parts['model_state'])} | {mib(parts['rest'])} "
            f"| {mib(parts['headroom'])} "
            f"| {used:.1f} | {parts['model_state'] / fit['parameters']:.1f} |"
        )
    lines += [
        "",
        "## Where each process peaks",
        "",
        "In the largest model that fits, the sampled peak private memory (VmData, what the budget "
        "limits) of the workers while training (the largest over the workers), of worker 0 while it "
        "writes `weights.pt` from the shards after training, and of the main `tango` process from "
        "start to exit (it builds the step's result, the trained model, and caches it). The model's "
        "weights in float32 for comparison: the main process holds one copy of them.",
        "",
        "| config | workers | training | consolidation (worker 0) | main process | weights (fp32) "
        "| peak RSS (workers) | peak virtual (workers) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        fit = r["fit"]
        if not fit or not fit.get("peak_vm_data_bytes"):
            continue
        lines.append(
            f"| `{r['config']}` | {r['world_size']} | {mib(fit.get('training_vm_data_bytes'))} "
            f"| {mib(fit['consolidation_vm_data_bytes'])} | {mib(fit.get('main_peak_vm_data_bytes'))} "
            f"| {mib(fit['parameters'] * 4)} | {mib(fit['peak_rss_bytes'])} "
            f"| {mib(fit['peak_vm_size_bytes'])} |"
        )
    lines += ["", *targets(records), "", f"![parameters trainable per budget]({chart_path})", ""]
    return "\n".join(lines)


#: (config, world size, minimum ratio of its trainable parameters to DDP's): the targets, for both
#: backends, and with activation checkpointing.
TARGETS = [
    ("fsdp", 2, 1.8),
    ("fsdp", 4, 3.2),
    ("fsdp2", 2, 1.8),
    ("fsdp2", 4, 3.2),
    ("fsdp_ckpt", 2, 2.0),
    ("fsdp_ckpt", 4, 3.6),
    ("fsdp2_ckpt", 2, 2.0),
    ("fsdp2_ckpt", 4, 3.6),
]


def targets(records: List[Dict[str, Any]]) -> List[str]:
    by_key = {(r["config"], r["world_size"]): r for r in records}
    lines = [
        "## Targets (against DDP, at a budget where DDP trains 50 M parameters or more)",
        "",
        "| config | workers | target | measured | |",
        "|---|---:|---:|---:|---|",
    ]
    for config, world_size, minimum in TARGETS:
        record, ddp = by_key.get((config, world_size)), by_key.get(("ddp", world_size))
        if record is None or record["vs_ddp"] is None or ddp is None:
            continue
        if (ddp["fit_parameters"] or 0) >= 50e6:
            verdict = "met" if record["vs_ddp"] >= minimum else "missed"
        else:
            verdict = "n/a: DDP trains less than 50 M here"
        lines.append(
            f"| `{config}` | {world_size} | >= {minimum:.1f} x | {record['vs_ddp']:.2f} x | {verdict} |"
        )
    return lines


def chart(data: Dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    records = data["records"]
    world_sizes = sorted({r["world_size"] for r in records})
    configs = list(dict.fromkeys(r["config"] for r in records))
    by_key = {(r["config"], r["world_size"]): r for r in records}
    figure, (left, right) = plt.subplots(1, 2, figsize=(15, 5.8), gridspec_kw={"width_ratios": [1.1, 1]})
    width = 0.8 / len(world_sizes)
    colors = ["#4c72b0", "#55a868", "#8172b3", "#937860"]
    top = max((r["fail_parameters"] or r["fit_parameters"] or 0) / 1e6 for r in records) or 1.0
    for index, world_size in enumerate(world_sizes):
        offset = (index - (len(world_sizes) - 1) / 2) * width
        for position, config in enumerate(configs):
            record = by_key.get((config, world_size))
            if record is None:
                continue
            x = position + offset
            fit = (record["fit_parameters"] or 0) / 1e6
            fail = (record["fail_parameters"] or 0) / 1e6
            left.bar(x, fit, width * 0.92, color=colors[index % len(colors)])
            if fail:
                left.hlines(fail, x - width * 0.46, x + width * 0.46, colors="black", linestyles="dashed")
            if record["vs_ddp"] is not None:
                # Above the failing size's line, so that the two never overlap.
                left.text(
                    x, max(fit, fail) + top * 0.015, f"{record['vs_ddp']:.2f}x", ha="center", fontsize=9
                )
    handles: List[Any] = [
        Patch(color=colors[i % len(colors)], label=f"{ws} workers: largest that trains")
        for i, ws in enumerate(world_sizes)
    ]
    handles.append(Line2D([], [], color="black", linestyle="dashed", label="smallest that fails"))
    left.legend(handles=handles, loc="upper left", fontsize=9)
    left.set_ylim(0, top * 1.12)
    left.set_xticks(range(len(configs)))
    left.set_xticklabels(configs)
    left.set_ylabel("parameters (millions)")
    family = FAMILIES[data["settings"].get("family", "gpt2")]
    left.set_title(
        f"Largest {family.title} that trains in {mib(data['budget_bytes'])} per worker (ratio: x DDP)"
    )
    left.grid(axis="y", alpha=0.3)

    # Where the budget goes in each configuration's largest model, per worker.
    rows = [r for r in records if r.get("breakdown_bytes")]
    names = [f"{r['config']}, {r['world_size']} workers" for r in rows]
    parts = [
        ("runtime", "runtime (before the model)", "#b0b0b0"),
        ("model_state", "model state (parameters, gradients, AdamW)", "#dd8452"),
        ("rest", "rest (activations, buffers, allocator)", "#c44e52"),
        ("headroom", "headroom", "#f0f0f0"),
    ]
    starts = [0.0] * len(rows)
    for key, label, color in parts:
        values = [max(0.0, r["breakdown_bytes"][key] / MIB) for r in rows]
        right.barh(names, values, left=starts, color=color, label=label, edgecolor="white")
        starts = [s + v for s, v in zip(starts, values)]
    right.axvline(data["budget_bytes"] / MIB, color="black", linewidth=1)
    right.invert_yaxis()
    right.set_xlabel("MiB per worker (the line: the budget)")
    right.set_title("Where the budget goes, in the largest model that trains")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_outputs(data: Dict[str, Any], args: argparse.Namespace) -> str:
    lora = bool(data["settings"].get("lora"))
    text = (
        lora_markdown(data) if lora else markdown(data, chart_link(args.chart, args.markdown, "capacity.png"))
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.chart and data["records"] and not lora:
        args.chart.parent.mkdir(parents=True, exist_ok=True)
        chart(data, args.chart)
    return text


# --------------------------------------------------------------------------------------------
# LoRA against full fine-tuning (--lora)
#
# The same search, trial and limit as above, on a pretrained-shaped model: the Llama family's
# LlamaForCausalLM of a given depth is written as a downloaded model is (config.json and
# model.safetensors) before the trial, outside the budget, and a trial fine-tunes it from those
# files with `fairscale::from_pretrained` under init_on_meta, in full or with LoRA adapters on the
# attention's q_proj and v_proj (`fairscale::with_lora`), and exports it (the engine's export_hf:
# the whole model, or the adapter). With LoRA a worker holds about 4 / N bytes per frozen
# parameter where a full fine-tune holds 16 / N, but the main process builds the step's result,
# the whole trained model, at 4 bytes per parameter whatever the sharding: the search predicts from
# the largest peak of any process of the run (Trial.run_peak_vm_data_bytes).

#: The adapters of the LoRA configurations: rank 8 on the attention's query and value projections.
LORA_OPTIONS: Dict[str, Any] = {"r": 8, "target_modules": ["q_proj", "v_proj"]}

#: name -> (engine options, LoRA or full fine-tuning, label). Every one on `init_on_meta` (the base
#: read from the files one unit at a time) with `export_hf`, one unit per decoder layer.
LORA_CONFIGS: Dict[str, Tuple[Dict[str, Any], bool, str]] = {
    "fsdp_full": ({}, False, "FairScale FSDP (the default backend), full fine-tuning"),
    "fsdp_lora": ({}, True, "FairScale FSDP, LoRA r=8 on q_proj and v_proj, the base frozen"),
    "fsdp2_full": ({"backend": "torch"}, False, 'PyTorch FSDP2 (backend "torch"), full fine-tuning'),
    "fsdp2_lora": ({"backend": "torch"}, True, "PyTorch FSDP2, LoRA r=8 on q_proj and v_proj"),
    # The same with each layer's activations checkpointed (recomputed in backward), as a run that
    # fits the largest model it can is set up: LoRA's workers otherwise hold every layer's
    # activations for the backward through the frozen base.
    "fsdp_full_ckpt": ({}, False, "`fsdp_full` with each layer checkpointed"),
    "fsdp_lora_ckpt": ({}, True, "`fsdp_lora` with each layer checkpointed"),
    "fsdp2_full_ckpt": ({"backend": "torch"}, False, "`fsdp2_full` with each layer checkpointed"),
    "fsdp2_lora_ckpt": ({"backend": "torch"}, True, "`fsdp2_lora` with each layer checkpointed"),
}
#: For first guesses (MemoryModel): a full fine-tune's 16 bytes per parameter sharded; a LoRA
#: worker's frozen parameter, 4 bytes sharded (its adapters are a rounding error).
STATE_BYTES.update({name: 4.0 if lora else 16.0 for name, (_, lora, _) in LORA_CONFIGS.items()})
#: The main process's private memory besides the step's result (Python, torch, Tango,
#: transformers and peft, the rendezvous store, the sampling): the first guess of a LoRA search.
MAIN_RUNTIME_BYTES = 450 * MIB
#: The target of the issue: LoRA fits at least this many times a full fine-tune's parameters.
LORA_TARGETS = [(2, 3.0)]


def config_label(name: str) -> str:
    """The report's description of a configuration of either mode."""
    return LORA_CONFIGS[name][2] if name in LORA_CONFIGS else CONFIGS[name][3]


def llama_config_fields(shape: Dict[str, int], depth: int) -> Dict[str, Any]:
    """The ``LlamaConfig`` of the Llama family at ``shape`` and ``depth``, as a model's config.json has it."""
    fields = {k: v for k, v in FAMILIES["llama"].model(shape, depth).items() if k != "type"}
    return {
        **fields,
        "tie_word_embeddings": True,
        "use_cache": False,
        # What a downloaded model's config names: the class export_hf writes it back as.
        "architectures": ["LlamaForCausalLM"],
    }


def save_pretrained_llama(directory: Path, shape: Dict[str, int], depth: int, seed: int = 0) -> Path:
    """
    ``directory`` as ``save_pretrained`` writes a Llama of ``depth`` layers (``config.json``,
    ``model.safetensors``, the tied head not repeated), with random weights (norms at one): written
    one tensor at a time (the largest tensor's memory), not built whole, so that a model of a few
    hundred million parameters costs this process nothing to write.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tango_fairscale.finetune.hf_export import hf_state_names, write_safetensors

    config = LlamaConfig(**llama_config_fields(shape, depth))
    names, _ = hf_state_names(LlamaForCausalLM, config)
    with torch.device("meta"):
        state = LlamaForCausalLM(config).state_dict()
    generator = torch.Generator().manual_seed(seed)

    def produce(name: str) -> torch.Tensor:
        tensor = state[name]
        if tensor.dim() == 1:
            return torch.ones(tensor.shape, dtype=tensor.dtype)
        return torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 0.02

    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    tensors = {name: (tuple(state[name].shape), state[name].dtype) for name in names}
    write_safetensors(directory / "model.safetensors", tensors, produce, metadata={"format": "pt"})
    return directory


def pretrained_llama(root: Path, shape: Dict[str, int], depth: int) -> Path:
    """
    The pretrained directory of ``depth`` layers in ``root``: written once, for every
    configuration that tries the same depth. One at a time: a search's trials try other depths.
    """
    directory = root / f"llama-{depth}"
    if not (directory / "model.safetensors").is_file():
        for other in root.glob("llama-*"):
            shutil.rmtree(other, ignore_errors=True)
        save_pretrained_llama(directory, shape, depth)
    return directory


def lora_experiment(
    name: str, world_size: int, depth: int, args: argparse.Namespace, records: Path
) -> Dict[str, Any]:
    """:func:`experiment`'s config for a configuration of LORA_CONFIGS: the Llama of ``depth`` layers
    fine-tuned from its files, in full or with LoRA, and exported."""
    engine_options, lora, _ = LORA_CONFIGS[name]
    # Beside the trials' run directories, in the scratch folder run_trial's are in (removed with it).
    pretrained = pretrained_llama(records.parent.parent / "pretrained", args.shape, depth)
    model: Dict[str, Any] = {
        "type": "fairscale::from_pretrained",
        "pretrained_model_name_or_path": str(pretrained),
        "auto_class": "AutoModelForCausalLM",
    }
    if lora:
        model = {"type": "fairscale::with_lora", "model": model, **LORA_OPTIONS}
    config = experiment("fsdp", world_size, depth, args, records)
    train = config["steps"]["train"]
    train["model"] = {
        "type": "fairscale::with_wrapped_modules",
        "model": model,
        "wrap_module_classes": [FAMILIES["llama"].unit],
        "fsdp_config": {},
        "activation_checkpointing": name.endswith("_ckpt"),
    }
    # export_hf: the whole model, or the adapter (peft's directory), written by worker 0 after weights.pt.
    train["training_engine"].update({**engine_options, "init_on_meta": True, "export_hf": "hf"})
    return config


def lora_mode(args: argparse.Namespace, configs: List[str]) -> List[str]:
    """
    The settings of ``--lora``: the Llama family, the budget of the GPT-2 table unless one is given
    (``auto`` calibrates on DDP, which the LoRA mode does not run), and every configuration of
    LORA_CONFIGS unless ``--configs`` names some. Returns the configurations.
    """
    args.family = "llama"
    if args.budget == "auto":
        args.budget = "1600MiB"
    return list(LORA_CONFIGS) if configs == list(CONFIGS) else configs


def lora_first_model(
    name: str, world_size: int, shape: Dict[str, int], learned: Dict[str, MemoryModel], fallback: MemoryModel
) -> MemoryModel:
    """
    The memory model of a new search of the LoRA mode: this configuration's from another number of
    workers; else, for LoRA, the main process's (its runtime, and 4 bytes per parameter: the step's
    result), which caps it before any worker does; else the other backend's full fine-tune, or the
    fallback.
    """
    if name in learned:
        return learned[name]
    if LORA_CONFIGS[name][1]:
        block = FAMILIES["llama"].block_parameters(shape)
        return MemoryModel(MAIN_RUNTIME_BYTES, 4.0 * block - STATE_BYTES[name] * block / world_size)
    return learned.get(name.removesuffix("_ckpt"), learned.get("fsdp_full", fallback))


def _trial_peaks(trial: Optional[Dict[str, Any]]) -> str:
    """A trial's size and peaks: the workers training, worker 0 writing weights.pt and the export, main."""
    if trial is None:
        return "- | - | - | -"
    return (
        f"{millions(trial['parameters'])} ({trial['depth']} layers) "
        f"| {mib(trial.get('training_vm_data_bytes'))} | {mib(trial.get('consolidation_vm_data_bytes'))} "
        f"| {mib(trial.get('main_peak_vm_data_bytes'))}"
    )


def lora_markdown(data: Dict[str, Any]) -> str:
    """The LoRA mode's report: the section of docs/capacity.md."""
    settings, records, budget = data["settings"], data["records"], data["budget_bytes"]
    shape, family = settings["shape"], FAMILIES["llama"]
    by_key = {(r["config"], r["world_size"]): r for r in records}
    lines = [
        "## LoRA vs full fine-tuning",
        "",
        f"A pretrained-shaped {family.describe(shape)}, {family.block_parameters(shape) / 1e6:.2f} M "
        "parameters per layer, written before each trial as a downloaded model is (`config.json`, "
        "`model.safetensors`) and fine-tuned from those files by `fairscale::from_pretrained` "
        "(one unit per `LlamaDecoderLayer`, `init_on_meta: true`), in full or with "
        f"`fairscale::with_lora` (r={LORA_OPTIONS['r']} on {', '.join(LORA_OPTIONS['target_modules'])}: "
        "the base frozen), the engine's `export_hf` writing the whole model or the adapter. Each trial "
        f"is a `tango run` of {settings['steps']} AdamW steps at {settings['batch_size']} sequences per "
        f"worker with one checkpoint, the whole run capped by `RLIMIT_DATA` at **{mib(budget)}** per "
        "process (`ulimit -d` before `tango run`: the main process and every worker, start to exit, "
        "`weights.pt`, the export and the cached step result included).",
        "",
        "Reproduce: `python benchmarks/run.py --capacity --lora"
        + (" --quick" if settings["quick"] else "")
        + f" --world-sizes {','.join(map(str, settings['world_sizes']))} --budget {budget}`",
        "",
        "| backend | workers | full fine-tuning trains | fails | LoRA trains | fails | LoRA / full "
        "| trials |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios: Dict[Tuple[str, int], float] = {}
    for world_size in settings["world_sizes"]:
        for backend, full_name, lora_name in (
            ("fairscale", "fsdp_full", "fsdp_lora"),
            ("torch", "fsdp2_full", "fsdp2_lora"),
            ("fairscale, checkpointed", "fsdp_full_ckpt", "fsdp_lora_ckpt"),
            ("torch, checkpointed", "fsdp2_full_ckpt", "fsdp2_lora_ckpt"),
        ):
            full, lora = by_key.get((full_name, world_size)), by_key.get((lora_name, world_size))
            if full is None and lora is None:
                continue
            cells = []
            for record in (full, lora):
                fit = record and record["fit"]
                fail = record and record["fail"]
                cells.append(f"{millions(fit['parameters'])} ({fit['depth']} layers)" if fit else "nothing")
                cells.append(f"{millions(fail['parameters'])} ({fail['depth']} layers)" if fail else "-")
            ratio = "-"
            if full and lora and full["fit_parameters"] and lora["fit_parameters"]:
                ratios[(backend, world_size)] = lora["fit_parameters"] / full["fit_parameters"]
                ratio = f"{ratios[(backend, world_size)]:.2f} x"
            trials = "+".join(str(len(r["trials"])) if r else "0" for r in (full, lora))
            unresolved = "" if all(r and r["resolved"] for r in (full, lora)) else " (unresolved)"
            lines.append(
                f"| `{backend}` | {world_size} | {' | '.join(cells)} | {ratio} | {trials}{unresolved} |"
            )
    lines += [
        "",
        "Each process's sampled peak private memory (VmData, what the budget limits) in the largest "
        "model that fits and the smallest that fails: the workers while training (the largest over "
        "them), worker 0 writing `weights.pt` and the export after training, the main `tango` "
        "process from start to exit (it builds the step's result, the whole trained model, and "
        "caches it); and what failed in the one that fails.",
        "",
        "| config | workers | fits | training | weights.pt + export | main | fails | training "
        "| weights.pt + export | main | failure |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in records:
        fail = r["fail"]
        error = (fail["error"] or "-") if fail else "-"
        if fail and not fail["memory_error"]:
            error = "**not a memory error**: " + error
        lines.append(
            f"| `{r['config']}` | {r['world_size']} | {_trial_peaks(r['fit'])} | {_trial_peaks(fail)} "
            f"| {error.replace('|', '/')} |"
        )
    lines += ["", "| target | backend | workers | measured | |", "|---|---|---:|---:|---|"]
    for world_size, minimum in LORA_TARGETS:
        for backend in ("fairscale", "torch", "fairscale, checkpointed", "torch, checkpointed"):
            if (backend, world_size) in ratios:
                measured = ratios[(backend, world_size)]
                verdict = "met" if measured >= minimum else "missed"
                lines.append(
                    f"| LoRA >= {minimum:.1f} x full | `{backend}` | {world_size} | {measured:.2f} x "
                    f"| {verdict} |"
                )
    lines += ["", *[f"- `{name}`: {label}" for name, (_, _, label) in LORA_CONFIGS.items()], ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Which rlimit

PROBE = """
import resource, sys, torch
sys.path.insert(0, sys.argv[1])
from examples.train_gpt2.components import GPT2LanguageModel
limit, budget, depth = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(getattr(resource, limit), (budget, resource.RLIM_INFINITY))
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return ", ".join(f"{k} {int(fields[k].split()[0]) // 1024} MiB" for k in ("VmPeak", "VmHWM", "VmData"))
try:
    model = GPT2LanguageModel(
        vocab_size=257, n_positions=64, n_embd=768, n_layer=depth, n_head=12, dropout=0.0
    )
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(257, (2, 64))
    for _ in range(3):
        model(input_ids=tokens, labels=tokens)["loss"].backward()
        optimizer.step()
    print(f"{limit}: trains ({status()})")
except (RuntimeError, MemoryError) as error:
    print(f"{limit}: fails ({status()}): {str(error).splitlines()[-1][:90]}")
"""


def probe_limits(budget: int, depth: int) -> int:
    """
    One process trains a GPT-2 of ``depth`` blocks for 3 AdamW steps under each rlimit at the
    same budget: RLIMIT_AS counts the shared libraries and reserved address space as well (its
    peak, VmPeak, is far above the resident peak, VmHWM), RLIMIT_DATA about what is used.
    """
    parameters = model_parameters(SHAPES["full"], depth)
    print(f"GPT-2 width 768, depth {depth} ({parameters / 1e6:.1f} M parameters), budget {mib(budget)}:")
    for limit in ("RLIMIT_AS", "RLIMIT_DATA"):
        subprocess.run(
            [sys.executable, "-c", PROBE, str(REPO), limit, str(budget), str(depth)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            check=False,
        )
    return 0


# --------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget", default="auto", help="bytes per worker (e.g. 1536MiB, 1.5GiB), or auto (default)"
    )
    parser.add_argument(
        "--calibrate-parameters",
        type=float,
        default=None,
        help="with --budget auto: the model size DDP must train (default 50e6; --quick 1e6)",
    )
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated worker counts, 2 or more")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="a subset of " + ", ".join(CONFIGS))
    parser.add_argument(
        "--family",
        default="gpt2",
        choices=sorted(FAMILIES),
        help="the model family whose depth is searched (default gpt2)",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="LoRA against full fine-tuning of a pretrained Llama, both backends (configs: "
        + ", ".join(LORA_CONFIGS)
        + "; default budget 1600MiB)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny width: trials of seconds (for tests)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps per trial (default 3)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per worker and step (default 2)")
    parser.add_argument("--max-trials", type=int, default=6, help="trials per configuration (default 6)")
    parser.add_argument("--max-depth", type=int, default=500, help="the deepest model to try")
    parser.add_argument("--trial-timeout", type=float, default=900, help="seconds allowed per trial")
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="write the results here, after every trial (e.g. benchmarks/results/capacity.json)",
    )
    parser.add_argument(
        "--markdown", type=Path, default=None, help="write the tables here (e.g. docs/capacity.md)"
    )
    parser.add_argument(
        "--chart",
        type=Path,
        default=None,
        help="write the PNG chart here (e.g. benchmarks/results/capacity.png)",
    )
    parser.add_argument("--log", type=Path, default=None, help="append failing trials' output here")
    parser.add_argument(
        "--render", type=Path, default=None, help="no runs: tables and chart from --json output"
    )
    parser.add_argument(
        "--probe-limits",
        type=int,
        metavar="DEPTH",
        nargs="?",
        const=9,
        default=None,
        help="no runs: train one process of DEPTH blocks (default 9) under RLIMIT_AS and RLIMIT_DATA "
        "at --budget (default 1536MiB) and print what each counted",
    )
    args = parser.parse_args(argv)
    from benchmarks.components import parse_bytes

    if args.probe_limits is not None:
        return probe_limits(
            parse_bytes("1536MiB" if args.budget == "auto" else args.budget), args.probe_limits
        )
    if args.render is not None:
        print(write_outputs(json.loads(args.render.read_text()), args))
        return 0
    if not sys.platform.startswith("linux"):
        parser.error("the budget is RLIMIT_DATA, which counts private memory on Linux only")
    configs = [c for c in args.configs.split(",") if c]
    if args.lora:
        configs = lora_mode(args, configs)
    known = LORA_CONFIGS if args.lora else CONFIGS
    unknown = sorted(set(configs) - set(known))
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {sorted(known)}")
    world_sizes = sorted({int(x) for x in args.world_sizes.split(",") if x})
    if not world_sizes or world_sizes[0] < 2:
        parser.error("--world-sizes: 2 workers or more (FSDP needs 2)")
    if args.calibrate_parameters is None:
        args.calibrate_parameters = 1e6 if args.quick else 50e6
    args.budget_bytes = None if args.budget == "auto" else parse_bytes(args.budget)
    args.family = FAMILIES[args.family]
    args.shape = args.family.shapes["quick" if args.quick else "full"]

    started = time.monotonic()
    data: Dict[str, Any] = {
        "environment": host_environment(),
        "settings": {
            "quick": args.quick,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "world_sizes": world_sizes,
            "configs": configs,
            "family": args.family.name,
            "lora": LORA_OPTIONS if args.lora else None,
            "shape": args.shape,
            "block_parameters": args.family.block_parameters(args.shape),
            "limit": "RLIMIT_DATA on the tango run process and so every worker, from start to exit",
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        },
        "budget_bytes": args.budget_bytes,
        "records": [],
    }
    scratch = Path(tempfile.mkdtemp(prefix="tango-fairscale-capacity-"))
    searches: List[Search] = []

    def save(current: Optional[Search] = None) -> None:
        # After every trial, so that a run that is stopped keeps what it measured.
        data["records"] = summarize(searches + ([current] if current else []), data["budget_bytes"] or 0)
        data["elapsed_s"] = time.monotonic() - started
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=2))

    def on_trial(search: Search, trial: Trial) -> None:
        verdict = f"trains, peak {mib(trial.peak_vm_data_bytes)}" if trial.fits else f"fails: {trial.error}"
        if trial.fits and args.lora:
            verdict += f" (workers), {mib(trial.main_peak_vm_data_bytes)} (main)"
        print(
            f"  depth {trial.depth} ({trial.parameters / 1e6:.1f} M): {verdict} ({trial.wall_s:.0f} s)",
            flush=True,
        )
        save(search)

    try:
        if args.budget_bytes is None:
            print(
                f"Calibrating: DDP, 2 workers, {args.calibrate_parameters / 1e6:g} M parameters, no limit ..."
            )
            calibration = calibrate(args, scratch)
            args.budget_bytes = data["budget_bytes"] = calibration["budget_bytes"]
            data["calibration"] = calibration
            print(
                f"  peak {mib(calibration['trial']['peak_vm_data_bytes'])} "
                f"({calibration['trial']['wall_s']:.0f} s): budget {mib(args.budget_bytes)}",
                flush=True,
            )
            calibrated = Search("ddp", 2, [Trial(**calibration["trial"])])
            fallback = MemoryModel.learn(calibrated, args.family, args.shape, args.batch_size)
        else:
            fallback = None
        if fallback is None:
            # Without a calibration: a runtime of about 300 MiB, activations per block as estimated.
            fallback = MemoryModel(
                300 * MIB, activation_bytes_per_block("ddp", args.family, args.shape, args.batch_size)
            )
        learned: Dict[str, MemoryModel] = {}
        for world_size in world_sizes:
            for name in configs:
                print(f"{name} on {world_size} workers:", flush=True)
                if args.lora:
                    model = lora_first_model(name, world_size, args.shape, learned, fallback)
                else:
                    model = first_model(name, world_size, learned, fallback)
                search = search_capacity(name, world_size, args, scratch, model, on_trial)
                searches.append(search)
                save()
                found = MemoryModel.learn(search, args.family, args.shape, args.batch_size)
                if found is not None:
                    learned[name] = found
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    save()
    print()
    print(write_outputs(data, args))
    print(f"\n{(time.monotonic() - started) / 60:.1f} minutes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
