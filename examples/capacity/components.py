"""
The pieces of the capacity example: the GPT-2 model and byte-level data steps of
``examples/train_gpt2``, and the training engines of the capacity benchmark
(``benchmarks/components.py``) that record each worker's memory: ``"benchmark::torch_limited"`` is
Tango's ``"torch"`` engine (DDP) and ``"benchmark::fairscale_limited"`` this plugin's
``"fairscale"`` engine. The budget is ``ulimit -d`` on the whole ``tango run`` (README.md), as in
the benchmark.
"""

import sys
from pathlib import Path

# `tango run` imports this file as `components` from this directory, where the repository's
# `examples` and `benchmarks` packages are not importable. The workers inherit sys.path.
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import benchmarks.components  # noqa: E402,F401  (the memory-limited engines)
import examples.train_gpt2.components  # noqa: E402,F401  (gpt2::from_config, gpt2::read_text, ...)
