"""
What the CPU benchmarks (``run.py``), the GPU mode (``gpu.py``) and the Tango components they run
(``components.py``) share: the host's description, a free port, a worker's model-state bytes, and
where the measurements go (``RESULTS``) and how a page in docs/ links its chart there.
Each of those modules imports from here, and none imports another.
"""

import os
import platform
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from tango.integrations.torch import TrainingEngine

from tango_fairscale.launch import free_port

__all__ = ["DOCS", "RESULTS", "chart_link", "free_port", "host_environment", "state_bytes"]

#: Where the benchmarks' measurements (``--json`` records, ``--chart`` PNGs) are kept; the pages that
#: report them (``--markdown``) are in ``DOCS``.
RESULTS = Path(__file__).resolve().parent / "results"
DOCS = RESULTS.parent.parent / "docs"


def chart_link(chart: Optional[Union[str, Path]], page: Optional[Union[str, Path]], name: str) -> str:
    """The image link of ``chart`` (default: ``name`` in ``RESULTS``) in a Markdown page at ``page``.

    Relative to the page's folder, or to ``DOCS`` for a page that is only printed.
    """
    target = Path(chart).resolve() if chart is not None else RESULTS / name
    folder = Path(page).resolve().parent if page is not None else DOCS
    return Path(os.path.relpath(target, folder)).as_posix()


def host_environment() -> Dict[str, Any]:
    import fairscale
    import transformers
    from tango.version import VERSION as tango_version

    memory = None
    if Path("/proc/meminfo").exists():
        first = Path("/proc/meminfo").read_text().splitlines()[0]
        memory = int(first.split()[1]) * 1024
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        names = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return {
        "machine": f"{cpu}, {os.cpu_count()} cores, {memory / 2**30:.0f} GiB" if memory else cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fairscale": fairscale.__version__,
        "ai2-tango": tango_version,
        "transformers": transformers.__version__,
    }


def state_bytes(engine: TrainingEngine) -> Dict[str, int]:
    parameters = list(engine.model.parameters())

    def nbytes(tensor: torch.Tensor) -> int:
        local = getattr(tensor, "_local_tensor", tensor)  # an FSDP2 DTensor: count this worker's shard
        return local.numel() * local.element_size()

    optimizer = sum(
        nbytes(value)
        for state in engine.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    return {
        "parameters": sum(nbytes(p) for p in parameters),
        "gradients": sum(nbytes(p.grad) for p in parameters if p.grad is not None),
        "optimizer_state": optimizer,
    }
