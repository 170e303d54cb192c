"""
The optimizer's footprint, measured: the state it keeps and what its step allocates for a while,
per element of the tensors it updates, on a test parameter (:func:`optimizer_footprint`).
"""

import copy
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
from tango.common import Lazy, Params
from tango.integrations.torch import Optimizer

from .live_bytes import LiveTensorBytes
from .text import one_line


@dataclass
class OptimizerFootprint:
    """What an optimizer holds per element of the tensors it updates (:func:`optimizer_footprint`)."""

    state_bytes: Optional[float]
    """Bytes of state kept per element (8.0 for AdamW in float32); ``None``: unknown."""
    step_bytes: float = 0.0
    """The most bytes a step allocates for a while per element of the tensor it is updating."""
    all_at_once: bool = False
    """Whether the config asks for an implementation that updates all tensors at once (``foreach: true``)."""
    foreach_default: bool = False
    """Whether the optimizer has a ``foreach`` implementation that PyTorch picks by default on GPUs."""
    note: str = ""
    """Why :attr:`state_bytes` is unknown."""


def optimizer_footprint(optimizer: Dict[str, Any], flat: bool) -> OptimizerFootprint:
    """
    The optimizer's state and its step's temporaries per parameter element, measured: the
    config's optimizer is built on one float32 test parameter (1-D, as FairScale's flat shards are,
    when ``flat``) and takes two steps, and the state it then holds is counted (scalars such as
    the step count left out), and what the second step allocated for a while. So AdamW counts 8
    bytes of state, SGD with momentum 4, SGD without 0, and an optimizer this code never heard of
    its own. One that cannot be built or stepped this way is reported, never assumed.
    """
    name = optimizer.get("type")
    if not name:
        return OptimizerFootprint(None, note="the engine's config names no optimizer")
    parameter = nn.Parameter(torch.zeros(4096) if flat else torch.zeros(64, 64))
    try:
        built = Lazy(Optimizer, Params(copy.deepcopy(optimizer))).construct(params=[parameter])
        parameter.grad = torch.full_like(parameter, 1e-3)
        built.step()
        state = built.state.get(parameter, {})
        tensors = [value for value in state.values() if isinstance(value, torch.Tensor) and value.numel() > 1]
        tracker = LiveTensorBytes([parameter, parameter.grad, *tensors])
        with tracker:
            built.step()
    except Exception as error:  # noqa: BLE001 - any optimizer's constructor or step: reported, not assumed
        return OptimizerFootprint(
            None,
            note=f"unknown for optimizer {name!r}: building it on a test parameter and stepping it raised "
            f"{one_line(error)}; give --optimizer-states N (state tensors per parameter, e.g. 2 for AdamW)",
        )
    numel = parameter.numel()
    defaults = getattr(built, "defaults", {})
    return OptimizerFootprint(
        state_bytes=sum(t.numel() * t.element_size() for t in tensors) / numel,
        step_bytes=tracker.peak / numel,
        all_at_once=bool(defaults.get("foreach")),
        foreach_default="foreach" in defaults
        and defaults.get("foreach") is None
        and not defaults.get("fused"),
    )
