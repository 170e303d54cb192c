"""
Loading a pretrained model: each worker's peak memory with and without ``init_on_meta``.

    python benchmarks/pretrained_memory.py [--quick] [--backends fairscale,torch]
                                           [--model-dir DIR] [--json PATH] [--markdown PATH]

The published run: ``--json benchmarks/results/pretrained-memory.json --markdown docs/pretrained-memory.md``.

A GPT-2 of GPT-2 small's shape (124 M parameters, random weights: nothing can be downloaded) is
saved with ``save_pretrained`` in ``--model-dir`` (kept and reused when it is there already), then
fine-tuned through ``tango run`` as a user would, with ``fairscale::from_pretrained`` on 2 CPU
workers, one FSDP unit per block, for one AdamW step: with the engine's ``init_on_meta``, and
without it (``transformers``' own ``from_pretrained`` on every worker, then sharded), on each
backend. Every worker records (``benchmark::load_memory`` in ``benchmarks/components.py``) its
private memory (``VmData``, sampled every 5 ms from ``/proc/self/status``, and ``RssAnon``, its
resident part) and its resident set (``VmHWM``, the kernel's exact high-water mark, which counts
pages of mapped files too): when its engine started, before the model (the runtime); when the
model is loaded and sharded (before the first step); and after the step and its checkpoint.

The question: does a worker loading with ``init_on_meta`` stay below the runtime plus the full
model's weights, the least that loading the whole model on every worker needs?
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
TANGO = str(Path(sys.executable).with_name("tango"))
# Run as a script, this file's own folder is on sys.path, not the repository.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import free_port, host_environment  # noqa: E402

MIB = 2**20
WORLD_SIZE = 2
#: GPT-2 small (124 M parameters), and a tiny one for the tests.
SHAPES = {
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024},
    "quick": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 257, "n_positions": 64},
}
#: Tokens per sequence and sequences per worker of the one training step.
SEQUENCE_LENGTH = 64
BATCH_SIZE = 1
#: (backend, init_on_meta, MALLOC_MMAP_THRESHOLD_ or None for the engine's own) in the order they run.
VARIANTS: List[Tuple[str, bool, Optional[int]]] = [
    *((b, meta, None) for b in ("fairscale", "torch") for meta in (True, False)),
]


def make_model(shape: Dict[str, int], directory: Path) -> Dict[str, Any]:
    """
    A GPT-2 of ``shape`` with random weights (seed 0), saved with ``save_pretrained`` in
    ``directory`` unless a model of that shape is there already. Returns its size.
    """
    from tango_fairscale.finetune.pretrained import SAFETENSORS_FILE, read_header

    config_file = directory / "config.json"
    existing = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if not (directory / SAFETENSORS_FILE).is_file() or any(existing.get(k) != v for k, v in shape.items()):
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(**shape))
        shutil.rmtree(directory, ignore_errors=True)
        model.save_pretrained(directory)
        del model
    _, header = read_header(directory / SAFETENSORS_FILE)
    return {
        "directory": str(directory),
        "shape": shape,
        # The tied LM head is the token embedding: saved, and counted, once.
        "parameters": sum(math.prod(entry["shape"]) for entry in header.values()),
        "weights_bytes": sum(end - begin for begin, end in (e["data_offsets"] for e in header.values())),
        "file_bytes": (directory / SAFETENSORS_FILE).stat().st_size,
    }


def experiment(
    backend: str, init_on_meta: bool, model_dir: Path, vocab_size: int, records: Path
) -> Dict[str, Any]:
    """One AdamW step of fine-tuning the saved model on random tokens, 2 workers, a unit per block."""
    return {
        "steps": {
            "data": {
                "type": "benchmark::random_tokens",
                "vocab_size": vocab_size,
                "sequence_length": SEQUENCE_LENGTH,
                "count": BATCH_SIZE * WORLD_SIZE,
            },
            "train": {
                "type": "torch::train",
                "model": {
                    "type": "fairscale::with_wrapped_modules",
                    "model": {
                        "type": "fairscale::from_pretrained",
                        "pretrained_model_name_or_path": str(model_dir),
                    },
                    "wrap_module_classes": ["GPT2Block"],
                    "fsdp_config": {},
                },
                # The "fairscale" engine, which also notes the worker's memory when it starts, before
                # the model is built (benchmarks/components.py); no memory_limit, so no limit.
                "training_engine": {
                    "type": "benchmark::fairscale_limited",
                    "backend": backend,
                    "init_on_meta": init_on_meta,
                    "optimizer": {"type": "torch::AdamW", "lr": 1e-5},
                },
                "dataset_dict": {"type": "ref", "ref": "data"},
                "train_dataloader": {
                    "batch_size": BATCH_SIZE,
                    "sampler": {"type": "torch::DistributedSampler", "shuffle": False, "drop_last": True},
                },
                "train_steps": 1,
                "checkpoint_every": 1,
                "log_every": 1,
                "device_count": WORLD_SIZE,
                "distributed_port": free_port(),
                "callbacks": [{"type": "benchmark::load_memory", "output_dir": str(records)}],
            },
        }
    }


def run_variant(
    backend: str,
    init_on_meta: bool,
    mmap_threshold: Optional[int],
    model: Dict[str, Any],
    scratch: Path,
    timeout: float,
    keep: bool,
) -> Dict[str, Any]:
    """One ``tango run`` of :func:`experiment`; its workers' records and its wall time."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{backend}-{'meta' if init_on_meta else 'eager'}-", dir=scratch))
    records = run_dir / "records"
    config = experiment(
        backend, init_on_meta, Path(model["directory"]), model["shape"]["vocab_size"], records
    )
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    command = [TANGO, "run", str(run_dir / "config.json"), "-w", str(run_dir / "ws")]
    command += ["-i", "tango_fairscale", "-i", "benchmarks.components"]
    # The library that builds the model is part of the runtime, not of the model: imported by each
    # worker when it starts (about 100 MiB of private memory), so that both variants are measured
    # from a runtime that holds it.
    command += ["-i", "transformers.models.gpt2.modeling_gpt2"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        # The workers share the cores; more threads than cores only contend.
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // WORLD_SIZE)),
        # The step's temporary files land in run_dir, removed below.
        "TMPDIR": str(run_dir),
    }
    if mmap_threshold is not None:  # the engine leaves malloc alone where this is set
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    start = time.monotonic()
    result = subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - start
    try:
        if result.returncode != 0:
            output = result.stdout[-3000:] + result.stderr[-6000:]
            raise RuntimeError(f"tango run of {backend}, init_on_meta={init_on_meta} failed:\n{output}")
        workers = [json.loads(p.read_text()) for p in sorted(records.glob("load_memory_worker*.json"))]
        if len(workers) != WORLD_SIZE:
            raise RuntimeError(f"{len(workers)} worker records in {records}, expected {WORLD_SIZE}")
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "backend": backend,
        "init_on_meta": init_on_meta,
        "mmap_threshold": mmap_threshold,
        "wall_s": wall,
        "workers": workers,
    }


