"""
The GPU mode of the benchmarks: this plugin's engine on one GPU (NCCL, world size 1) training a
GPT-2 of about 350 M parameters (GPT-2 medium's shape; ``--model llama``: a Llama of 1.1 B
parameters, TinyLlama-1.1B's shape, with SDPA attention) in float32, with AMP (float16 autocast
and FairScale's ShardedGradScaler), with AMP plus FSDP ``mixed_precision`` (parameters gathered
and computed in float16, float32 master copies), the same in bfloat16, and the torch backend
(FSDP2) in float32 and bfloat16 mixed precision; the ``*_compiled`` configurations again with each
block compiled (``with_wrapped_modules``' ``compile: true``); and, as baselines, the same model and
steps without the engine (``plain_*``: a plain module, torch's autocast and GradScaler), eager and
with the same blocks compiled the same way (``plain_*_compiled``). Per configuration: peak CUDA
memory, median step time, tokens per second, model FLOPs utilisation (MFU), the warm-up steps'
time (a compiled configuration's compile, from an empty inductor cache) and tokens/s over the plain
configuration of the same precision and compile setting ("x plain").

    python benchmarks/run.py --gpu [--model {gpt2,llama}] [--quick] [--configs A,B] [--json PATH]
        [--markdown PATH] [--peak-tflops N]

The published run: ``--json benchmarks/results/benchmarks-gpu.json --markdown docs/benchmarks-gpu.md``.

Each configuration runs in a fresh process, so that the CUDA memory high-water mark, the process
group and the compile caches are its own. ``--device cpu`` runs the same harness on a CPU worker
(gloo), where the float32 configurations apply (``fp32``, ``fp32_compiled``, ``torch_fp32``,
``plain_fp32``, ``plain_fp32_compiled``): the test suite uses it to check the harness without a GPU.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Set

import torch
from tango.integrations.torch import Model

REPO = Path(__file__).resolve().parent.parent

MODELS = {
    # GPT-2 medium's shape: 24 layers, width 1024, 16 heads; 355 M parameters with a 50257 vocabulary.
    "full": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50257, "n_positions": 1024},
    "quick": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "n_positions": 32},
}

#: ``--model llama``: ``transformers``' ``LlamaConfig`` fields (``max_position_embeddings`` is the
#: sequence length). ``full``: TinyLlama-1.1B's shape, 1,100,048,384 parameters (untied input and
#: output embeddings, as TinyLlama's), at 1024 tokens (batch 4: :func:`defaults`); ``quick``: a tiny
#: one with the same structure (grouped-query attention, untied embeddings) for the CPU.
LLAMA_MODELS = {
    "full": {
        "num_hidden_layers": 22,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
    },
    "quick": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 32,
        "tie_word_embeddings": False,
    },
}

#: The block class of each model family: one FSDP unit each, and what ``*_compiled`` compiles.
BLOCKS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}

#: Keys of a configuration's first dict that are this benchmark's, not engine options.
OWN_OPTIONS = ("plain", "compile")

BF16_AMP = {"amp": True, "amp_use_bfloat16": True}
BF16_MIXED_PRECISION = {"mixed_precision": True, "compute_dtype": "bfloat16"}

#: name -> (engine options, FSDP options shared by the engine and every unit); ``compile``: each
#: block compiled, ``plain``: no engine (both this benchmark's own keys, :data:`OWN_OPTIONS`).
CONFIGS: Dict[str, Any] = {
    "fp32": ({}, {}),
    "amp": ({"amp": True, "amp_use_bfloat16": False}, {}),
    "amp_mixed_precision": ({"amp": True, "amp_use_bfloat16": False}, {"mixed_precision": True}),
    "bf16_mixed_precision": (BF16_AMP, BF16_MIXED_PRECISION),
    # The same model under the torch backend (FSDP2's fully_shard per block).
    "torch_fp32": ({"backend": "torch"}, {}),
    "torch_bf16_mixed_precision": ({"backend": "torch", **BF16_AMP}, BF16_MIXED_PRECISION),
    # Each block compiled: with_wrapped_modules(compile=True), which the engine's backend applies
    # (tango_fairscale.compiling.compile_unit: torch.compile of the block's own forward, inductor,
    # default options) before the block becomes an FSDP unit.
    "fp32_compiled": ({"compile": True}, {}),
    "bf16_mixed_precision_compiled": ({**BF16_AMP, "compile": True}, BF16_MIXED_PRECISION),
    "torch_bf16_mixed_precision_compiled": (
        {"backend": "torch", **BF16_AMP, "compile": True},
        BF16_MIXED_PRECISION,
    ),
    # The baselines: the same model and steps without the engine, FSDP or a process group (a plain
    # module, torch's autocast and GradScaler), against which the engine's overhead is read.
    "plain_fp32": ({"plain": True}, {}),
    "plain_amp": ({"plain": True, "amp": True, "amp_use_bfloat16": False}, {}),
    "plain_bf16": ({"plain": True, **BF16_AMP}, {}),
    # ... and with the same blocks compiled the same way (compile_blocks), for the compiled rows.
    "plain_fp32_compiled": ({"plain": True, "compile": True}, {}),
    "plain_bf16_compiled": ({"plain": True, **BF16_AMP, "compile": True}, {}),
}

#: The compute dtype of each configuration's matmuls, whose peak its MFU is against.
DTYPES = {
    "fp32": "float32",
    "amp": "float16",
    "amp_mixed_precision": "float16",
    "bf16_mixed_precision": "bfloat16",
    "torch_fp32": "float32",
    "torch_bf16_mixed_precision": "bfloat16",
    "fp32_compiled": "float32",
    "bf16_mixed_precision_compiled": "bfloat16",
    "torch_bf16_mixed_precision_compiled": "bfloat16",
    "plain_fp32": "float32",
    "plain_amp": "float16",
    "plain_bf16": "bfloat16",
    "plain_fp32_compiled": "float32",
    "plain_bf16_compiled": "bfloat16",
}


def baseline_of(name: str) -> Optional[str]:
    """
    The plain configuration whose tokens/s a configuration's "x plain" is over: the same precision
    (float32; float16 AMP, with or without ``mixed_precision``; bfloat16) and compile setting, either
    backend; None for a plain one. It may not be among :data:`CONFIGS` (``plain_amp_compiled``).
    """
    options = CONFIGS[name][0]
    if options.get("plain"):
        return None
    if not options.get("amp"):
        precision = "fp32"
    else:
        precision = "bf16" if options.get("amp_use_bfloat16") else "amp"
    return f"plain_{precision}" + ("_compiled" if options.get("compile") else "")


def llama_config(fields: Dict[str, Any]) -> Any:
    """The ``LlamaConfig`` of :data:`LLAMA_MODELS` ``fields``: SDPA attention, no key-value cache."""
    from transformers import LlamaConfig

    return LlamaConfig(**fields, attn_implementation="sdpa", use_cache=False)


class LlamaLanguageModel(Model):
    """
    ``transformers``' ``LlamaForCausalLM`` built from :func:`llama_config` (RMSNorm, SiLU-gated MLP,
    rotary positions, grouped-query attention through ``scaled_dot_product_attention``), randomly
    initialised, as a Tango :class:`~tango.integrations.torch.Model`: ``{"loss": ...}``.
    """

    def __init__(self, **fields: Any) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.llama = LlamaForCausalLM(llama_config(fields))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"loss": self.llama(input_ids=input_ids, labels=labels).loss}


class ModelSpec(NamedTuple):
    """The model of a run: its family (``--model``), its fields and whether it is ``--quick``'s."""

    family: str
    shape: Dict[str, Any]
    quick: bool

    @property
    def block(self) -> str:
        return BLOCKS[self.family]

    @property
    def sequence_length(self) -> int:
        return int(self.shape["max_position_embeddings" if self.family == "llama" else "n_positions"])

    @property
    def vocab_size(self) -> int:
        return int(self.shape["vocab_size"])

    @property
    def n_layer(self) -> int:
        return int(self.shape["num_hidden_layers" if self.family == "llama" else "n_layer"])

    @property
    def attention_width(self) -> int:
        """The width of the attention's query and output (heads x head size): ``d`` of 12 L d T."""
        return int(self.shape["hidden_size" if self.family == "llama" else "n_embd"])

    def build(self) -> Any:
        if self.family == "llama":
            return LlamaLanguageModel(**self.shape)
        from examples.train_gpt2.components import GPT2LanguageModel

        return GPT2LanguageModel(dropout=0.0, **self.shape)

    def describe(self, parameters: int) -> str:
        """The model, for the page: its name, parameter count and shape."""
        count = f"{parameters / 1e6:,.1f} M parameters, {parameters:,}"
        s = self.shape
        if self.family == "llama":
            name = "A tiny Llama (`--quick`)" if self.quick else "A Llama of TinyLlama-1.1B's shape"
            ties = "tied" if s.get("tie_word_embeddings") else "untied"
            return (
                f"{name}, `transformers`' `LlamaForCausalLM` with SDPA attention ({count}; "
                f"{s['num_hidden_layers']} layers, width {s['hidden_size']}, MLP {s['intermediate_size']}, "
                f"{s['num_attention_heads']} heads, {s['num_key_value_heads']} key-value heads, "
                f"vocabulary {s['vocab_size']:,}, {ties} input and output embeddings)"
            )
        name = "A tiny GPT-2 (`--quick`)" if self.quick else "GPT-2 medium"
        return f"{name} ({count}; {s['n_layer']} layers, width {s['n_embd']}, vocabulary {s['vocab_size']:,})"


