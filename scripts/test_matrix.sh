#!/usr/bin/env bash
# The default test selection (`make test`) on the oldest and the newest torch the package
# supports, each in a virtualenv of its own beside the default `.venv`: torch 2.11 on the oldest
# Python, torch 2.15 on the newest (`docs/compatibility.md`). A Python that is not on PATH is
# replaced by python3, and the line says so.
#
#   scripts/test_matrix.sh              # both legs
#   scripts/test_matrix.sh 2.15.0       # one leg
#
# Each leg installs its exact torch release (`TORCH_SPEC=torch==X`): a pip constraint configured
# on the machine (PIP_CONSTRAINT, pip.conf) would otherwise pick another release or refuse it,
# so the legs run with none. A bare torch install from PyPI is the CUDA build (several GB); it
# runs on the CPU as well.
set -euo pipefail
cd "$(dirname "$0")/.."

# torch release -> Python that runs it in the matrix.
declare -A PYTHON_FOR=([2.11.0]=3.11 [2.15.0]=3.13)
legs=("$@")
if [ ${#legs[@]} -eq 0 ]; then
    legs=(2.11.0 2.15.0)
fi

# A runnable interpreter of Python $1 (pythonX.Y on PATH, else a pyenv installation), or nothing.
find_python() {
    if "python$1" -c "" >/dev/null 2>&1; then
        echo "python$1"
        return
    fi
    if command -v pyenv >/dev/null 2>&1; then
        for candidate in "$(pyenv root)"/versions/"$1".*/bin/"python$1"; do
            if [ -x "$candidate" ]; then
                echo "$candidate"
                return
            fi
        done
    fi
}

for torch_release in "${legs[@]}"; do
    wanted="${PYTHON_FOR[$torch_release]:-3}"
    python="$(find_python "$wanted")"
    if [ -z "$python" ]; then
        echo "test_matrix: no Python $wanted here: torch $torch_release runs on python3 instead"
        python=python3
    fi
    venv=".venv-torch$torch_release"
    echo "test_matrix: torch $torch_release on $("$python" --version 2>&1) in $venv"
    start=$(date +%s)
    PIP_CONSTRAINT=/dev/null make test PYTHON="$python" VENV="$venv" TORCH_SPEC="torch==$torch_release"
    "$venv/bin/python" -c "import torch, sys; assert torch.__version__.startswith('$torch_release'), torch.__version__; print('test_matrix: torch', torch.__version__, 'kept; python', sys.version.split()[0])"
    echo "test_matrix: torch $torch_release done in $(( $(date +%s) - start )) s"
done