def setting(mmap_threshold: Optional[int]) -> str:
    """How a variant's malloc is set, for the tables."""
    return "engine's" if mmap_threshold is None else f"`MALLOC_MMAP_THRESHOLD_={mmap_threshold}`"


#: The measures of a worker's memory the tables report: (key in the records, name). The peak of
#: "RSS" is VmHWM, the kernel's own; its runtime is VmRSS then.
MEASURES = [
    ("vm_data", "VmData"),
    ("rss_anon", "RssAnon"),
    ("rss", "RSS"),
]


def summarize(record: Dict[str, Any], weights_bytes: int) -> List[Dict[str, Any]]:
    """
    Per worker and measure: the runtime, the loading peak, what it adds to the runtime (also over
    the weights) and whether it stays below the runtime plus the weights.
    """
    rows = []
    for worker in record["workers"]:
        runtime, loaded, run = worker["runtime"], worker["loaded"], worker["run"]
        row: Dict[str, Any] = {
            "backend": record["backend"],
            "init_on_meta": record["init_on_meta"],
            "mmap_threshold": record.get("mmap_threshold"),
            "worker": worker["worker"],
            "run_vm_data": run["peak_vm_data_bytes"],
            "local_parameter_bytes": worker["local_parameter_bytes"],
        }
        for key, _ in MEASURES:
            base, peak = runtime[f"{key}_bytes"], loaded[f"peak_{key}_bytes"]
            row[f"runtime_{key}"], row[f"loading_{key}"] = base, peak
            row[f"above_{key}"] = peak - base
            row[f"ratio_{key}"] = (peak - base) / weights_bytes
            # The question of the benchmark: below the runtime plus the whole model's weights?
            row[f"below_{key}"] = peak < base + weights_bytes
        rows.append(row)
    return rows


