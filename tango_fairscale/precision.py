"""
The dtype the engine holds parameters in: the master weights the optimizer updates, and so its
state. One rule, read by both backends (before each unit is sharded), ``plan`` and pre-flight.

By default parameters train in float32 whatever the model was built or loaded in: a checkpoint
saved in bfloat16 or float16 (every hub checkpoint today; transformers 5 loads a checkpoint in its
own dtype, and ``from_config`` builds in the config's dtype) is upcast unit by unit right before
the unit is sharded, as Accelerate upcasts under FSDP mixed precision and torchtitan keeps float32
parameters. Mixed precision (``fsdp_config.mixed_precision``, ``amp``) then gathers, computes and
reduces in the low-precision dtype while the updates keep float32's resolution. Training in pure
low precision is asked for by name (``training_engine.param_dtype``).
"""

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError

from .fsdp_options import DTYPE_NAMES, dtype_named

logger = logging.getLogger(__name__)

#: Floating-point dtypes below float32's precision: upcast to the master dtype by default.
LOW_PRECISION = (torch.bfloat16, torch.float16)

#: The master dtype when ``param_dtype`` is unset.
DEFAULT_PARAM_DTYPE = torch.float32

_FIELD = "training_engine.param_dtype"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_param_dtype(value: Any) -> Optional[torch.dtype]:
    """``training_engine.param_dtype`` as a dtype (``None`` when unset), or one line naming the field."""
    if value is None or isinstance(value, torch.dtype):
        return value
    named = dtype_named(value)
    if named is not None:
        return named
    raise ConfigurationError(
        f"{_FIELD}: {value!r} is not a floating-point dtype. Use one of "
        f"{sorted(set(DTYPE_NAMES))}, or leave it unset (float32 master weights)."
    )


@dataclass(frozen=True)
class Precision:
    """What dtype each parameter is held and updated in (see the module's docstring)."""

    #: ``training_engine.param_dtype``: ``None`` (the default) holds float32 master weights,
    #: upcasting low-precision parameters; a dtype casts every floating-point parameter to it.
    param_dtype: Optional[torch.dtype] = None

    @classmethod
    def from_option(cls, value: Any) -> "Precision":
        return cls(parse_param_dtype(value))

    @property
    def pure_low_precision(self) -> bool:
        """Whether parameters, gradients and optimizer state are all held below float32."""
        return self.param_dtype in LOW_PRECISION

    def held_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter built or loaded in ``dtype`` is held and updated in."""
        if not dtype.is_floating_point:
            return dtype
        if self.param_dtype is not None:
            return self.param_dtype
        return DEFAULT_PARAM_DTYPE if dtype in LOW_PRECISION else dtype

    def cast_parameters(self, module: nn.Module, *, skip: Callable[[nn.Module], bool]) -> Dict[str, int]:
        """
        Cast ``module``'s parameters (those outside submodules ``skip`` says are sharded already)
        to the dtype they are held in, in place: each ``Parameter`` object stays (ties stay ties,
        ``requires_grad`` stays), its data is replaced. Called on a unit right before it is sharded,
        so a worker holds one unit in both dtypes at a time. Returns the count of parameters cast
        from each dtype (by name).
        """
        cast: Counter = Counter()
        seen = set()
        for param in _parameters_outside(module, skip):
            if id(param) in seen:
                continue
            seen.add(id(param))
            target = self.held_dtype(param.dtype)
            if target != param.dtype:
                cast[dtype_name(param.dtype)] += 1
                param.data = param.data.to(target)
        return dict(cast)

    def describe(self) -> str:
        """One line on what the parameters are held in, for logs and ``plan``."""
        if self.pure_low_precision:
            assert self.param_dtype is not None
            return (
                f"parameters, gradients and optimizer state in {dtype_name(self.param_dtype)} "
                f"({_FIELD}): half of float32's memory, but an update below about "
                f"{_resolution(self.param_dtype)} of a weight is rounded away"
            )
        held = dtype_name(self.param_dtype or DEFAULT_PARAM_DTYPE)
        return f"{held} master weights and optimizer state (bfloat16 and float16 parameters upcast)"


#: The default: float32 master weights, low-precision parameters upcast.
FLOAT32_MASTER = Precision()


def _resolution(dtype: torch.dtype) -> str:
    return f"1/{round(1 / torch.finfo(dtype).eps)}"


def _parameters_outside(module: nn.Module, skip: Callable[[nn.Module], bool]) -> Any:
    stack = [module]
    while stack:
        current = stack.pop()
        yield from (p for p in current._parameters.values() if p is not None)
        stack.extend(child for child in current.children() if not skip(child))


def announce(precision: Precision, cast: Dict[str, int], rank: int) -> None:
    """Worker 0's one line on what the parameters are held in, and what was cast to get there."""
    if rank != 0:
        return
    if cast:
        counts = ", ".join(f"{count} from {name}" for name, count in sorted(cast.items()))
        logger.info("Parameters cast before sharding (%s): %s", counts, precision.describe())
    elif precision.pure_low_precision:
        logger.info("Parameters: %s", precision.describe())
