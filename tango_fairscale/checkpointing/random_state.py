"""
The random number generators of a worker, saved with each checkpoint and restored on resume, so
that a run killed and resumed draws what an uninterrupted run draws (dropout masks, random
augmentations): Python's ``random``, NumPy's global generator, torch's CPU generator and, where
CUDA is initialised, every CUDA device's.

Stored as tensors and plain numbers only, so the file loads with ``weights_only=True``.
"""

import random
from typing import Any, Dict

import torch


def capture() -> Dict[str, Any]:
    """This process's generator states."""
    version, internal, gauss = random.getstate()
    state: Dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        pass
    else:
        name, keys, position, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
        state["numpy"] = {
            "name": name,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: Dict[str, Any]) -> None:
    """Set this process's generators to a state :func:`capture` returned."""
    python = state["python"]
    random.setstate((python["version"], tuple(int(x) for x in python["state"].tolist()), python["gauss"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        saved = state["numpy"]
        np.random.set_state(
            (
                saved["name"],
                saved["keys"].numpy().astype(np.uint32),
                saved["position"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
