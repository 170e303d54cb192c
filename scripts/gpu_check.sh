#!/usr/bin/env bash
# The checks to run first on a GPU machine, in one go: `pytest -m gpu`, then the GPU benchmarks
# (`benchmarks/run.py --gpu`), each log and result written to OUTDIR. Exits non-zero when either
# fails. The float32 configurations of the benchmark peak at about 31 GiB of GPU memory: on a
# smaller GPU they are reported as failed (GPU_BENCHMARK_ARGS=--quick runs a tiny model instead).
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
timeout "${GPU_TESTS_TIMEOUT:-300}" "$python" -m pytest -m gpu -v -rs -p no:cacheprovider --durations=0 \
    2>&1 | tee "$out/pytest-gpu.log" || status=1
timeout "${GPU_BENCHMARK_TIMEOUT:-420}" "$python" benchmarks/run.py --gpu ${GPU_BENCHMARK_ARGS:-} --json "$out/gpu.json" \
    --markdown "$out/gpu.md" 2>&1 | tee "$out/benchmark-gpu.log" || status=1
exit $status
