"""
Checks of a ``torch::train`` step that uses the ``"fairscale"`` engine, run in Tango's main
process before it spawns the workers.

A distributed run that fails inside its workers costs a process-group start-up and, where
every worker fails the same way, N copies of one traceback. Whatever can be checked from the
config alone is therefore checked here, once, with a :class:`ConfigurationError` that names
the field: the engine's and the wrapper's options, the number of workers, the data sampler,
and the wrap patterns (the model is built on the ``meta`` device, which allocates no memory).

:func:`install` wraps ``TorchTrainStep._train`` once; for steps with any other engine the
wrapper only passes the call through.
"""

import functools
import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
from tango.common import Lazy, Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import Model, Sampler, TrainingEngine
from tango.integrations.torch.train import TorchTrainStep
from torch.utils.data import DistributedSampler, IterableDataset

from . import checkpointing
from .config import FSDPConfig

logger = logging.getLogger(__name__)

_WRAPPER_TYPE = "fairscale::with_wrapped_modules"


def _params_of(lazy: Any) -> Dict[str, Any]:
    """The config of a ``Lazy`` object as a plain dict (empty when it was not built from a config)."""
    params = getattr(lazy, "_params", None)
    if isinstance(params, Params):
        return params.as_dict(quiet=True)
    return dict(params) if isinstance(params, dict) else {}


def _is_fairscale_engine(training_engine: Any) -> bool:
    from .engine import FairScaleTrainingEngine

    type_name = _params_of(training_engine).get("type")
    if not isinstance(type_name, str):
        return False
    try:
        engine_class = TrainingEngine.resolve_class_name(type_name)[0]
    except Exception:  # noqa: BLE001 - an unknown name is Tango's error to report, later
        return False
    return isinstance(engine_class, type) and issubclass(engine_class, FairScaleTrainingEngine)


def check_engine(
    engine: Dict[str, Any], device_count: int, work_dir: Optional[Path] = None, on_cpu: bool = False
) -> Optional[FSDPConfig]:
    """Validate the engine's options; return its FSDP config (if given)."""
    if device_count < 2:
        raise ConfigurationError(
            'The "fairscale" training engine shards the model across workers, so it needs '
            f"distributed training: set 'device_count' to 2 or more in the torch::train step (it is "
            f'{device_count}), or use the "torch" engine for a single device.'
        )
    fsdp_config = None
    if engine.get("fsdp_config") is not None:
        fsdp_config = FSDPConfig.from_params(Params(dict(engine["fsdp_config"])))
        if fsdp_config.mixed_precision and not engine.get("amp", False):
            warnings.warn(
                "training_engine.fsdp_config.mixed_precision is true but training_engine.amp is "
                "false: parameters are gathered in float16 without autocast or loss scaling, which "
                "can stop the model from converging. Set amp: true as well.",
                UserWarning,
                stacklevel=2,
            )
    if on_cpu and engine.get("amp", False) and engine.get("amp_use_bfloat16") is False:
        raise ConfigurationError(
            "training_engine.amp_use_bfloat16: false (float16 AMP) is not supported on CPU workers: "
            "loss scaling needs CUDA there. Use bfloat16 (amp_use_bfloat16: true or unset) on CPU."
        )
    max_grad_norm = engine.get("max_grad_norm")
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or max_grad_norm <= 0
    ):
        raise ConfigurationError(
            f"training_engine.max_grad_norm: must be a positive number, got {max_grad_norm!r}."
        )
    source = engine.get("resume_from_checkpoint")
    # A step with its own checkpoint resumes from that and ignores the source.
    has_own = work_dir is not None and (work_dir / "checkpoint_state_latest").exists()
    if source is not None and not has_own:
        try:
            checkpointing.resolve_checkpoint(Path(str(source)))
        except checkpointing.CheckpointError as error:
            raise ConfigurationError(f"training_engine.resume_from_checkpoint: {error}") from None
    return fsdp_config


def check_sampler(dataloader: Dict[str, Any], dataset: Any, name: str) -> None:
    """Distributed training needs each worker to read its own part of the data."""
    if isinstance(dataset, IterableDataset):
        return
    sampler = dataloader.get("sampler")
    sampler_type = sampler.get("type") if isinstance(sampler, dict) else sampler
    sampler_class = None
    if isinstance(sampler_type, str):
        try:
            sampler_class = Sampler.resolve_class_name(sampler_type)[0]
        except Exception:  # noqa: BLE001 - Tango reports unknown names itself
            return
    if not (isinstance(sampler_class, type) and issubclass(sampler_class, DistributedSampler)):
        raise ConfigurationError(
            f"{name}.sampler: distributed training needs a DistributedSampler so that each worker "
            f"reads its own part of the data (got {sampler_type!r}). Add "
            '"sampler": {"type": "torch::DistributedSampler", "shuffle": true, "drop_last": true}.'
        )


