"""
The rules on the ``"fairscale"`` engine's options, in one place: the engine applies them in its
constructor (so Python use gets them too) and pre-flight applies them from the config in Tango's
main process, before any worker starts, with the same messages.
"""

import logging
import warnings
from typing import Any, Optional

import torch
from tango.common.exceptions import ConfigurationError

from .config import FSDPConfig

logger = logging.getLogger(__name__)

_PREFIX = "training_engine."


def check_distributed(distributed: bool, device_count: int) -> None:
    """The engine needs a process group: Tango starts one for ``device_count`` of 2 or more."""
    if not distributed:
        raise ConfigurationError(
            'The "fairscale" training engine shards the model across workers, so it needs distributed '
            f"training: set 'device_count' to 2 or more in the torch::train step (it is {device_count}), "
            'or use the "torch" engine for a single device.'
        )


#: The sharding backends: FairScale's FSDP, and PyTorch's own FSDP2 (``fully_shard``).
BACKENDS = ("fairscale", "torch")


def check_backend(
    backend: Any, fsdp_config: Optional[FSDPConfig], where: str = f"{_PREFIX}fsdp_config"
) -> None:
    """The backend's name, and every ``fsdp_config`` field that the backend cannot honour."""
    if backend not in BACKENDS:
        raise ConfigurationError(f"{_PREFIX}backend: must be one of {list(BACKENDS)}, got {backend!r}.")
    if backend == "torch" and fsdp_config is not None:
        from .backends.torch_fsdp import check_options

        check_options(fsdp_config, where=where)


def amp_dtype(on_cpu: bool, amp_use_bfloat16: Optional[bool]) -> torch.dtype:
    """The autocast dtype: bfloat16 on CPU workers unless asked otherwise, float16 on GPUs."""
    if amp_use_bfloat16 is None:
        amp_use_bfloat16 = on_cpu
    return torch.bfloat16 if amp_use_bfloat16 else torch.float16


def check_engine_options(
    *,
    distributed: bool,
    device_count: int,
    on_cpu: bool,
    amp: Any = False,
    amp_use_bfloat16: Any = None,
    max_grad_norm: Any = None,
    fsdp_config: Optional[FSDPConfig] = None,
    backend: Any = "fairscale",
    accumulate_grads_locally: Any = False,
    hybrid_sharding: Any = False,
    hosts: int = 1,
    warn: bool = True,
) -> None:
    """
    Raise a :class:`ConfigurationError` naming the field for options that cannot work, and (with
    ``warn``) warn about those that run but are likely mistakes.
    """
    check_distributed(distributed, device_count)
    check_backend(backend, fsdp_config)
    for name, value in (
        ("amp", amp),
        ("amp_use_bfloat16", amp_use_bfloat16),
        ("accumulate_grads_locally", accumulate_grads_locally),
        ("hybrid_sharding", hybrid_sharding),
    ):
        if value is not None and not isinstance(value, bool):
            raise ConfigurationError(f"{_PREFIX}{name}: expected true or false, got {value!r}.")
    if hybrid_sharding and backend != "torch":
        raise ConfigurationError(
            f'{_PREFIX}hybrid_sharding: true needs backend: "torch" (FairScale\'s FSDP shards across all '
            'workers only). Set backend: "torch", or remove hybrid_sharding.'
        )
    if warn and hybrid_sharding and hosts == 1:
        logger.info(
            "hybrid_sharding: one host, so every parameter is sharded across all %d workers (no replicas).",
            device_count,
        )
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or max_grad_norm <= 0
    ):
        raise ConfigurationError(f"{_PREFIX}max_grad_norm: must be a positive number, got {max_grad_norm!r}.")
    dtype = amp_dtype(on_cpu, amp_use_bfloat16)
    if amp and on_cpu and dtype == torch.float16:
        raise ConfigurationError(
            f"{_PREFIX}amp_use_bfloat16: false (float16 AMP) is not supported on CPU workers: loss scaling "
            "needs CUDA there. Use bfloat16 (amp_use_bfloat16: true or unset) on CPU."
        )
    if not warn or fsdp_config is None:
        return
    if fsdp_config.mixed_precision and not amp:
        compute = fsdp_config.resolved_compute_dtype(on_cpu)
        warnings.warn(
            f"{_PREFIX}fsdp_config.mixed_precision is true but {_PREFIX}amp is false: parameters are "
            f"gathered in {str(compute).replace('torch.', '')} without autocast"
            f"{'' if on_cpu else ' or loss scaling'}, which can stop the model from converging or fail on "
            "float inputs. Set amp: true as well.",
            UserWarning,
            stacklevel=3,
        )
    if (
        amp
        and not on_cpu
        and dtype == torch.bfloat16
        and fsdp_config.mixed_precision
        and fsdp_config.compute_dtype is None
    ):
        warnings.warn(
            f"{_PREFIX}fsdp_config.mixed_precision computes in float16 on GPUs unless compute_dtype is set, "
            "while AMP uses bfloat16 without loss scaling: small gradients can underflow. Set "
            'fsdp_config.compute_dtype: "bfloat16".',
            UserWarning,
            stacklevel=3,
        )
