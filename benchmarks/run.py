"""
Memory and speed of Tango's DDP engine and this plugin's FSDP configurations (FairScale, and
PyTorch-native FSDP2 through the engine's ``backend: "torch"``), trained side by side through real
``tango run`` commands on the same model and data.

    python benchmarks/run.py [--quick] [--world-sizes 2,4] [--json PATH] [--markdown PATH] [--chart PATH]

The published runs keep their records and charts in ``benchmarks/results/`` (``--json``,
``--chart``) and their pages in ``docs/`` (``--markdown``), which link the charts there.

``python benchmarks/run.py --capacity [...]`` runs ``benchmarks/capacity.py`` instead: the largest
model each configuration trains within a per-worker memory budget.

Per worker it records model-state bytes (parameters, gradients and optimizer state held after a
step, counted tensor by tensor), peak resident memory, the median step time after warm-up and,
for both backends of the ``"fairscale"`` engine, the time per step in FSDP's all-gathers and
reduce-scatters. Every run writes the metrics log (``fairscale::metrics``), whose model FLOPs per
step (``FlopCounterMode`` on the first step, all workers) over the median step time and the
machine's peak (``python -m tango_fairscale peak`` on all cores, measured once before the runs)
is each configuration's MFU. Ratios to DDP at the same world size are the headline: absolute
times depend on the machine.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
TANGO = str(Path(sys.executable).with_name("tango"))
# Run as a script, this file's own folder is on sys.path, not the repository.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import chart_link, free_port, host_environment  # noqa: E402
from benchmarks.gpu import CONFIGS as GPU_CONFIGS  # noqa: E402

MODELS = {
    # GPT-2 small: 124 M parameters.
    "full": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 128},
    # For CI: a few hundred thousand parameters.
    "quick": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "n_positions": 32},
}
BLOCK = "GPT2Block"
#: ``--model llama``: a Llama shape of about GPT-2 small's size (``benchmark::llama``: RMSNorm, SiLU-gated
#: MLP, rotary positions, 4 key-value heads; 100 M parameters with its tied 32,000-token embedding).
LLAMA = {
    "num_hidden_layers": 12,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 128,
}
LLAMA_BLOCK = "LlamaDecoderLayer"


def model_of(args: argparse.Namespace) -> Tuple[str, Dict[str, Any]]:
    """The model family (``--model``) and its fields for this run (GPT-2 shrinks with ``--quick``)."""
    family = getattr(args, "model", "gpt2")
    if family == "llama":
        return family, LLAMA
    return family, MODELS["quick" if args.quick else "full"]


def sequence_length_of(family: str, model: Dict[str, Any]) -> int:
    return int(model["max_position_embeddings" if family == "llama" else "n_positions"])


#: Micro-batches per optimizer step in the gradient-accumulation configurations (``*_accum*``).
GRAD_ACCUM = 4


class Config(NamedTuple):
    """One configuration: a ``torch::train`` step's engine, model wrapper and own options."""

    #: The ``training_engine`` type.
    engine: str
    #: The ``training_engine`` options besides the optimizer.
    engine_options: Dict[str, Any]
    #: ``"fairscale::with_wrapped_modules"`` options (one unit per ``GPT2Block``), or None for
    #: the plain model.
    wrapper: Optional[Dict[str, Any]]
    #: Options of the ``torch::train`` step itself, e.g. ``grad_accum``.
    step_options: Dict[str, Any] = {}
    #: Environment variables of the run, e.g. ``MALLOC_MMAP_THRESHOLD_``.
    env: Dict[str, str] = {}

    @property
    def grad_accum(self) -> int:
        return int(self.step_options.get("grad_accum", 1))

    @property
    def times_collectives(self) -> bool:
        """Whether its collectives are timed: the ``"fairscale"`` engine, either backend (not DDP's)."""
        return self.engine == "fairscale"


NO_RESHARD = {"fsdp_config": {"reshard_after_forward": False}}

#: The engine leaves a huge-pages setting in ``GLIBC_TUNABLES`` alone.
NO_HUGE_PAGES = "glibc.malloc.hugetlb=0"

