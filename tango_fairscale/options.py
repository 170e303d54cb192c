"""
The rules on the ``"fairscale"`` engine's options, in one place: the engine applies them in its
constructor (so Python use gets them too) and pre-flight applies them from the config in Tango's
main process, before any worker starts, with the same messages.
"""

import dataclasses
import logging
import os
import warnings
from pathlib import Path
from typing import Any, List, Mapping, Optional

import torch
from tango.common import Params
from tango.common.exceptions import ConfigurationError

from .backends.lookup import BACKENDS, DEFAULT_BACKEND, backend_class
from .config import FSDPConfig
from .cpu.threads import available_cores
from .fsdp_options import FSDPOptions
from .precision import Precision

logger = logging.getLogger(__name__)

_PREFIX = "training_engine."


def check_distributed(distributed: bool, device_count: int) -> None:
    """
    The engine needs a process group. Through ``torch::train`` it always has one (a step of one
    device gets its one worker spawned with it, see :mod:`tango_fairscale.train_step`); an engine
    built in a user's own code from a ``TrainConfig`` that is not distributed has none.
    """
    if not distributed:
        raise ConfigurationError(
            'The "fairscale" training engine shards the model across workers, so it needs a process '
            f"group, of one worker too, and this TrainConfig is not distributed (devices: {device_count}). "
            "Run it through the torch::train step (any device_count), or build the engine in each "
            "worker of your own from a TrainConfig with is_distributed=True, world_size, worker_id and "
            'a distributed_port; or use the "torch" engine for a single device.'
        )


def check_backend(
    backend: Any, fsdp_config: Optional[FSDPOptions], where: str = f"{_PREFIX}fsdp_config"
) -> None:
    """The backend's name, and every ``fsdp_config`` field that the backend cannot honour."""
    if backend not in BACKENDS:
        raise ConfigurationError(f"{_PREFIX}backend: must be one of {list(BACKENDS)}, got {backend!r}.")
    if fsdp_config is not None:
        backend_class(backend).check_options(fsdp_config, where)