def model_spec(family: str, quick: bool) -> ModelSpec:
    """The model of ``--model family`` (``gpt2`` or ``llama``), ``--quick``'s tiny one or the full one."""
    shapes = LLAMA_MODELS if family == "llama" else MODELS
    return ModelSpec(family, shapes["quick" if quick else "full"], quick)


def compile_blocks(model: Any, block: str) -> List[str]:
    """
    Compile ``model``'s ``block`` modules in place as the engine's backends do under
    ``with_wrapped_modules``' ``compile: true``: the same plan (:class:`~tango_fairscale.wrapping.WrapPlan`
    of ``wrap_module_classes=[block]``, its innermost selected modules) and the same function,
    :func:`~tango_fairscale.compiling.compile_unit` with the default ``CompileConfig()`` (what
    ``true`` means), which replaces each block's own ``forward`` with ``torch.compile`` of it; the
    module, its hooks and its parameter names stay. The names of the blocks compiled.
    """
    from tango_fairscale.compiling import CompileConfig, compile_unit
    from tango_fairscale.wrapping import WrapPlan

    config = CompileConfig()
    plan = WrapPlan.build(model, wrap_module_classes=[block], fsdp=False, compile=config)
    for name in plan.compiled:
        compile_unit(model.get_submodule(name), config, name)
    return list(plan.compiled)