CONFIGS: Dict[str, Config] = {
    "ddp": Config("torch", {}, None),
    "fsdp": Config("fairscale", {"init_on_meta": True}, {"fsdp_config": {}}),
    "fsdp_eager_init": Config("fairscale", {}, {"fsdp_config": {}}),
    "fsdp_no_reshard": Config("fairscale", {"init_on_meta": True, **NO_RESHARD}, NO_RESHARD),
    "fsdp_ckpt": Config(
        "fairscale", {"init_on_meta": True}, {"fsdp_config": {}, "activation_checkpointing": True}
    ),
    "fsdp_offload": Config(
        "fairscale",
        {"init_on_meta": True, "fsdp_config": {"move_params_to_cpu": True}},
        {"fsdp_config": {"move_params_to_cpu": True}},
    ),
    # Each GPT2Block compiled (with_wrapped_modules.compile, inductor), beside the eager ones.
    "fsdp_compiled": Config("fairscale", {"init_on_meta": True}, {"fsdp_config": {}, "compile": True}),
    # fsdp_compiled again, right after it: inductor's cache (TORCHINDUCTOR_CACHE_DIR, one per
    # benchmark, empty at its start) holds the first run's kernels, as for a resumed run.
    "fsdp_compiled_rerun": Config("fairscale", {"init_on_meta": True}, {"fsdp_config": {}, "compile": True}),
    "fsdp_ckpt_compiled": Config(
        "fairscale",
        {"init_on_meta": True},
        {"fsdp_config": {}, "activation_checkpointing": True, "compile": True},
    ),
    "fsdp2_compiled": Config(
        "fairscale", {"backend": "torch", "init_on_meta": True}, {"fsdp_config": {}, "compile": True}
    ),
    "fsdp2_ckpt": Config(
        "fairscale",
        {"backend": "torch", "init_on_meta": True},
        {"fsdp_config": {}, "activation_checkpointing": True},
    ),
    "fsdp2_ckpt_compiled": Config(
        "fairscale",
        {"backend": "torch", "init_on_meta": True},
        {"fsdp_config": {}, "activation_checkpointing": True, "compile": True},
    ),
    # PyTorch FSDP2 (fully_shard) through the engine's torch backend, with the same wrap plan.
    "fsdp2": Config("fairscale", {"backend": "torch", "init_on_meta": True}, {"fsdp_config": {}}),
    "fsdp2_eager_init": Config("fairscale", {"backend": "torch"}, {"fsdp_config": {}}),
    # The torch backend with another CPU mmap threshold than its own 4 MiB (tango_fairscale/cpu/memory.py,
    # set through MALLOC_MMAP_THRESHOLD_, which the engine leaves alone, long-lived allocations
    # included): 2 MiB, what it shipped with before, and the fairscale backend's 16 MiB.
    "fsdp2_mmap2": Config(
        "fairscale",
        {"backend": "torch", "init_on_meta": True},
        {"fsdp_config": {}},
        env={"MALLOC_MMAP_THRESHOLD_": str(2 << 20)},
    ),
    "fsdp2_mmap16": Config(
        "fairscale",
        {"backend": "torch", "init_on_meta": True},
        {"fsdp_config": {}},
        env={"MALLOC_MMAP_THRESHOLD_": str(16 << 20)},
    ),
    # Either backend with its CPU workers' malloc not advising transparent huge pages, as before
    # the engine did (tango_fairscale/cpu/memory.py: cpu_worker_environment): what they save.
    "fsdp_no_thp": Config(
        "fairscale", {"init_on_meta": True}, {"fsdp_config": {}}, env={"GLIBC_TUNABLES": NO_HUGE_PAGES}
    ),
    "fsdp2_no_thp": Config(
        "fairscale",
        {"backend": "torch", "init_on_meta": True},
        {"fsdp_config": {}},
        env={"GLIBC_TUNABLES": NO_HUGE_PAGES},
    ),
    # Gradient accumulation over GRAD_ACCUM micro-batches per optimizer step: a reduce-scatter
    # per micro-batch, or (accumulate_grads_locally) only after the last one.
    "fsdp_accum": Config(
        "fairscale",
        {"init_on_meta": True, "accumulate_grads_locally": False},
        {"fsdp_config": {}},
        {"grad_accum": GRAD_ACCUM},
    ),
    "fsdp_accum_local": Config(
        "fairscale",
        {"init_on_meta": True, "accumulate_grads_locally": True},
        {"fsdp_config": {}},
        {"grad_accum": GRAD_ACCUM},
    ),
    # ... and the gathered parameters kept across the micro-batches of a step.
    "fsdp_accum_local_no_reshard": Config(
        "fairscale",
        {"init_on_meta": True, "accumulate_grads_locally": True, **NO_RESHARD},
        NO_RESHARD,
        {"grad_accum": GRAD_ACCUM},
    ),
}


