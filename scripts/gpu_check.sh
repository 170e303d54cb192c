#!/usr/bin/env bash
# The checks to run first on a GPU machine, in one go: `pytest -m gpu`, then the GPU benchmarks
# (`benchmarks/run.py --gpu`), each log and result written to OUTDIR. Exits non-zero when either
# fails. Usage, from the project root:  scripts/gpu_check.sh OUTDIR
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/device.txt"
python3 - <<'PY' 2>&1 | tee -a "$out/device.txt"
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
timeout "${GPU_TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -v -rs -p no:cacheprovider --durations=0 \
    2>&1 | tee "$out/pytest-gpu.log" || status=1
timeout "${GPU_BENCHMARK_TIMEOUT:-420}" python3 benchmarks/run.py --gpu --json "$out/gpu.json" \
    --markdown "$out/gpu.md" 2>&1 | tee "$out/benchmark-gpu.log" || status=1
exit $status