class PlainTraining:
    """
    A ``plain_*`` configuration's training: the engine's ``forward_train``/``backward``/``step``
    on a plain module, with torch's autocast and (float16) GradScaler, and no process group.
    """

    def __init__(self, model: Any, device: str, amp: bool = False, amp_use_bfloat16: bool = False) -> None:
        self.device = device
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.amp_dtype = (torch.bfloat16 if amp_use_bfloat16 else torch.float16) if amp else None
        use_scaler = amp and not amp_use_bfloat16
        self.grad_scaler = torch.amp.GradScaler(device) if use_scaler else None

    def forward_train(self, batch: Dict[str, Any], micro_batch_idx: int, num_micro_batches: int) -> Any:
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
    from tango_fairscale.telemetry.peaks import gpu_peak

    peak = gpu_peak(device_name, getattr(torch, dtype), tf32=tf32)
    return None if peak.flops_per_second is None else peak.flops_per_second / 1e12


def matmul_parameters(model: Any) -> int:
    """
    Parameters that take part in matrix multiplications: every 2-D weight except those only looked
    up, the weights of embedding modules (``nn.Embedding``): GPT-2's position embeddings (``wpe``),
    and a Llama's token embeddings (``embed_tokens``) when they are untied from its output head, as
    in TinyLlama and :data:`LLAMA_MODELS`. The output head (``lm_head``) is a matmul; a weight it
    shares with the token embeddings (tied: GPT-2's ``wte``, a Llama with ``tie_word_embeddings``)
    counts once, as the head. So a Llama's count is the same tied or untied: its layers' weights and
    the head. Norms' weights (1-D) are not matmuls either.
    """
    lookups: Set[int] = set()
    matmuls: Set[int] = set()
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            (lookups if isinstance(module, torch.nn.Embedding) else matmuls).add(id(parameter))
    # model.parameters() gives a shared (tied) parameter once.
    return sum(
        parameter.numel()
        for parameter in model.parameters()
        if parameter.dim() == 2 and (id(parameter) in matmuls or id(parameter) not in lookups)
    )


