#!/usr/bin/env bash
# The checks to run first on a GPU machine, in one go: `pytest -m gpu`, the one-device tests (a
# `tango run` of device_count 1, on the GPU there), then the GPU benchmarks (`benchmarks/run.py
# --gpu`), each log and result written to OUTDIR. Exits non-zero when any fails. The float32
# configurations of the benchmark peak at about 31 GiB of GPU memory: on a smaller GPU they are
# reported as failed (GPU_BENCHMARK_ARGS=--quick runs a tiny model instead). On one H200 the tests
# took 42 s and the benchmark about 200 s; the default time limits (200 + 60 + 330 s) keep the
# whole check under 10 minutes with an installation. GPU_LLAMA=1 adds the Llama's compiled-units
# benchmark (not yet run on a GPU; a limit of its own, 540 s), which takes the whole check past
# 10 minutes: where one command may take no longer, run this script once without it, then the
# Llama's benchmark line below as a command of its own.
# Where packages were installed with `pip install --target DIR` (wheels carried to a machine
# without network), put DIR/bin on the PATH: the tests that start `tango run` look for it there.
# Usage, from the project root:  scripts/gpu_check.sh OUTDIR   (PYTHON=... picks the interpreter)
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# The project's virtual environment where there is one (make install), else the PATH's python3.
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/device.txt"
"$python" - <<'PY' 2>&1 | tee -a "$out/device.txt"
import importlib.metadata as metadata
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPU", torch.cuda.is_available())
for name in ("ai2-tango", "fairscale", "transformers", "peft", "accelerate", "safetensors"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "missing")
PY
status=0
timeout "${GPU_TESTS_TIMEOUT:-200}" "$python" -m pytest -m gpu -v -rs -p no:cacheprovider --durations=0 \
    2>&1 | tee "$out/pytest-gpu.log" || status=1
timeout "${GPU_ONE_DEVICE_TIMEOUT:-60}" "$python" -m pytest -v -rs -p no:cacheprovider tests/test_one_device.py \
    2>&1 | tee "$out/pytest-one-device.log" || status=1
# GPT-2 medium in the nine eager configurations of the published run (docs/benchmarks-gpu.md):
# the compiled ones compile from an empty cache each and would not fit the time limit with them.
published=fp32,amp,amp_mixed_precision,bf16_mixed_precision,torch_fp32,torch_bf16_mixed_precision
published=$published,plain_fp32,plain_amp,plain_bf16
timeout "${GPU_BENCHMARK_TIMEOUT:-330}" "$python" benchmarks/run.py --gpu ${GPU_BENCHMARK_ARGS:---configs $published} \
    --json "$out/gpu.json" --markdown "$out/gpu.md" 2>&1 | tee "$out/benchmark-gpu.log" || status=1
# With GPU_LLAMA=1: the ~1.1 B Llama (SDPA attention) in bfloat16 mixed precision, eager and with
# compiled units, each against the plain module eager and compiled (the compiled-units check).
if [ "${GPU_LLAMA:-0}" = 1 ]; then
    llama=bf16_mixed_precision,bf16_mixed_precision_compiled,torch_bf16_mixed_precision
    llama=$llama,torch_bf16_mixed_precision_compiled,plain_bf16,plain_bf16_compiled
    timeout "${GPU_LLAMA_TIMEOUT:-540}" "$python" benchmarks/run.py --gpu --model llama --configs "$llama" \
        --json "$out/gpu-llama.json" --markdown "$out/gpu-llama.md" 2>&1 | tee "$out/benchmark-gpu-llama.log" \
        || status=1
fi
exit $status