#: Seconds a collective (or the process group's rendezvous) may wait for the other workers.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """
    The ``"fairscale"`` engine's own options (those a config gives under ``training_engine``),
    their defaults written once: the engine's signature takes its defaults from here, and
    pre-flight builds the same object from the config (:meth:`from_config`) to check it in
    Tango's main process. :meth:`check` holds every rule on them. The meaning of each is in
    :class:`~tango_fairscale.FairScaleTrainingEngine`'s docstring.
    """

    #: Automatic mixed precision.
    amp: bool = False
    #: Clip the gradients to this total norm, computed across all shards.
    max_grad_norm: Optional[float] = None
    #: bfloat16 rather than float16 under AMP (default: bfloat16 on CPU, float16 on GPU).
    amp_use_bfloat16: Optional[bool] = None
    #: The root unit's FSDP options.
    fsdp_config: Optional[FSDPConfig] = None
    #: A checkpoint (or a step's work directory) to start from when the step has none of its own.
    resume_from_checkpoint: Optional[str] = None
    #: Build on ``meta`` and allocate each unit right before sharding it.
    init_on_meta: bool = False
    #: Seconds any collective may wait for the other workers.
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    #: Check every checkpoint file's SHA-256 before resuming from it.
    verify_checkpoints: bool = True
    #: The FSDP implementation (:data:`~tango_fairscale.backends.lookup.BACKENDS`).
    backend: str = DEFAULT_BACKEND
    #: Reduce-scatter once per optimizer step under ``grad_accum`` (FSDP's ``no_sync``).
    accumulate_grads_locally: bool = False
    #: Shard within each host, replicate across hosts (torch backend).
    hybrid_sharding: bool = False
    #: At the end of training, also write the weights as a ``from_pretrained`` directory here
    #: (relative: to the step's work directory).
    export_hf: Optional[str] = None
    #: For a peft (LoRA) model: also write the adapters merged into the base as a
    #: ``from_pretrained`` directory here (relative: to the step's work directory).
    export_hf_merged: Optional[str] = None
    #: CPU workers: torch's intra-op threads per worker (default: ``OMP_NUM_THREADS`` if set, else
    #: the host's cores divided by its workers, at least 1). Ignored on GPU workers.
    cpu_threads_per_worker: Optional[int] = None
    #: The dtype parameters are held and updated in (:mod:`tango_fairscale.precision`): unset, float32
    #: master weights (bfloat16 and float16 parameters upcast); a low-precision dtype trains in it purely.
    param_dtype: Optional[str] = None

    @property
    def precision(self) -> Precision:
        return Precision.from_option(self.param_dtype)

    @classmethod
    def field_names(cls) -> List[str]:
        return [field.name for field in dataclasses.fields(cls)]

    @classmethod
    def from_config(cls, engine: Mapping[str, Any]) -> "EngineOptions":
        """The options of a ``training_engine`` config (its other keys, such as ``type``, ignored)."""
        values = {name: engine[name] for name in cls.field_names() if name in engine}
        if values.get("fsdp_config") is not None:
            values["fsdp_config"] = FSDPConfig.from_params(Params(dict(values["fsdp_config"])))
        return cls(**values)

    def check(
        self, *, distributed: bool, device_count: int, on_cpu: bool, hosts: int = 1, warn: bool = True
    ) -> None:
        """
        Raise a :class:`ConfigurationError` naming the field for options that cannot work, and (with
        ``warn``) warn about those that run but are likely mistakes.
        """
        check_engine_options(
            distributed=distributed,
            device_count=device_count,
            on_cpu=on_cpu,
            amp=self.amp,
            amp_use_bfloat16=self.amp_use_bfloat16,
            max_grad_norm=self.max_grad_norm,
            fsdp_config=self.fsdp_config,
            backend=self.backend,
            accumulate_grads_locally=self.accumulate_grads_locally,
            hybrid_sharding=self.hybrid_sharding,
            hosts=hosts,
            warn=warn,
        )
        for name in ("init_on_meta", "verify_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigurationError(f"{_PREFIX}{name}: expected true or false, got {value!r}.")
        timeout = self.collective_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ConfigurationError(
                f"{_PREFIX}collective_timeout: must be a number of seconds, got {timeout!r}."
            )
        if not timeout > 0:
            raise ConfigurationError(f"{_PREFIX}collective_timeout: must be positive, got {timeout!r}.")
        check_cpu_threads(self.cpu_threads_per_worker)
        check_param_dtype(self.param_dtype, self.backend, warn=warn)
        cores = available_cores()
        if on_cpu and self.cpu_threads_per_worker is not None and self.cpu_threads_per_worker > cores:
            # OpenMP cannot start that many threads (libgomp failed at 10000); beyond the cores
            # more threads only take turns on them.
            raise ConfigurationError(
                f"{_PREFIX}cpu_threads_per_worker: {self.cpu_threads_per_worker} is more than the "
                f"{cores} cores this process may run on: give at most {cores} (or remove it for each "
                "worker's share of the cores)."
            )
        if warn and self.cpu_threads_per_worker is not None and not on_cpu:
            logger.info("%scpu_threads_per_worker: ignored, the workers compute on GPUs.", _PREFIX)
        if self.resume_from_checkpoint is not None and not isinstance(self.resume_from_checkpoint, str):
            raise ConfigurationError(
                f"{_PREFIX}resume_from_checkpoint: expected a path, got {self.resume_from_checkpoint!r}."
            )
        check_exports_apart(self.export_hf, self.export_hf_merged)


def check_exports_apart(export_hf: Any, export_hf_merged: Any) -> None:
    """
    Two outputs of one run never share a path: the merged export beside (not over, nor inside,
    nor around) the adapter export it is built from. Both are relative to the same work directory.
    """
    if not isinstance(export_hf, str) or not isinstance(export_hf_merged, str):
        return
    adapter, merged = (Path(os.path.normpath(path)) for path in (export_hf, export_hf_merged))
    if adapter == merged or adapter in merged.parents or merged in adapter.parents:
        raise ConfigurationError(
            f"{_PREFIX}export_hf_merged: {export_hf_merged!r} overlaps export_hf {export_hf!r} (the "
            "adapter export it merges): give the two exports separate directories."
        )


def check_param_dtype(value: Any, backend: str, *, warn: bool) -> None:
    """``param_dtype``: a dtype the backend trains in; pure low precision said once, with its cost."""
    precision = Precision.from_option(value)
    supported = backend_class(backend).low_precision_parameters
    if precision.pure_low_precision and precision.param_dtype not in supported:
        raise ConfigurationError(
            f'{_PREFIX}param_dtype: {value!r} needs backend: "torch" (FairScale\'s FSDP trains float32 '
            "parameters only). Remove param_dtype for float32 master weights (with fsdp_config."
            'mixed_precision to compute in bfloat16), or set backend: "torch".'
        )
    if warn and precision.pure_low_precision:
        warnings.warn(f"{_PREFIX}param_dtype: {precision.describe()}.", UserWarning, stacklevel=3)


def check_cpu_threads(value: Any) -> None:
    """``cpu_threads_per_worker``: unset, or a whole number of threads, 1 or more."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigurationError(
            f"{_PREFIX}cpu_threads_per_worker: must be a whole number of threads, 1 or more, got {value!r} "
            "(remove it for each worker's share of the cores)."
        )


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
    backend: Any = DEFAULT_BACKEND,
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
    if hybrid_sharding and not backend_class(backend).supports_hybrid_sharding:
        raise ConfigurationError(
            f'{_PREFIX}hybrid_sharding: true needs backend: "torch" (the {backend} backend shards across all '
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