def training_flops_per_token(matmul_params: int, n_layer: int, n_embd: int, sequence_length: int) -> int:
    """
    Model FLOPs of one training token (forward and backward, no activation recomputation):
    2 per multiply-add of every weight forward and twice that backward (6 N, N from
    :func:`matmul_parameters`), plus attention's two T x d products per layer, 4 T d forward and
    8 T d backward (12 L d T; ``n_embd`` is the attention's width, heads x head size, a Llama's
    ``hidden_size``, whatever its key-value heads; causal masking is not subtracted, as in
    ``FlopCounterMode``'s count of SDPA).
    """
    return 6 * matmul_params + 12 * n_layer * n_embd * sequence_length


def measure(name: str, settings: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``settings["steps"]`` steps of configuration ``name`` in this process; its figures."""
    import torch.distributed as dist
    from tango.common import Lazy
    from tango.integrations.torch import Optimizer, TrainConfig

    from benchmarks.common import state_bytes
    from tango_fairscale import FairScaleTrainingEngine, FSDPConfig, with_wrapped_modules
    from tango_fairscale.compiling import stats as compiling_stats

    engine_options, fsdp_options = CONFIGS[name]
    plain = bool(engine_options.get("plain"))
    compiled = bool(engine_options.get("compile"))
    options = {key: value for key, value in engine_options.items() if key not in OWN_OPTIONS}
    cuda = settings["device"] == "cuda"
    device = "cuda" if cuda else "cpu"
    spec = model_spec(settings.get("model", "gpt2"), settings["quick"])
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
        matmul_params = matmul_parameters(spec.build())

    def build() -> Any:
        # Called by the engine once the process group exists (FSDP units need one), with
        # parameters on the meta device: each unit is materialised on the GPU as it is wrapped
        # (and, with compile, its forward compiled first).
        return with_wrapped_modules(
            spec.build(),
            wrap_module_classes=[spec.block],
            fsdp_config=FSDPConfig(**fsdp_options),
            compile=compiled,
        )

    torch.manual_seed(0)
    engine: Any
    if plain:
        with torch.device(device):
            model = spec.build()
        if compiled:
            compile_blocks(model, spec.block)
        engine = PlainTraining(model, device, **options)
    else:
        engine = FairScaleTrainingEngine(
            train_config,
            Lazy(build, constructor_extras={}),  # type: ignore[arg-type]
            Lazy(Optimizer.by_name("torch::AdamW"), constructor_extras={"lr": 1e-4}),  # type: ignore[arg-type]
            fsdp_config=FSDPConfig(**fsdp_options),
            init_on_meta=True,
            **options,
        )
    sequence_length = spec.sequence_length
    peak = settings.get("peak_tflops")
    if peak is None and not cuda:
        # A CPU worker: its matmul measured in float32 (the float32 configurations are the only
        # ones on CPU).
        from tango_fairscale.telemetry.peaks import measure_cpu_peak

        cpu_peak = measure_cpu_peak(torch.float32).flops_per_second
        peak = None if cpu_peak is None else cpu_peak / 1e12
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(spec.vocab_size, (settings["batch_size"], sequence_length), generator=generator)
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
    warmup = settings["warmup"]
    measured = step_times[warmup:] or step_times
    step_time = statistics.median(measured)
    tokens_per_s = settings["batch_size"] * sequence_length / step_time
    flops_per_token = training_flops_per_token(
        matmul_params, spec.n_layer, spec.attention_width, sequence_length
    )
    record: Dict[str, Any] = {
        "config": name,
        "model": spec.family,
        "compiled": compiled,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "backend": dist.get_backend() if dist.is_initialized() else "none",
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "matmul_parameters": matmul_params,
        "state_bytes": state_bytes(engine),
        "step_time_s": step_time,
        "step_times_s": step_times,
        # The warm-up steps' wall time (a compiled configuration's compile of forward and backward,
        # from an empty inductor cache, is in its first step) and what it took beyond steady steps.
        "warmup_s": sum(step_times[:warmup]),
        "warmup_excess_s": sum(step_times[:warmup]) - warmup * step_time,
        "losses": losses,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "achieved_tflops": flops_per_token * tokens_per_s / 1e12,
        "mfu": flops_per_token * tokens_per_s / (peak * 1e12) if peak else None,
        "peak_tflops": peak,
        "grad_scaler": type(engine.grad_scaler).__name__ if engine.grad_scaler is not None else None,
    }
    if compiled:
        # The package's own count (compiling.stats): the block calls that compiled (forward graphs;
        # the backward compiles in the first backward, inside the first step's time), blocks that
        # compiled more than once, and any that fell back to eager.
        record["compile"] = compiling_stats().as_dict()
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


def defaults(quick: bool, family: str = "gpt2") -> Dict[str, int]:
    """
    Steps, warm-up steps and batch size when not given. The full Llama's batch is 4 sequences of
    1024 tokens, so that float32 fits an 80 GiB GPU whichever SDPA kernel the torch release picks for
    float32 grouped-query attention (flash attention needs 16-bit inputs): the memory-efficient one
    where it takes grouped-query attention, or else the math one, which keeps each layer's attention
    weights for backward (0.5 GiB per layer at batch 4, 1 GiB at 8). Estimated, not yet measured on a
    GPU: 18 GiB of parameters, gradients and AdamW state, and about 17 GiB of activations at batch 4
    (math kernel: about 11 GiB more).
    """
    batch_size = 2 if quick else 4 if family == "llama" else 8
    return {"steps": 4 if quick else 12, "warmup": 1 if quick else 3, "batch_size": batch_size}


def reproduce(settings: Dict[str, Any]) -> str:
    """The command line of a run with these settings (what differs from the defaults)."""
    words = ["python", "benchmarks/run.py", "--gpu"]
    if settings.get("device", "cuda") != "cuda":
        words += ["--device", settings["device"]]
    if settings["quick"]:
        words.append("--quick")
    if settings.get("model", "gpt2") != "gpt2":
        words += ["--model", settings["model"]]
    configs = settings.get("configs")
    if configs and configs != list(CONFIGS):
        words += ["--configs", ",".join(configs)]
    for key, value in defaults(settings["quick"], settings.get("model", "gpt2")).items():
        if settings.get(key, value) != value:
            words += [f"--{key.replace('_', '-')}", str(settings[key])]
    if settings.get("peak_tflops"):
        words += ["--peak-tflops", f"{settings['peak_tflops']:g}"]
    return " ".join(words)


def markdown(
    records: List[Dict[str, Any]],
    skipped: Dict[str, str],
    env: Dict[str, Any],
    settings: Dict[str, Any],
    failed: Optional[Dict[str, str]] = None,
) -> str:
    spec = model_spec(settings.get("model", "gpt2"), settings["quick"])
    parameters = records[0]["parameters"] if records else 0
    # The engine's process group (a plain row has none).
    backend = next((r["backend"] for r in records if r["backend"] != "none"), "?")
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
        f"{spec.describe(parameters)}, sequence length {spec.sequence_length}, batch "
        f"{settings['batch_size']}, AdamW, this plugin's engine on world size 1 "
        f"({backend}), one FSDP unit per block (`{spec.block}`) "
        "(`plain_*`: the same model and steps without the engine, FSDP or a process group: torch's "
        "autocast and GradScaler on a plain module). `*_compiled`: each block's own `forward` "
        "compiled by `torch.compile` (inductor, default options), in the engine by "
        "`with_wrapped_modules`' `compile: true` before the block becomes an FSDP unit, in "
        "`plain_*_compiled` by the same function on the plain module's blocks "
        "(`tango_fairscale.compiling.compile_unit`). "
        f"{settings['steps']} steps, median step time after {settings['warmup']} warm-up steps; "
        '"warm-up" is those steps\' total time, which for a compiled row includes compiling its forward '
        "and backward from an empty inductor cache (each configuration runs in its own process with "
        "its own cache). MFU is model FLOPs (6 N + 12 L d T per token, N the parameters in matrix "
        "multiplies: every 2-D weight but the embeddings that are only looked up, the output head "
        f'counted once) per second over {against}. "x fp32" ratios are to `fp32`; "x plain" is '
        "tokens/s over the `plain_*` row of the same precision and compile setting (`fp32` and "
        "`torch_fp32` over `plain_fp32`, float16 AMP over `plain_amp`, bfloat16 over `plain_bf16`, a "
        "`*_compiled` row over `plain_fp32_compiled` or `plain_bf16_compiled`).",
        "",
        "| | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in env.items()],
        "",
        f"Reproduce: `{reproduce(settings)}`",
        "",
        "| config | peak memory | x fp32 | step time | tokens/s | x fp32 | achieved TFLOP/s "
        "| peak TFLOP/s | MFU | x plain | warm-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    memory_key = "peak_cuda_bytes" if settings["device"] == "cuda" else "peak_rss_bytes"
    by_name = {r["config"]: r for r in records}
    reference = by_name.get("fp32")
    for r in records:
        memory_ratio = f"{r[memory_key] / reference[memory_key]:.3f}" if reference else "-"
        speed_ratio = f"{r['tokens_per_s'] / reference['tokens_per_s']:.3f}" if reference else "-"
        mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "-"
        peak = f"{r['peak_tflops']:g}" if r.get("peak_tflops") else "unknown"
        baseline = by_name.get(baseline_of(r["config"]) or "")
        plain_ratio = f"{r['tokens_per_s'] / baseline['tokens_per_s']:.3f}" if baseline else "-"
        lines.append(
            f"| `{r['config']}` | {r[memory_key] / 2**30:.2f} GiB | {memory_ratio} "
            f"| {r['step_time_s']:.3f} s | {r['tokens_per_s']:,.0f} | {speed_ratio} "
            f"| {r['achieved_tflops']:.1f} | {peak} | {mfu} | {plain_ratio} | {r['warmup_s']:.1f} s |"
        )
    for name, why in skipped.items():
        lines.append(f"| `{name}` | skipped: {why} | | | | | | | | | |")
    for name, why in (failed or {}).items():
        lines.append(f"| `{name}` | FAILED: {why.replace('|', '/')} | | | | | | | | | |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    """Run every GPU configuration, each in its own process; write and print the results."""
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
    names = [c for c in args.configs.split(",") if c] if args.configs else list(CONFIGS)
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        print(f"error: unknown GPU configs {unknown}; choose from {list(CONFIGS)}", file=sys.stderr)
        return 2
    family = getattr(args, "model", "gpt2")
    default = defaults(args.quick, family)
    settings = {
        "device": device,
        "model": family,
        "quick": args.quick,
        "steps": args.steps or default["steps"],
        "warmup": args.warmup if args.warmup is not None else default["warmup"],
        "batch_size": args.batch_size or default["batch_size"],
        "peak_tflops": peak,
        "configs": names,
    }
    records: List[Dict[str, Any]] = []
    skipped: Dict[str, str] = {}
    failed: Dict[str, str] = {}
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
        # An empty inductor cache (and Triton's, inside it) for each configuration: every compiled
        # one pays the whole compile in its warm-up, whichever ran before it.
        cache = tempfile.mkdtemp(prefix=f"tango-fairscale-gpu-inductor-{name}-")
        env = {
            **{key: value for key, value in os.environ.items() if key != "TRITON_CACHE_DIR"},
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "TORCHINDUCTOR_CACHE_DIR": cache,
        }
        try:
            result = subprocess.run(
                [sys.executable, "-m", "benchmarks.gpu", name, json.dumps(one)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
        finally:
            shutil.rmtree(cache, ignore_errors=True)
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
        print(
            f"{record['tokens_per_s']:,.0f} tokens/s, step {record['step_time_s']:.3f} s, "
            f"warm-up {record['warmup_s']:.1f} s",
            flush=True,
        )
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