def experiment(
    name: str,
    world_size: int,
    model: Dict[str, Any],
    steps: int,
    warmup: int,
    batch_size: int,
    family: str = "gpt2",
) -> Dict[str, Any]:
    engine_type, engine_options, wrapper, step_options, _ = CONFIGS[name]
    grad_accum = CONFIGS[name].grad_accum
    model_config: Dict[str, Any] = (
        {"type": "benchmark::llama", **model}
        if family == "llama"
        else {"type": "gpt2::from_config", "dropout": 0.0, **model}
    )
    if wrapper is not None:
        model_config = {
            "type": "fairscale::with_wrapped_modules",
            "model": model_config,
            "wrap_module_classes": [LLAMA_BLOCK if family == "llama" else BLOCK],
            **wrapper,
        }
    sampler = (
        {"type": "torch::DistributedSampler", "shuffle": True, "drop_last": True} if world_size > 1 else None
    )
    loader: Dict[str, Any] = {"batch_size": batch_size}
    if sampler:
        loader["sampler"] = sampler
    else:
        loader["shuffle"] = True
    return {
        "steps": {
            "data": {
                "type": "benchmark::random_tokens",
                "vocab_size": model["vocab_size"],
                "sequence_length": sequence_length_of(family, model),
                # Twice what the steps take (each step takes grad_accum batches per worker).
                "count": batch_size * world_size * steps * grad_accum * 2,
            },
            "train": {
                "type": "torch::train",
                "model": model_config,
                "training_engine": {
                    "type": engine_type,
                    "optimizer": {"type": "torch::AdamW", "lr": 1e-4},
                    **engine_options,
                },
                "dataset_dict": {"type": "ref", "ref": "data"},
                "train_dataloader": loader,
                "train_steps": steps,
                "checkpoint_every": steps,
                "log_every": steps,
                "device_count": world_size,
                "distributed_port": free_port(),
                # The metrics log (which the "fairscale" engine adds anyway) on every configuration,
                # DDP's included, for the model FLOPs per step: the same per-step cost for all.
                "callbacks": [
                    {"type": "benchmark::measure", "warmup_steps": warmup},
                    {"type": "fairscale::metrics"},
                ],
                **step_options,
            },
        }
    }