def mib(value: float) -> str:
    return f"{value / MIB:,.0f}"


def table(rows: List[Dict[str, Any]]) -> str:
    """A markdown table: one row per worker and variant; per measure the loading peak, what it adds
    to the runtime, that over the weights, and whether it stays below runtime + weights."""
    header = "| backend | `init_on_meta` | malloc | worker |" + "".join(
        f" runtime {name} | loading peak {name} (above runtime) | x weights | below |" for _, name in MEASURES
    )
    lines = [header + " peak VmData through the step |", "|" + "---|" * 4 + "---:|" * (4 * len(MEASURES) + 1)]
    for row in rows:
        cells = [row["backend"], "yes" if row["init_on_meta"] else "no", setting(row["mmap_threshold"])]
        cells.append(str(row["worker"]))
        for key, _ in MEASURES:
            cells += [
                mib(row[f"runtime_{key}"]),
                f"{mib(row[f'loading_{key}'])} ({mib(row[f'above_{key}'])})",
                f"{row[f'ratio_{key}']:.2f}",
                "yes" if row[f"below_{key}"] else "**no**",
            ]
        cells.append(mib(row["run_vm_data"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def conclusions(rows: List[Dict[str, Any]], weights: int) -> List[str]:
    """What the table shows, in words and numbers taken from it: per backend and measure."""
    lines = []
    for backend, threshold in dict.fromkeys((row["backend"], row["mmap_threshold"]) for row in rows):
        meta = [
            r
            for r in rows
            if (r["backend"], r["mmap_threshold"]) == (backend, threshold) and r["init_on_meta"]
        ]
        eager = [
            r
            for r in rows
            if r["backend"] == backend and r["mmap_threshold"] is None and not r["init_on_meta"]
        ]
        if not meta or not eager:
            continue
        label = backend if threshold is None else f"{backend} with {setting(threshold)}"
        parts = []
        for key, name in MEASURES:
            worst_meta = max(r[f"above_{key}"] for r in meta)
            worst_eager = max(r[f"above_{key}"] for r in eager)
            below = sum(r[f"below_{key}"] for r in meta)
            parts.append(
                f"{name} {mib(worst_meta)} MiB ({worst_meta / weights:.2f} x the weights; below runtime + "
                f"weights on {below} of {len(meta)} workers) against {mib(worst_eager)} MiB "
                f"({worst_eager / weights:.2f}) without it"
            )
        lines.append(
            f"- **{label}**, the most a worker rose above its runtime while loading with `init_on_meta`: "
            + "; ".join(parts)
            + "."
        )
    return lines


def markdown(data: Dict[str, Any]) -> str:
    model, rows = data["model"], data["rows"]
    weights = model["weights_bytes"]
    shape = ", ".join(f"{k} {v}" for k, v in model["shape"].items())
    environment = data["environment"]
    versions = ", ".join(
        f"{k} {environment[k]}" for k in ("python", "torch", "fairscale", "ai2-tango", "transformers")
    )
    walls = ", ".join(
        f"{r['backend']} {'with' if r['init_on_meta'] else 'without'} `init_on_meta`"
        + ("" if r.get("mmap_threshold") is None else f" ({setting(r['mmap_threshold'])})")
        + f" {r['wall_s']:.0f} s"
        for r in data["records"]
    )
    return "\n".join(
        [
            "# Loading a pretrained model: peak memory per worker",
            "",
            f"Generated by `{data['command']}` on {data['date']}.",
            "",
            f"- **Machine:** {environment['machine']}; {versions}.",
            f"- **Model:** GPT-2 ({shape}), {model['parameters'] / 1e6:.1f} M parameters, random weights "
            f"saved with `save_pretrained`: **{mib(weights)} MiB of weights** (`model.safetensors`, the "
            "tied LM head stored once).",
            f"- **Runs:** `tango run` of `fairscale::from_pretrained` on {WORLD_SIZE} CPU workers, one FSDP "
            "unit per `GPT2Block`, one AdamW step of "
            f"{BATCH_SIZE} x {SEQUENCE_LENGTH} tokens per worker and its checkpoint; wall time {walls}.",
            "",
            "Sizes in MiB, per worker. **Runtime**: the worker's memory right before its engine builds "
            "the model (its process group started): Python, PyTorch, Tango, FairScale, transformers' GPT-2 "
            "code (imported by every worker at its start, `-i`) and the data. **Loading peak**: the "
            "highest point from its start until the model is loaded and sharded and the engine built "
            "(before the first step). Three measures: **VmData**, the worker's private writable "
            "mappings, what `RLIMIT_DATA` (`ulimit -d`) limits, the unused extent of the heap and "
            "mappings never touched included; **RssAnon**, the private memory actually resident; both "
            "sampled every 5 ms (lower bounds of their peaks). **RSS**: the runtime's VmRSS and the "
            "kernel's exact high-water mark VmHWM, which also counts the pages of mapped files that the "
            "worker touched (the model's file: pages of the page cache, shared with the other worker). "
            "**x weights**: the loading peak above the runtime over the model's weights; **below**: "
            "whether the loading peak stayed below runtime + weights. **malloc**: the engine's own CPU "
            "mmap thresholds (2 MiB while the model is built and sharded, then 16 MiB for the fairscale "
            "backend's training and 2 MiB for the torch backend's), or `MALLOC_MMAP_THRESHOLD_` set in "
            "the run's environment, which the engine leaves alone.",
            "",
            table(rows),
            "",
            *conclusions(rows, weights),
            "",
            *READING,
        ]
    )


#: What the measures mean here, and where the memory goes (the mechanisms, not this run's numbers).
READING = [
    "## Reading it",
    "",
    "- **With `init_on_meta`** each worker builds the model on `meta`, then each unit in turn takes "
    "its tensors from `model.safetensors`, mapped read-only and shared (`fairscale::from_pretrained`), "
    "and is sharded: the private memory added is the worker's shards plus the unit being sharded "
    "(FairScale copies a unit into one flat parameter first, then keeps its shard; FSDP2 copies each "
    "parameter's shard out). The largest unit here is the root: the token embedding, tied to the LM "
    "head, 147 MiB of the 475.",
    "- **Without it**, `transformers`' own `from_pretrained` loads the whole model on every worker "
    "from a private, writable mapping of the file: its pages are the page cache's until written, so "
    "RssAnon stays low, but VmData (and `RLIMIT_DATA`) counts the whole mapping, and the units' copies "
    "come on top.",
    "- **RSS** counts the file's pages a worker touched: FairScale's flattening reads every unit "
    "whole, FSDP2 only this worker's half of each parameter. They are the page cache's, shared by the "
    "workers and dropped under memory pressure, not the worker's own: RSS of both variants is above "
    "runtime + weights for that reason alone.",
    "- **VmData** also counts the extent of the heap, holes included. While the model is built the "
    "engine serves allocations of 2 MiB and more with their own mappings, so each shard, which lives "
    "as long as the run, does not settle in the heap between the unit-sized tensors freed around it. "
    "With the fairscale backend's training threshold (16 MiB) during the build as well, each block's "
    "13.5 MiB shard came from the heap: VmData rose 1.38 x the weights (a probe of "
    "`/proc/self/smaps` after loading: 382 MiB of heap mapped, 185 MiB resident).",
    "",
]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (for the tests)")
    parser.add_argument("--backends", default="fairscale,torch", help="comma-separated: fairscale, torch")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where the model is saved (default: a temporary directory)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="write the records here (e.g. benchmarks/results/pretrained-memory.json)",
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="write the markdown page here (e.g. docs/pretrained-memory.md)",
    )
    parser.add_argument("--timeout", type=float, default=1200, help="seconds allowed per run")
    parser.add_argument("--keep", action="store_true", help="keep the runs' workspaces")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"fairscale", "torch"}
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}: use fairscale, torch")

    scratch = Path(tempfile.mkdtemp(prefix="pretrained-memory-"))
    try:
        model = make_model(SHAPES["quick" if args.quick else "gpt2"], args.model_dir or scratch / "model")
        size = f"{model['parameters'] / 1e6:.1f} M parameters, {mib(model['weights_bytes'])} MiB of weights"
        print(f"model: {size}")
        records, rows = [], []
        for backend, init_on_meta, threshold in VARIANTS:
            if backend not in backends:
                continue
            print(f"{backend}, init_on_meta={init_on_meta}, malloc: {setting(threshold)} ...", flush=True)
            record = run_variant(backend, init_on_meta, threshold, model, scratch, args.timeout, args.keep)
            records.append(record)
            rows += summarize(record, model["weights_bytes"])
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    command = "python benchmarks/pretrained_memory.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    data = {
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "environment": host_environment(),
        "model": model,
        "records": records,
        "rows": rows,
    }
    print(table(rows))
    print("\n".join(conclusions(rows, model["weights_bytes"])))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
