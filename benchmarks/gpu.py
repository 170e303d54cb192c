"""
The GPU mode of the benchmarks: this plugin's engine on one GPU (NCCL, world size 1) training a
GPT-2 of about 350 M parameters (GPT-2 medium's shape) in float32, with AMP (float16 autocast
and FairScale's ShardedGradScaler), with AMP plus FSDP ``mixed_precision`` (parameters
gathered and computed in float16, float32 master copies), the same in bfloat16, and the torch
backend (FSDP2) in float32 and bfloat16 mixed precision; and, as baselines, the same model and
steps without the engine (``plain_*``: a plain module, torch's autocast and GradScaler). Per
configuration: peak CUDA memory, median step time, tokens per second and model FLOPs utilisation
(MFU).

    python benchmarks/run.py --gpu [--quick] [--json PATH] [--markdown PATH] [--peak-tflops N]

The published run: ``--json benchmarks/results/benchmarks-gpu.json --markdown docs/benchmarks-gpu.md``.

Each configuration runs in a fresh process, so that the CUDA memory high-water mark and the
process group are its own. ``--device cpu`` runs the same harness on a CPU worker (gloo), where
the float32 configurations apply (``fp32``, ``torch_fp32``, ``plain_fp32``): the test suite uses it
to check the harness without a GPU.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent

MODELS = {
    # GPT-2 medium's shape: 24 layers, width 1024, 16 heads; 355 M parameters with a 50257 vocabulary.
    "full": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50257, "n_positions": 1024},
    "quick": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "n_positions": 32},
}

#: name -> (engine options, FSDP options shared by the engine and every unit)
CONFIGS: Dict[str, Any] = {
    "fp32": ({}, {}),
    "amp": ({"amp": True, "amp_use_bfloat16": False}, {}),
    "amp_mixed_precision": ({"amp": True, "amp_use_bfloat16": False}, {"mixed_precision": True}),
    "bf16_mixed_precision": (
        {"amp": True, "amp_use_bfloat16": True},
        {"mixed_precision": True, "compute_dtype": "bfloat16"},
    ),
    # The same model under the torch backend (FSDP2's fully_shard per block).
    "torch_fp32": ({"backend": "torch"}, {}),
    "torch_bf16_mixed_precision": (
        {"backend": "torch", "amp": True, "amp_use_bfloat16": True},
        {"mixed_precision": True, "compute_dtype": "bfloat16"},
    ),
    # The baselines: the same model and steps without the engine, FSDP or a process group (a plain
    # module, torch's autocast and GradScaler), against which the engine's overhead is read.
    "plain_fp32": ({"plain": True}, {}),
    "plain_amp": ({"plain": True, "amp": True, "amp_use_bfloat16": False}, {}),
    "plain_bf16": ({"plain": True, "amp": True, "amp_use_bfloat16": True}, {}),
}

#: The compute dtype of each configuration's matmuls, whose peak its MFU is against.
DTYPES = {
    "fp32": "float32",
    "amp": "float16",
    "amp_mixed_precision": "float16",
    "bf16_mixed_precision": "bfloat16",
    "torch_fp32": "float32",
    "torch_bf16_mixed_precision": "bfloat16",
    "plain_fp32": "float32",
    "plain_amp": "float16",
    "plain_bf16": "bfloat16",
}


class PlainTraining:
    """
    A ``plain_*`` configuration's training: the engine's ``forward_train``/``backward``/``step``
    on a plain module, with torch's autocast and (float16) GradScaler, and no process group.
    """

    def __init__(self, model: Any, device: str, amp: bool = False, amp_use_bfloat16: bool = False) -> None:
        import torch

        self.device = device
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.amp_dtype = (torch.bfloat16 if amp_use_bfloat16 else torch.float16) if amp else None
        use_scaler = amp and not amp_use_bfloat16
        self.grad_scaler = torch.amp.GradScaler(device) if use_scaler else None

    def forward_train(self, batch: Dict[str, Any], micro_batch_idx: int, num_micro_batches: int) -> Any:
        import torch

        # Where Tango's engine clears the gradients: the last step's stay until the next one.
        if micro_batch_idx == 0:
            self.optimizer.zero_grad(set_to_none=True)
        batch = {key: value.to(self.device) for key, value in batch.items()}
        with torch.autocast(
            self.device, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None
        ):
            outputs = self.model(**batch)
        return outputs["loss"] / num_micro_batches, outputs

    def backward(self, loss: Any) -> None:
        (loss if self.grad_scaler is None else self.grad_scaler.scale(loss)).backward()

    def step(self) -> None:
        if self.grad_scaler is None:
            self.optimizer.step()
        else:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()


def peak_tflops_for(device_name: str, dtype: str = "float16", tf32: bool = False) -> Optional[float]:
    """
    The dense peak in TFLOP/s of a GPU named ``device_name`` for ``dtype`` (float32 on tensor cores
    with ``tf32``), from the package's table (:data:`tango_fairscale.telemetry.peaks.GPU_PEAK_TFLOPS`,
    which the metrics log uses too); None for a GPU the table lacks.
    """
    import torch

    from tango_fairscale.telemetry.peaks import gpu_peak

    peak = gpu_peak(device_name, getattr(torch, dtype), tf32=tf32)
    return None if peak.flops_per_second is None else peak.flops_per_second / 1e12


def matmul_parameters(model: Any) -> int:
    """
    Parameters that take part in matrix multiplications: every 2-D weight except the position
    embeddings, which are only looked up. GPT-2's token embeddings count once, as the output
    projection they are tied to.
    """
    seen = set()
    total = 0
    for name, parameter in model.named_parameters():
        if parameter.dim() == 2 and "wpe" not in name and id(parameter) not in seen:
            seen.add(id(parameter))
            total += parameter.numel()
    return total


def training_flops_per_token(matmul_params: int, n_layer: int, n_embd: int, sequence_length: int) -> int:
    """
    Model FLOPs of one training token (forward and backward, no activation recomputation):
    2 per multiply-add of every weight forward and twice that backward (6 N), plus attention's
    two T x d products per layer, 4 T d forward and 8 T d backward (12 L d T).
    """
    return 6 * matmul_params + 12 * n_layer * n_embd * sequence_length


def measure(name: str, settings: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``settings["steps"]`` steps of configuration ``name`` in this process; its figures."""
    import torch
    import torch.distributed as dist
    from tango.common import Lazy
    from tango.integrations.torch import Optimizer, TrainConfig

    from benchmarks.common import state_bytes
    from examples.train_gpt2.components import GPT2LanguageModel
    from tango_fairscale import FairScaleTrainingEngine, FSDPConfig, with_wrapped_modules

    engine_options, fsdp_options = CONFIGS[name]
    cuda = settings["device"] == "cuda"
    model_shape = MODELS["quick" if settings["quick"] else "full"]
    work_dir = Path(tempfile.mkdtemp(prefix=f"tango-fairscale-gpu-{name}-"))
    train_config = TrainConfig(
        f"benchmark-{name}",
        work_dir,
        is_distributed=True,
        world_size=1,
        # -1 is Tango's CPU device: with None it would pick the GPU whenever there is one.
        devices=[0] if cuda else [-1],
        distributed_port=settings["port"],
    )
    with torch.device("meta"):
        matmul_params = matmul_parameters(GPT2LanguageModel(dropout=0.0, **model_shape))

    def build() -> Any:
        # Called by the engine once the process group exists (FSDP units need one), with
        # parameters on the meta device: each unit is materialised on the GPU as it is wrapped.
        return with_wrapped_modules(
            GPT2LanguageModel(dropout=0.0, **model_shape),
            wrap_module_classes=["GPT2Block"],
            fsdp_config=FSDPConfig(**fsdp_options),
        )

    torch.manual_seed(0)
    engine: Any
    if engine_options.get("plain"):
        with torch.device("cuda" if cuda else "cpu"):
            model = GPT2LanguageModel(dropout=0.0, **model_shape)
        options = {key: value for key, value in engine_options.items() if key != "plain"}
        engine = PlainTraining(model, "cuda" if cuda else "cpu", **options)
    else:
        engine = FairScaleTrainingEngine(
            train_config,
            Lazy(build, constructor_extras={}),  # type: ignore[arg-type]
            Lazy(Optimizer.by_name("torch::AdamW"), constructor_extras={"lr": 1e-4}),  # type: ignore[arg-type]
            fsdp_config=FSDPConfig(**fsdp_options),
            init_on_meta=True,
            **engine_options,
        )
    sequence_length = model_shape["n_positions"]
    peak = settings.get("peak_tflops")
    if peak is None and not cuda:
        # A CPU worker: its matmul measured in float32 (fp32 is the only configuration on CPU).
        from tango_fairscale.telemetry.peaks import measure_cpu_peak

        cpu_peak = measure_cpu_peak(torch.float32).flops_per_second
        peak = None if cpu_peak is None else cpu_peak / 1e12
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        model_shape["vocab_size"], (settings["batch_size"], sequence_length), generator=generator
    )
    batch = {"input_ids": tokens, "labels": tokens}

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    step_times: List[float] = []
    losses: List[float] = []
    for _ in range(settings["steps"]):
        synchronize()
        start = time.perf_counter()
        loss, _ = engine.forward_train(batch, 0, 1)
        engine.backward(loss)
        engine.step()
        synchronize()
        step_times.append(time.perf_counter() - start)
        losses.append(loss.item())
    measured = step_times[settings["warmup"] :] or step_times
    step_time = statistics.median(measured)
    tokens_per_s = settings["batch_size"] * sequence_length / step_time
    flops_per_token = training_flops_per_token(
        matmul_params, model_shape["n_layer"], model_shape["n_embd"], sequence_length
    )
    record: Dict[str, Any] = {
        "config": name,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "backend": dist.get_backend() if dist.is_initialized() else "none",
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "matmul_parameters": matmul_params,
        "state_bytes": state_bytes(engine),
        "step_time_s": step_time,
        "step_times_s": step_times,
        "losses": losses,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "achieved_tflops": flops_per_token * tokens_per_s / 1e12,
        "mfu": flops_per_token * tokens_per_s / (peak * 1e12) if peak else None,
        "peak_tflops": peak,
        "grad_scaler": type(engine.grad_scaler).__name__ if engine.grad_scaler is not None else None,
    }
    if cuda:
        record["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    else:
        import resource

        record["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if dist.is_initialized():
        dist.destroy_process_group()
    return record


def environment(device: str) -> Dict[str, Any]:
    """The accelerator, then the host and the versions that the CPU benchmarks record."""
    import torch

    from benchmarks.common import host_environment

    env: Dict[str, Any] = {}
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        env["device"] = f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB"
        env["cuda"] = torch.version.cuda
        env["tf32 matmul"] = torch.backends.cuda.matmul.allow_tf32
    else:
        env["device"] = "CPU"
    env.update(host_environment())
    return env


def markdown(
    records: List[Dict[str, Any]],
    skipped: Dict[str, str],
    env: Dict[str, Any],
    settings: Dict[str, Any],
    failed: Optional[Dict[str, str]] = None,
) -> str:
    shape = MODELS["quick" if settings["quick"] else "full"]
    parameters = records[0]["parameters"] if records else 0
    given = settings.get("peak_tflops")
    if given:
        against = f"the given peak ({given:g} TFLOP/s, every row)"
    elif settings["device"] == "cuda":
        against = (
            "the device's dense peak for the row's compute dtype (float16 under AMP; float32, or TF32 "
            "where `tf32 matmul` is on, otherwise), from the package's table of GPUs"
        )
    else:
        against = "a float32 matmul measured on the worker's threads"
    lines = [
        "# Benchmarks on one GPU",
        "",
        f"GPT-2 ({parameters / 1e6:.1f} M parameters; {shape['n_layer']} layers, width {shape['n_embd']}), "
        f"sequence length {shape['n_positions']}, batch {settings['batch_size']}, AdamW, this plugin's "
        f"engine on world size 1 ({records[0]['backend'] if records else '?'}), one FSDP unit per block "
        "(`plain_*`: the same model and steps without the engine, FSDP or a process group: torch's "
        "autocast and GradScaler on a plain module), "
        f"{settings['steps']} steps, median step time after {settings['warmup']} warm-up steps. MFU is "
        "model FLOPs (6 N + 12 L d T per token, N the parameters in matrix multiplies) per second over "
        f"{against}. Ratios are to `fp32`.",
        "",
        "| | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in env.items()],
        "",
        "Reproduce: `python benchmarks/run.py --gpu" + (" --quick" if settings["quick"] else "") + "`",
        "",
        "| config | peak memory | x fp32 | step time | tokens/s | x fp32 | achieved TFLOP/s "
        "| peak TFLOP/s | MFU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    memory_key = "peak_cuda_bytes" if settings["device"] == "cuda" else "peak_rss_bytes"
    reference = next((r for r in records if r["config"] == "fp32"), None)
    for r in records:
        memory_ratio = f"{r[memory_key] / reference[memory_key]:.3f}" if reference else "-"
        speed_ratio = f"{r['tokens_per_s'] / reference['tokens_per_s']:.3f}" if reference else "-"
        mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "-"
        peak = f"{r['peak_tflops']:g}" if r.get("peak_tflops") else "unknown"
        lines.append(
            f"| `{r['config']}` | {r[memory_key] / 2**30:.2f} GiB | {memory_ratio} "
            f"| {r['step_time_s']:.3f} s | {r['tokens_per_s']:,.0f} | {speed_ratio} "
            f"| {r['achieved_tflops']:.1f} | {peak} | {mfu} |"
        )
    for name, why in skipped.items():
        lines.append(f"| `{name}` | skipped: {why} | | | | | | | |")
    for name, why in (failed or {}).items():
        lines.append(f"| `{name}` | FAILED: {why.replace('|', '/')} | | | | | | | |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    """Run every GPU configuration, each in its own process; write and print the results."""
    import torch

    from benchmarks.common import free_port

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --gpu needs a CUDA GPU and none is visible to torch "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
            "Add --device cpu to check the harness on the CPU.",
            file=sys.stderr,
        )
        return 2
    peak = args.peak_tflops
    settings = {
        "device": device,
        "quick": args.quick,
        "steps": args.steps or (4 if args.quick else 12),
        "warmup": args.warmup if args.warmup is not None else (1 if args.quick else 3),
        "batch_size": args.batch_size or (2 if args.quick else 8),
        "peak_tflops": peak,
    }
    records: List[Dict[str, Any]] = []
    skipped: Dict[str, str] = {}
    failed: Dict[str, str] = {}
    names = [c for c in args.configs.split(",") if c] if args.configs else list(CONFIGS)
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        print(f"error: unknown GPU configs {unknown}; choose from {list(CONFIGS)}", file=sys.stderr)
        return 2
    for index, name in enumerate(names, 1):
        if device == "cpu" and CONFIGS[name][0].get("amp"):
            # float16 autocast with loss scaling is CUDA-only (the engine refuses it on CPU); the
            # bfloat16 ones would run, but a CPU worker's bfloat16 says nothing of a GPU's.
            skipped[name] = "float16 AMP needs CUDA" if DTYPES[name] == "float16" else "measured on CUDA only"
            continue
        print(f"[{index}/{len(names)}] {name} ...", end=" ", flush=True)
        one = {**settings, "port": free_port()}
        if peak is None and device == "cuda":
            # The peak of this configuration's compute dtype; None (MFU "-") for a GPU not in the table.
            one["peak_tflops"] = peak_tflops_for(
                torch.cuda.get_device_name(0), DTYPES[name], tf32=torch.backends.cuda.matmul.allow_tf32
            )
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        result = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu", name, json.dumps(one)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        if result.returncode != 0:
            # Reported, and the other configurations still run: a GPU machine's time is scarce.
            print("failed", flush=True)
            print(
                f"GPU config {name} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}",
                file=sys.stderr,
            )
            lines = [line.removeprefix("[rank0]: ") for line in result.stderr.strip().splitlines()]
            errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
            failed[name] = (errors or lines or ["no output"])[-1]
            continue
        record = json.loads(result.stdout.strip().splitlines()[-1])
        records.append(record)
        print(f"{record['tokens_per_s']:,.0f} tokens/s, step {record['step_time_s']:.3f} s", flush=True)
    env_info = environment(device)
    text = markdown(records, skipped, env_info, settings, failed)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "environment": env_info,
                    "settings": settings,
                    "records": records,
                    "skipped": skipped,
                    "failed": failed,
                },
                indent=2,
            )
        )
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    print()
    print(text)
    if failed:
        print(f"error: {len(failed)} GPU configuration(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # One configuration, in this fresh process: prints its record as the last line.
    print(json.dumps(measure(sys.argv[1], json.loads(sys.argv[2]))))