def run_one(name: str, world_size: int, args: argparse.Namespace, scratch: Path) -> Dict[str, Any]:
    family, model = model_of(args)
    run_dir = scratch / f"{name}-ws{world_size}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(
        json.dumps(experiment(name, world_size, model, args.steps, args.warmup, args.batch_size, family))
    )
    threads = max(1, (os.cpu_count() or 1) // world_size)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": str(threads),
        # One inductor cache per benchmark, empty at its start: the first compiled run pays the whole
        # compile, fsdp_compiled_rerun what a rerun on this machine pays.
        "TORCHINDUCTOR_CACHE_DIR": str(scratch.parent / "inductor-cache"),
        **CONFIGS[name].env,
    }
    command = [
        TANGO,
        "run",
        str(run_dir / "config.json"),
        "-w",
        str(run_dir / "ws"),
        "-i",
        "tango_fairscale",
        "-i",
        "examples.train_gpt2.components",
        "-i",
        "benchmarks.components",
    ]
    start = time.monotonic()
    result = subprocess.run(
        command, cwd=run_dir, env=env, capture_output=True, text=True, timeout=args.timeout
    )
    wall = time.monotonic() - start
    if result.returncode != 0:
        raise RuntimeError(
            f"{name} at world size {world_size} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    work_dir = next((run_dir / "ws").glob("cache/TorchTrainStep-*/work"))
    workers = [json.loads(p.read_text()) for p in sorted(work_dir.glob("benchmark_worker*.json"))]
    lines = [json.loads(line) for line in (work_dir / "metrics.jsonl").read_text().splitlines()]
    training = [line for line in lines if line["kind"] == "train"]
    (run_line,) = [line for line in lines if line["kind"] == "run"]
    if not args.keep:
        # Each run leaves a checkpoint and weights (gigabytes for the full model): a whole
        # benchmark's worth would fill a disk.
        shutil.rmtree(run_dir, ignore_errors=True)
    if len(workers) != world_size:
        raise RuntimeError(f"{name} at world size {world_size}: {len(workers)} worker records")
    return {
        "config": name,
        "world_size": world_size,
        "threads_per_worker": threads,
        # The worker that needs the most decides what fits, and the slowest sets the pace.
        "state_bytes_per_worker": max(w["state_bytes_total"] for w in workers),
        "peak_rss_bytes_per_worker": max(w["peak_rss_bytes"] for w in workers),
        "step_time_s": max(w["step_time_s"] for w in workers),
        # CPU seconds per step, the workers' mean (they do the same work): on cores the workers share,
        # a step that takes longer with the same CPU time waited rather than computed.
        "cpu_time_s": statistics.mean(w["cpu_time_s"] for w in workers),
        **{key: slowest(workers, key) for key in COLLECTIVES},
        # FlopCounterMode's count of the first step, all workers (every step has the same shape).
        "model_flops_per_step": run_line["model_flops_counted"]["flops"],
        "tokens_per_step": training[-1]["tokens_per_step"],
        # What the metrics log made of it in the run, against each worker's own measured peak.
        "metrics_log_mfu": statistics.median(line["mfu"] for line in training[args.warmup :] or training),
        "wall_time_s": wall,
        # Seconds the slowest worker spent in the unit calls that compiled, and its graphs.
        "compile_s": max(w.get("compile", {}).get("compile_s", 0.0) for w in workers),
        "compiled_graphs": max(w.get("compile", {}).get("compiled_graphs", 0) for w in workers),
        "workers": workers,
    }


#: Seconds per optimizer step in FSDP's collectives (None where they are not timed): all of them,
#: the all-gathers, the reduce-scatters.
COLLECTIVES = ("collectives_time_s", "all_gather_time_s", "reduce_scatter_time_s")


def slowest(workers: List[Dict[str, Any]], key: str) -> Optional[float]:
    """The largest of the workers' figures, None where no worker has one."""
    return max((w[key] for w in workers if w.get(key) is not None), default=None)


def combine(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """
    One record from repeated runs of a configuration: the median step time (and times in
    collectives) over the runs, the largest memory figures, and each run's figures under "runs".
    """
    record = dict(runs[0])
    record["step_time_s"] = statistics.median(r["step_time_s"] for r in runs)
    record["cpu_time_s"] = statistics.median(r["cpu_time_s"] for r in runs)
    for key in COLLECTIVES:
        measured = [r[key] for r in runs if r.get(key) is not None]
        record[key] = statistics.median(measured) if measured else None
    record["state_bytes_per_worker"] = max(r["state_bytes_per_worker"] for r in runs)
    record["peak_rss_bytes_per_worker"] = max(r["peak_rss_bytes_per_worker"] for r in runs)
    record["wall_time_s"] = sum(r["wall_time_s"] for r in runs)
    record["metrics_log_mfu"] = statistics.median(r["metrics_log_mfu"] for r in runs)
    kept = (
        "step_time_s",
        "cpu_time_s",
        *COLLECTIVES,
        "peak_rss_bytes_per_worker",
        "metrics_log_mfu",
        "wall_time_s",
    )
    record["runs"] = [{key: r.get(key) for key in kept} for r in runs]
    return record


def add_mfu(records: List[Dict[str, Any]], peak_flops_per_second: float) -> None:
    """Each record's achieved model FLOP/s (FLOPs of a step over its median time) and MFU against the peak."""
    for record in records:
        record["model_flops_per_second"] = record["model_flops_per_step"] / record["step_time_s"]
        record["mfu"] = record["model_flops_per_second"] / peak_flops_per_second


PEAK_SECONDS = 3.0


def peak_command(threads: int) -> List[str]:
    """The command that measures the machine's peak: a float32 matmul on ``threads`` threads."""
    return [
        "python",
        "-m",
        "tango_fairscale",
        "peak",
        "--threads",
        str(threads),
        "--seconds",
        f"{PEAK_SECONDS:g}",
    ]


def measure_peak(threads: int) -> Dict[str, Any]:
    """The machine's float32 matmul FLOP/s on ``threads`` threads, measured by :func:`peak_command`."""
    command = peak_command(threads)
    result = subprocess.run(
        [sys.executable, *command[1:]], cwd=REPO, capture_output=True, text=True, check=False, timeout=300
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    output = result.stdout.strip().splitlines()[-1]
    # "peak: 69.0 GFLOP/s (measured: ...)"
    gflops = float(output.split("peak:", 1)[1].split("GFLOP/s", 1)[0])
    return {"flops_per_second": gflops * 1e9, "command": " ".join(command), "output": output}


def add_ratios(records: List[Dict[str, Any]]) -> None:
    by_key = {(r["config"], r["world_size"]): r for r in records}
    for record in records:
        ddp = by_key.get(("ddp", record["world_size"]))
        fsdp = by_key.get(("fsdp", record["world_size"]))
        for key, short in (
            ("state_bytes_per_worker", "state"),
            ("peak_rss_bytes_per_worker", "rss"),
            ("step_time_s", "time"),
        ):
            if ddp:
                record[f"{short}_vs_ddp"] = record[key] / ddp[key]
            if fsdp:
                record[f"{short}_vs_fsdp"] = record[key] / fsdp[key]


def mib(value: float) -> str:
    return f"{value / 2**20:,.0f} MiB"


def ratio(record: Dict[str, Any], key: str) -> str:
    """A ratio for the table, or a dash where its reference configuration did not run."""
    return f"{record[key]:.3f}" if key in record else "-"


def seconds(record: Dict[str, Any], key: str) -> str:
    """A time for the table, or a dash where it was not measured."""
    value = record.get(key)
    return f"{value:.3f} s" if value is not None else "-"


def markdown(
    records: List[Dict[str, Any]],
    env: Dict[str, Any],
    args: argparse.Namespace,
    parameters: int,
    peak: Dict[str, Any],
) -> str:
    family, model = model_of(args)
    sequence_length = sequence_length_of(family, model)
    note = getattr(args, "note", None)
    lines = [
        "# Benchmarks",
        "",
        *([f"> {note}", ""] if note else []),
        f"{'A Llama' if family == 'llama' else 'GPT-2'} ({parameters / 1e6:.1f} M parameters, "
        f"sequence length {sequence_length}, "
        f"batch {args.batch_size} per worker, AdamW), trained through `tango run` on CPU workers (gloo), "
        f"{args.steps} steps, median step time after {args.warmup} warm-up steps"
        + (
            f", each configuration run {args.repeats} times in interleaved rounds (median of the runs)"
            if args.repeats > 1
            else ""
        )
        + ". Every configuration "
        'ran in the same session on the same machine; ratios are to DDP (Tango\'s `"torch"` engine) at '
        "the same world size. Workers share the machine's cores equally (`OMP_NUM_THREADS`). "
        '"In collectives" is the time per optimizer step spent in FSDP\'s all-gathers and '
        'reduce-scatters, "all-gather" and "reduce-scatter" its two parts (each the slowest '
        "worker's median), waiting for the other workers included; they are measured for both "
        'backends of the engine, FairScale\'s FSDP and FSDP2 (`backend: "torch"`), whose rings '
        'time them ("-" for DDP, whose all-reduces are not timed). '
        f"The `*_accum*` configurations accumulate gradients over {GRAD_ACCUM} micro-batches of the "
        "same batch size per optimizer step (`grad_accum`), so their step and collective times cover "
        f"{GRAD_ACCUM} micro-batches: compare them with each other. `fsdp_accum` reduce-scatters "
        "after every micro-batch, the `fsdp_accum_local*` ones (`accumulate_grads_locally`) after the "
        "last one only.",
        "",
        "MFU is the model FLOPs of an optimizer step (counted by `FlopCounterMode` over the forward and "
        "backward passes of the first step, all workers together: "
        f"{records[0]['model_flops_per_step'] / 1e9:.1f} GFLOP for one worker's batch) over the median "
        "step time and this machine's peak, "
        f"{peak['flops_per_second'] / 1e9:.1f} GFLOP/s: a float32 matmul on all "
        f"{peak.get('threads', '')} cores, measured once before the runs with `{peak['command']}` "
        f"(`{peak['output']}`). The same peak for every row, so MFU is proportional to each "
        "configuration's speed; the workers' own MFU in the metrics log is against the peak each "
        "measured in its run.",
        "",
        "| | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in env.items()],
        "",
        "Reproduce: `"
        + " ".join(
            [
                "python",
                "benchmarks/run.py",
                *(["--quick"] if args.quick else []),
                *(["--model", family] if family != "gpt2" else []),
                "--world-sizes",
                ",".join(map(str, args.world_sizes)),
                *(["--configs", ",".join(args.configs)] if args.configs != list(CONFIGS) else []),
                *(["--repeats", str(args.repeats)] if args.repeats > 1 else []),
                *(["--steps", str(args.steps)] if args.steps != (4 if args.quick else 8) else []),
                *(["--warmup", str(args.warmup)] if args.warmup != (1 if args.quick else 2) else []),
            ]
        )
        + "`",
        "",
        "| config | workers | model state / worker | x DDP | peak RSS / worker | x DDP "
        "| step time | x DDP | x `fsdp` | MFU | in collectives | all-gather | reduce-scatter |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| `{r['config']}` | {r['world_size']} | {mib(r['state_bytes_per_worker'])} "
            f"| {ratio(r, 'state_vs_ddp')} | {mib(r['peak_rss_bytes_per_worker'])} "
            f"| {ratio(r, 'rss_vs_ddp')} | {r['step_time_s']:.3f} s "
            f"| {ratio(r, 'time_vs_ddp')} | {ratio(r, 'time_vs_fsdp')} | {100 * r['mfu']:.2f} % "
            f"| {seconds(r, 'collectives_time_s')} | {seconds(r, 'all_gather_time_s')} "
            f"| {seconds(r, 'reduce_scatter_time_s')} |"
        )
    lines += [
        "",
        *targets(records, parameters),
        "",
        # The chart's path from the page's folder (usually benchmarks/results/ from docs/).
        "![memory and step time per configuration]("
        + chart_link(getattr(args, "chart", None), getattr(args, "markdown", None), "benchmarks.png")
        + ")",
        "",
    ]
    return "\n".join(lines)


#: (world size, metric, limit, what): what full sharding, one unit per block, must show against DDP
#: with either backend.
_AGAINST_DDP = [
    (2, "state_vs_ddp", 0.52, "model-state bytes per worker / DDP"),
    (4, "state_vs_ddp", 0.27, "model-state bytes per worker / DDP"),
    (2, "time_vs_ddp", 1.20, "step time / DDP"),
    (2, "rss_vs_ddp", 0.75, "peak resident memory per worker / DDP (models of 100 M parameters or more)"),
]
#: (config, world size, metric, limit, what): the project's targets for `fsdp` (FairScale's FSDP) and
#: `fsdp2` (FSDP2, the engine's torch backend), which must also be no slower than `fsdp`.
TARGETS = [
    *(("fsdp", *target) for target in _AGAINST_DDP),
    *(("fsdp2", *target) for target in _AGAINST_DDP),
    ("fsdp2", 2, "time_vs_fsdp", 1.00, "step time / the fairscale backend's (`fsdp`)"),
]


def targets(records: List[Dict[str, Any]], parameters: int) -> List[str]:
    """The targets of `fsdp` and `fsdp2`, each with the measured ratio and whether it holds."""
    by_key = {(r["config"], r["world_size"]): r for r in records}
    lines = [
        "## Targets (full sharding, one unit per block)",
        "",
        "| config | workers | ratio | target | measured | |",
        "|---|---:|---|---:|---:|---|",
    ]
    for config, world_size, metric, limit, what in TARGETS:
        record = by_key.get((config, world_size))
        if record is None or metric not in record:
            continue
        if metric == "rss_vs_ddp" and parameters < 100e6:
            continue
        value = record[metric]
        verdict = "met" if value <= limit else "missed"
        lines.append(f"| `{config}` | {world_size} | {what} | <= {limit:.2f} | {value:.3f} | {verdict} |")
    return lines


def chart(records: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world_sizes = sorted({r["world_size"] for r in records})
    configs = list(dict.fromkeys(r["config"] for r in records))
    by_key = {(r["config"], r["world_size"]): r for r in records}
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / len(world_sizes)
    metrics = [
        ("state_bytes_per_worker", "model state per worker (MiB)", 2**20),
        ("peak_rss_bytes_per_worker", "peak resident memory per worker (MiB)", 2**20),
        ("step_time_s", "median step time (s)", 1),
    ]
    for axis, (key, title, scale) in zip(axes, metrics):
        for index, world_size in enumerate(world_sizes):
            values = [
                by_key[(c, world_size)][key] / scale if (c, world_size) in by_key else 0 for c in configs
            ]
            axis.bar(
                [i + index * width for i in range(len(configs))],
                values,
                width,
                label=f"{world_size} worker(s)",
            )
        axis.set_xticks([i + width * (len(world_sizes) - 1) / 2 for i in range(len(configs))])
        axis.set_xticklabels(configs, rotation=30, ha="right")
        axis.set_title(title)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--capacity" in argv:
        # A benchmark of its own (benchmarks/capacity.py), with its own options.
        from benchmarks import capacity

        return capacity.main([a for a in argv if a != "--capacity"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="instead: the largest model each configuration trains in a per-worker memory budget "
        "(benchmarks/capacity.py; see its --help)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model and few steps (for CI)")
    parser.add_argument(
        "--model",
        choices=("gpt2", "llama"),
        default="gpt2",
        help="GPT-2 small (124 M; --quick: a tiny one), or a Llama of about its size (100 M); with --gpu: "
        "GPT-2 medium (355 M, batch 8 x 1024 tokens), or a Llama of TinyLlama-1.1B's shape (1.1 B, SDPA "
        "attention, batch 4 x 1024 tokens; --quick: a tiny one)",
    )
    parser.add_argument(
        "--world-sizes", default="2,4", help="comma-separated worker counts besides the 1-worker DDP baseline"
    )
    parser.add_argument(
        "--configs",
        default=None,
        help="comma-separated subset of: " + ", ".join(CONFIGS) + f" (with --gpu: {', '.join(GPU_CONFIGS)})",
    )
    parser.add_argument("--steps", type=int, help="training steps per run (default 8, quick 4)")
    parser.add_argument("--warmup", type=int, help="steps left out of the median (default 2, quick 1)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per worker and step (default 2; --gpu: 8, with --model llama 4)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every configuration this many times, in interleaved rounds, and report the median "
        "(evens out a busy machine's slow spells)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="write the records here (e.g. benchmarks/results/benchmarks.json)",
    )
    parser.add_argument(
        "--markdown", type=Path, default=None, help="write the table here (e.g. docs/benchmarks.md)"
    )
    parser.add_argument(
        "--chart",
        type=Path,
        default=None,
        help="write the PNG chart here (e.g. benchmarks/results/benchmarks.png)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the runs' workspaces")
    parser.add_argument("--note", default=None, help="a note for the top of the markdown page")
    parser.add_argument(
        "--render", type=Path, default=None, help="no runs: redraw the table and chart from this --json file"
    )
    gpu = parser.add_argument_group("GPU mode (one GPU, NCCL, world size 1; benchmarks/gpu.py)")
    gpu.add_argument(
        "--gpu",
        action="store_true",
        help="fp32, AMP and mixed precision (float16, bfloat16) with either backend on one GPU, eager and "
        "with each block compiled (*_compiled), beside a plain module's (plain_*): peak CUDA memory, "
        "tokens/s, MFU, warm-up (compile) time, ratio to plain",
    )
    gpu.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="with --gpu: cpu runs the same harness (the float32 configurations) to check it without a GPU",
    )
    gpu.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="with --gpu: the device's dense peak in TFLOP/s for MFU, every configuration alike "
        "(default: each configuration's compute dtype in the package's table of GPUs)",
    )
    args = parser.parse_args(argv)
    if args.gpu:
        from benchmarks import gpu as gpu_mode

        return gpu_mode.main(args)
    args.configs = args.configs or ",".join(CONFIGS)
    # World size 1 is the DDP baseline, always run (the FSDP engine needs 2 workers or more).
    args.world_sizes = sorted({int(x) for x in args.world_sizes.split(",") if x} - {1})
    args.batch_size = args.batch_size or 2
    args.steps = args.steps or (4 if args.quick else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    configs = args.configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {sorted(CONFIGS)}")

    if args.render is not None:
        saved = json.loads(args.render.read_text())
        args.world_sizes = sorted({r["world_size"] for r in saved["records"]} - {1})
        args.__dict__.update(saved.get("settings", {}))
        return report(saved["records"], saved["environment"], saved["parameters"], saved["peak"], args)

    if args.repeats < 1:
        parser.error("--repeats must be 1 or more")
    plan = [("ddp", 1)] + [(c, ws) for ws in args.world_sizes for c in configs]
    threads = os.cpu_count() or 1
    print(f"peak: {' '.join(peak_command(threads))} ...", end=" ", flush=True)
    peak = {**measure_peak(threads), "threads": threads}
    print(f"{peak['flops_per_second'] / 1e9:.1f} GFLOP/s", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="tango-fairscale-bench-"))
    runs: Dict[Any, List[Dict[str, Any]]] = {key: [] for key in plan}
    total = len(plan) * args.repeats
    try:
        for index, (round_, (name, world_size)) in enumerate(
            ((r, key) for r in range(args.repeats) for key in plan), 1
        ):
            print(f"[{index}/{total}] {name} on {world_size} worker(s) ...", end=" ", flush=True)
            record = run_one(name, world_size, args, scratch / f"round{round_}")
            runs[(name, world_size)].append(record)
            mfu = record["model_flops_per_step"] / record["step_time_s"] / peak["flops_per_second"]
            print(
                f"state {mib(record['state_bytes_per_worker'])}, "
                f"peak RSS {mib(record['peak_rss_bytes_per_worker'])}, "
                f"step {record['step_time_s']:.3f} s (CPU {record['cpu_time_s']:.3f} s per worker), "
                f"MFU {100 * mfu:.2f} % "
                f"({record['wall_time_s']:.0f} s wall"
                + (
                    f", compiling {record['compile_s']:.0f} s, {record['compiled_graphs']} graph(s))"
                    if record["compiled_graphs"]
                    else ")"
                ),
                flush=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    records = [combine(runs[key]) for key in plan]
    add_ratios(records)
    add_mfu(records, peak["flops_per_second"])
    env = host_environment()
    parameters = records[0]["workers"][0]["parameters"]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {
            key: getattr(args, key)
            for key in ("quick", "model", "steps", "warmup", "batch_size", "repeats", "configs", "note")
        }
        args.json.write_text(
            json.dumps(
                {
                    "environment": env,
                    "parameters": parameters,
                    "peak": peak,
                    "settings": settings,
                    "records": records,
                },
                indent=2,
            )
        )
    return report(records, env, parameters, peak, args)


def report(
    records: List[Dict[str, Any]],
    env: Dict[str, Any],
    parameters: int,
    peak: Dict[str, Any],
    args: argparse.Namespace,
) -> int:
    """Write the markdown table and the chart, and print the table."""
    text = markdown(records, env, args, parameters, peak)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.chart:
        chart(records, args.chart)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