def check_model(model: Any, engine_fsdp_config: Optional[FSDPConfig]) -> None:
    """Build the model on the meta device (no memory) to check its wrapping and parameters."""
    config = _params_of(model) if isinstance(model, Lazy) else {}
    if config.get("type") == _WRAPPER_TYPE and config.get("fsdp_config") is not None:
        wrapper_fsdp_config = FSDPConfig.from_params(Params(dict(config["fsdp_config"])))
        engine_side = engine_fsdp_config or FSDPConfig()
        precision = [
            name
            for name in ("mixed_precision", "compute_dtype")
            if getattr(wrapper_fsdp_config, name) != getattr(engine_side, name)
        ]
        if precision:
            raise ConfigurationError(
                f"model.fsdp_config and training_engine.fsdp_config differ in {precision}: the wrapped "
                "units and the root unit would compute in different dtypes and fail on the first "
                "forward pass. Give both the same mixed_precision and compute_dtype."
            )
        if engine_fsdp_config is not None and wrapper_fsdp_config != engine_fsdp_config:
            differing = sorted(
                name
                for name in FSDPConfig.field_names()
                if getattr(wrapper_fsdp_config, name) != getattr(engine_fsdp_config, name)
            )
            warnings.warn(
                f"model.fsdp_config and training_engine.fsdp_config differ in {differing}. Both are "
                "used: the units made by with_wrapped_modules take the model's, the root unit "
                "(everything not in those units) takes the engine's.",
                UserWarning,
                stacklevel=2,
            )
    try:
        with torch.device("meta"):
            built = model.construct() if isinstance(model, Lazy) else model
    except ConfigurationError:
        raise
    except Exception as error:  # noqa: BLE001 - a model that cannot be built on meta is checked in the workers
        logger.debug("Skipping the model pre-flight check: it does not build on the meta device (%s)", error)
        return
    if not any(True for _ in built.parameters()):
        raise ConfigurationError(
            f"The model ({type(built).__name__}) has no parameters: there is nothing to shard or train."
        )


def preflight(
    *,
    model: Any,
    training_engine: Any,
    dataset_dict: Any,
    train_dataloader: Any,
    devices: Any,
    train_split: str = "train",
    validation_split: Optional[str] = None,
    validation_dataloader: Any = None,
    work_dir: Optional[Path] = None,
) -> None:
    """All checks, in the order a user would fix them."""
    engine = _params_of(training_engine)
    devices = list(devices or [])
    on_cpu = bool(devices) and all(device < 0 for device in devices)  # Tango's -1: a CPU worker
    fsdp_config = check_engine(engine, len(devices), work_dir, on_cpu)
    check_sampler(_params_of(train_dataloader), dataset_dict[train_split], "train_dataloader")
    if validation_split is not None:
        loader = validation_dataloader if validation_dataloader is not None else train_dataloader
        name = (
            "validation_dataloader"
            if validation_dataloader is not None
            else "train_dataloader (used for validation)"
        )
        check_sampler(_params_of(loader), dataset_dict[validation_split], name)
    check_model(model, fsdp_config)


def install() -> None:
    """Run :func:`preflight` before ``torch::train`` starts a step that uses the ``"fairscale"`` engine."""
    original: Callable[..., Any] = TorchTrainStep._train
    if getattr(original, "_tango_fairscale_preflight", False):
        return

    @functools.wraps(original)
    def _train(
        self: TorchTrainStep,
        model: Any,
        training_engine: Any,
        dataset_dict: Any,
        train_dataloader: Any,
        **kwargs: Any,
    ) -> Model:
        if _is_fairscale_engine(training_engine):
            preflight(
                model=model,
                training_engine=training_engine,
                dataset_dict=dataset_dict,
                train_dataloader=train_dataloader,
                devices=kwargs.get("devices"),
                train_split=kwargs.get("train_split", "train"),
                validation_split=kwargs.get("validation_split"),
                validation_dataloader=kwargs.get("validation_dataloader"),
                work_dir=self.work_dir,
            )
        return original(self, model, training_engine, dataset_dict, train_dataloader, **kwargs)

    _train._tango_fairscale_preflight = True  # type: ignore[attr-defined]
    TorchTrainStep._train = _train  # type: ignore[method-assign]
