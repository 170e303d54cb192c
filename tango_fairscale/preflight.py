"""
Checks of a ``torch::train`` step that uses the ``"fairscale"`` engine, run in Tango's main
process before it spawns the workers.

A distributed run that fails inside its workers costs a process-group start-up and, where
every worker fails the same way, N copies of one traceback. Whatever can be checked from the
config alone is therefore checked here, once, with a :class:`ConfigurationError` that names
the field: the engine's and the wrapper's options, the number of workers, the data sampler,
the splits, the resume point against ``train_steps``, the callbacks' options (by each callback's
own ``check_options``), a ``fairscale::from_pretrained`` model's inputs (by
:func:`~tango_fairscale.finetune.pretrained.check_pretrained`), and the wrap patterns (the model is built
on the ``meta`` device, which allocates no memory).

It runs from the step patch T1 of :mod:`tango_fairscale.compat`, for steps whose engine is
``"fairscale"``; the rules on the engine's own options are :mod:`tango_fairscale.options`'s,
shared with the engine.
"""

import inspect
import logging
import math
import os
import typing
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from tango.common import Lazy, Params
from tango.common.exceptions import CliRunError, ConfigurationError
from tango.integrations.torch import Model, Sampler, TrainCallback, TrainingEngine
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils.data import DistributedSampler, IterableDataset

from . import checkpointing
from .backends.lookup import DEFAULT_BACKEND, backend_class, check_written_by
from .checkpointing.resume import check_within_run
from .config import FSDPConfig
from .cpu.memory import META_BUILD_MMAP_THRESHOLD_BYTES, limit_cpu_heap_growth
from .devices import devices_are_cpu
from .engine import FairScaleTrainingEngine, _no_adapters_error, _no_hf_model_error
from .errors import did_you_mean
from .finetune.data_fit import check_data_fits_model
from .finetune.hf_export import hf_model_in
from .finetune.lora import check_peft_method
from .finetune.pretrained import PRETRAINED_TYPE, check_pretrained
from .finetune.safetensors_files import fingerprint
from .materialize import check_initialisable, parameters_on_meta
from .options import EngineOptions, check_backend
from .output_paths import HF_EXPORT, check_output, check_writable, export_hf_path
from .step_config import wrong_type
from .wrapping import WRAPPER_TYPE, check_list_option, require_parameters

logger = logging.getLogger(__name__)


def params_of(lazy: Any) -> Dict[str, Any]:
    """The config of a ``Lazy`` object as a plain dict (empty when it was not built from a config)."""
    params = getattr(lazy, "_params", None)
    if isinstance(params, Params):
        return params.as_dict(quiet=True)
    return dict(params) if isinstance(params, dict) else {}


def uses_fairscale_engine(training_engine: Any) -> bool:
    type_name = params_of(training_engine).get("type")
    if not isinstance(type_name, str):
        return False
    try:
        engine_class = TrainingEngine.resolve_class_name(type_name)[0]
    except Exception:  # noqa: BLE001 - an unknown name is Tango's error to report, later
        return False
    return isinstance(engine_class, type) and issubclass(engine_class, FairScaleTrainingEngine)


def check_engine(
    engine: Dict[str, Any],
    device_count: int,
    work_dir: Optional[Path] = None,
    on_cpu: bool = False,
    hosts: int = 1,
    train_steps: Optional[int] = None,
) -> EngineOptions:
    """
    Validate the engine's options for ``device_count`` workers on each of ``hosts`` hosts (on
    CPU workers with ``on_cpu``), ``resume_from_checkpoint`` against the run's ``train_steps``;
    return them.
    """
    options = EngineOptions.from_config(engine)
    # Warnings come from the engine, on worker 0, so that they are printed once.
    # A step on the engine always gets a process group, of one worker too (train_step.py).
    options.check(distributed=True, device_count=device_count, on_cpu=on_cpu, hosts=hosts, warn=False)
    source = options.resume_from_checkpoint
    # A step with its own checkpoint resumes from that and ignores the source.
    has_own = work_dir is not None and (work_dir / "checkpoint_state_latest").exists()
    if source is not None and not has_own:
        try:
            resolved = checkpointing.resolve_checkpoint(Path(str(source)))
            marker = checkpointing.read_marker(resolved)
            if marker is not None:
                check_written_by(resolved, marker, options.backend)
                check_within_run(resolved, marker, train_steps)
        except checkpointing.CheckpointError as error:
            raise ConfigurationError(f"training_engine.resume_from_checkpoint: {error}") from None
    check_export_hf(options.export_hf, work_dir)
    if options.export_hf_merged is not None:
        if options.export_hf is None:
            raise ConfigurationError(
                "training_engine.export_hf_merged: needs export_hf (the adapter directory it merges)."
            )
        check_export_hf(options.export_hf_merged, work_dir, "export_hf_merged")
    return options


def check_export_hf(
    export_hf: Any, work_dir: Optional[Path], field: str = "export_hf", needed_bytes: int = 0
) -> None:
    """
    ``export_hf`` where the engine will write it (a relative path against the step's work
    directory, :func:`~tango_fairscale.output_paths.export_hf_path`), refused before anything
    trains when the export may not replace what is there (:mod:`tango_fairscale.output_paths`),
    or cannot be written there (read-only, or less than ``needed_bytes`` free).
    """
    if export_hf is None:
        return
    if not isinstance(export_hf, str) or not export_hf:
        raise ConfigurationError(f"training_engine.{field}: expected a directory path, got {export_hf!r}.")
    if work_dir is None and not Path(export_hf).is_absolute():
        return  # relative to a work directory not known here; the engine checks it before writing
    try:
        path = export_hf_path(export_hf, work_dir or Path())
        check_output(path, HF_EXPORT, work_dir=work_dir)
        check_writable(path, needed_bytes)
    except checkpointing.CheckpointError as error:
        raise ConfigurationError(f"training_engine.{field}: {error}") from None


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


def check_counts(step_options: Dict[str, Any]) -> None:
    """``torch::train``'s step counts: Tango would fail on them deep inside training, or never stop."""
    for name in ("train_steps", "train_epochs", "checkpoint_every", "validate_every", "validation_steps"):
        value = step_options.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name}: must be a positive whole number, got {value!r}.")
    for name in ("grad_accum", "log_every"):
        value = step_options.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigurationError(f"{name}: must be a positive whole number, got {value!r}.")


def batches_per_worker(dataset_size: int, world_size: int, dataloader: Dict[str, Any]) -> int:
    """How many batches each worker's loader yields per epoch, as a ``DistributedSampler`` splits the data."""
    sampler = dataloader.get("sampler")
    sampler_drops = bool(sampler.get("drop_last", False)) if isinstance(sampler, dict) else False
    per_worker = dataset_size // world_size if sampler_drops else -(-dataset_size // world_size)
    batch_size = dataloader.get("batch_size", 1)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        return -1
    return per_worker // batch_size if dataloader.get("drop_last", False) else -(-per_worker // batch_size)


def check_batches(
    dataloader: Dict[str, Any],
    dataset: Any,
    split: str,
    name: str,
    world_size: int,
    *,
    training: bool = False,
) -> None:
    """
    A loader that yields no batch on some worker makes ``torch::train`` loop over empty epochs
    forever, at full CPU: refuse it, with the numbers that decide it. With ``training``, so is a
    loader whose every batch would be smaller than ``batch_size`` (each worker's share of the data
    is smaller): the run would train on another batch size than the config's, silently.
    """
    if isinstance(dataset, IterableDataset):
        return
    try:
        size = len(dataset)
    except TypeError:
        return
    batch_size = dataloader.get("batch_size", 1)
    batches = batches_per_worker(size, world_size, dataloader)
    if batches < 0:
        raise ConfigurationError(f"{name}.batch_size: must be a positive whole number, got {batch_size!r}.")
    if batches == 0:
        sampler = dataloader.get("sampler")
        sampler_drops = isinstance(sampler, dict) and sampler.get("drop_last", False)
        raise ConfigurationError(
            f"{name}: split {split!r} has {size} example(s); split over world size {world_size}"
            f"{' with the sampler dropping the remainder' if sampler_drops else ''}, each worker gets "
            f"{size // world_size if sampler_drops else -(-size // world_size)}, fewer than batch_size "
            f"{batch_size}{' (with drop_last)' if dataloader.get('drop_last') else ''}, so some worker would "
            "never get a batch and training would never end. Use more data, fewer workers or a smaller "
            "batch_size."
        )
    sampler = dataloader.get("sampler")
    sampler_drops = isinstance(sampler, dict) and sampler.get("drop_last", False)
    per_worker = size // world_size if sampler_drops else -(-size // world_size)
    if training and per_worker < batch_size:
        raise ConfigurationError(
            f"{name}: split {split!r} has {size} example(s); split over world size {world_size}, each worker "
            f"gets {per_worker}, fewer than batch_size {batch_size}, so every batch would hold {per_worker} "
            f"examples, not {batch_size}. Use more data, fewer workers or a smaller batch_size."
        )


def check_model(
    model: Any,
    engine_fsdp_config: Optional[FSDPConfig],
    amp: bool = False,
    init_on_meta: bool = False,
    backend: str = DEFAULT_BACKEND,
    export_hf: Optional[str] = None,
    data: Sequence[Tuple[str, Any]] = (),
) -> Optional[Any]:
    """
    Build the model on the meta device (no memory) to check its wrapping and parameters, and
    that ``data`` (the splits it trains and validates on, by name) fits it.
    """
    config = params_of(model) if isinstance(model, Lazy) else {}
    if config.get("type") == WRAPPER_TYPE:
        check_list_option("modules_to_wrap", config.get("modules_to_wrap"), "regex strings")
        check_list_option("wrap_module_classes", config.get("wrap_module_classes"), "class names")
        if config.get("fsdp_config") is not None:
            check_backend(
                backend, FSDPConfig.from_params(Params(dict(config["fsdp_config"]))), "model.fsdp_config"
            )
        backend_class(backend).check_wrapper_options(config)
    if config.get("type") == WRAPPER_TYPE and config.get("fsdp_config") is not None:
        wrapper_fsdp_config = FSDPConfig.from_params(Params(dict(config["fsdp_config"])))
        engine_side = engine_fsdp_config or FSDPConfig()
        precision = [
            name
            for name in ("mixed_precision", "compute_dtype")
            if getattr(wrapper_fsdp_config, name) != getattr(engine_side, name)
        ]
        if precision and not amp:
            # Under autocast each op casts its inputs itself, so units of different dtypes work.
            raise ConfigurationError(
                f"model.fsdp_config and training_engine.fsdp_config differ in {precision} and "
                "training_engine.amp is false: the wrapped units and the root unit would compute in "
                "different dtypes and fail on the first forward pass. Give both the same "
                "mixed_precision and compute_dtype, or set training_engine.amp: true."
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
        # The wrapper records its plan (a backend applies it in the workers): the plan's checks run
        # here. Under init_on_meta, as the workers build it: a pretrained model is then built from
        # its config and marked with its files' tensors (transformers' own from_pretrained refuses
        # a meta device).
        building = parameters_on_meta() if init_on_meta else nullcontext()
        with torch.device("meta"), building:
            built = model.construct() if isinstance(model, Lazy) else model
    except ConfigurationError:
        raise
    except Exception as error:  # noqa: BLE001 - sorted below: a config's mistake, or a model meta cannot build
        typed = wrong_type(error)
        if typed is not None:
            # Tango's FromParams found an option of the wrong type (with_lora's r: 2.5): every
            # worker would fail the same way, in a 134-line traceback.
            raise ConfigurationError(f"model: {typed}") from None
        if init_on_meta and isinstance(model, Lazy):
            # Built as the workers build it (only the parameters on meta, not every tensor): a
            # constructor that fails there fails in every worker, and is refused in one line.
            check_init_on_meta(model)
        logger.debug("Skipping the model pre-flight check: it does not build on the meta device (%s)", error)
        return None
    require_parameters(built)
    check_peft_method(built)
    if not any(param.requires_grad for param in built.parameters()):
        # Tango's first backward would fail in every worker ("element 0 of tensors does not
        # require grad"), after the baseline validation.
        count = sum(1 for _ in built.parameters())
        raise ConfigurationError(
            f"model: none of its {count} parameters trains (every one has requires_grad=False): there "
            "is nothing to train. Leave some unfrozen in the model's constructor (requires_grad_(True)), "
            "or use fairscale::evaluate to evaluate a model without training it."
        )
    if export_hf is not None:
        check_export_hf_model(built)
    check_data_fits_model(hf_model_in(built), data, "dataset_dict")
    if init_on_meta and isinstance(model, Lazy):
        check_init_on_meta(model)
    return built


def check_init_on_meta(model: Any) -> None:
    """Every parameter an ``init_on_meta`` build leaves unset, listed at once, before any worker starts."""
    # Its parameters are allocated on the CPU and moved to meta, the initialisers run on scratch
    # tensors: none of it may stay in the main process's heap (META_BUILD_MMAP_THRESHOLD_BYTES).
    try:
        with limit_cpu_heap_growth(META_BUILD_MMAP_THRESHOLD_BYTES), parameters_on_meta():
            built = model.construct()
    except ConfigurationError:
        raise
    except Exception as error:  # noqa: BLE001 - told in one line, naming the constructor's line
        raise ConfigurationError(
            f"training_engine.init_on_meta: the model cannot be built with its parameters on the meta "
            f"device: {_constructor_line(error)}{_first_line(error)}. A constructor that replaces a "
            "parameter's tensor (weight.data = ..., weight.set_(...)) cannot: set its values in place "
            "under torch.no_grad() (weight.copy_(...), nn.init), or set training_engine.init_on_meta: false."
        ) from None
    check_no_recomputed_weights(built)
    check_no_meta_buffers(built)
    check_initialisable(built)


def check_no_meta_buffers(model: Any) -> None:
    """
    Under ``init_on_meta`` a buffer the constructor computes from a parameter (``weight.norm()``)
    is a meta tensor with no values, which materialising does not fill: every worker failed at
    the first forward ("Cannot copy out of meta tensor"). Refused, naming the buffers.
    """
    lazy = [name for name, module in model.named_modules() if isinstance(module, LazyModuleMixin)]
    if lazy:
        # A lazy module (nn.LazyLinear) has no shape until its first forward: nothing to build on meta.
        raise ConfigurationError(
            f"training_engine.init_on_meta: model.{lazy[0]} is a lazy module, whose shape is known only "
            "at the first forward: give it its input size (nn.Linear), or set training_engine.init_on_meta: "
            "false."
        )
    names = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if names:
        raise ConfigurationError(
            f"training_engine.init_on_meta: the buffer(s) {', '.join(names[:4])}"
            f"{f' and {len(names) - 4} more' if len(names) > 4 else ''} are computed from parameters in "
            "the constructor, which init_on_meta builds on the meta device, so they have no values: "
            "compute them in forward (or from the pretrained files), or set "
            "training_engine.init_on_meta: false."
        )


def check_no_recomputed_weights(model: Any) -> None:
    """
    Under ``init_on_meta``, no weight computed from others before each forward (``spectral_norm``,
    ``torch.nn.utils.parametrize``): their power-iteration buffers and computed tensors are built
    from meta tensors in the constructor, and every worker failed at the first forward with
    "Cannot copy out of meta tensor".
    """
    from torch.nn.utils import parametrize
    from torch.nn.utils.spectral_norm import SpectralNorm

    for name, module in model.named_modules():
        hooked = any(isinstance(hook, SpectralNorm) for hook in module._forward_pre_hooks.values())
        if hooked or parametrize.is_parametrized(module):
            what = "spectral_norm" if hooked else "a parametrization (torch.nn.utils.parametrize)"
            raise ConfigurationError(
                f"training_engine.init_on_meta: model.{name or '(root)'} uses {what}, whose weight is "
                "computed from other tensors before each forward, which a build on the meta device "
                "does not make: set training_engine.init_on_meta: false for this model."
            )


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].rstrip('.') if lines else ''}"


def _constructor_line(error: BaseException) -> str:
    """Where the model's own code raised ``error``: its last frame outside libraries, and its line."""
    import traceback

    libraries = ("site-packages", "dist-packages", str(Path(__file__).parent), "/lib/python")
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not any(part in frame.filename for part in libraries)
    ]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} `{(frame.line or '').strip()}` raised "


def check_engine_keys(training_engine: Any) -> None:
    """
    Every key of ``training_engine`` is an argument of the engine's constructor, and the ones it
    cannot go without are there: Tango would report either from inside every worker (a misspelt
    ``optimizer`` as "Missing key optimizer", after a traceback per worker).
    """
    engine = params_of(training_engine)
    type_name = engine.get("type")
    try:
        engine_class = TrainingEngine.resolve_class_name(str(type_name))[0]
    except Exception:  # noqa: BLE001 - an unknown name is Tango's error to report
        return
    # Tango passes the model and train_config itself.
    parameters = _accepted_keys(engine_class.__init__, ("self", "train_config", "model"))
    if parameters is None:
        return  # an engine that takes any key
    taken = list(parameters)
    for key in engine:
        if key != "type" and key not in taken:
            raise _not_an_option(f"training_engine.{key}", f"the {type_name!r} engine", key, taken)
    for name in taken:
        if parameters[name].default is inspect.Parameter.empty and name not in engine:
            raise ConfigurationError(
                f"training_engine.{name}: missing; the {type_name!r} engine needs it"
                f"{_ENGINE_EXAMPLES.get(name, '')}."
            )


def _not_an_option(field: str, owner: str, key: str, options: List[str]) -> ConfigurationError:
    """The error for ``key`` at ``field``, not one of ``owner``'s ``options``: the nearest one, or all."""
    hint = did_you_mean(key, options) or f"its options are {sorted(options)}."
    return ConfigurationError(f"{field}: not an option of {owner}: {hint}")


def check_model_keys(model: Any) -> None:
    """
    Every key of each registered model constructor in the step's model config (the model, and
    the models given to it, such as ``fairscale::with_lora``'s ``model``) is an argument of that
    constructor. Tango says a misspelt one as "Extra parameters passed to Model: {...}", naming
    neither the constructor nor where in the config it is.
    """
    _check_model_config(params_of(model), "model")


def _check_model_config(config: Any, field: str) -> None:
    """:func:`check_model_keys` for the model config at ``field``, and the models it is given."""
    if isinstance(config, list):
        for index, item in enumerate(config):
            _check_model_config(item, f"{field}[{index}]")
        return
    if not isinstance(config, dict) or not isinstance(config.get("type"), str):
        return
    type_name = config["type"]
    parameters = _model_parameters(type_name)
    if parameters is None:
        return
    for key in config:
        if key != "type" and key not in parameters:
            raise _not_an_option(f"{field}.{key}", repr(type_name), key, list(parameters))
    for key, value in config.items():
        if key != "type" and _may_hold_models(parameters[key].annotation):
            _check_model_config(value, f"{field}.{key}")


def _model_parameters(type_name: str) -> Optional[Dict[str, inspect.Parameter]]:
    """
    The arguments a config may give the registered model type ``type_name``, by name; ``None``
    where this check cannot know them: a name Tango would import or search for, a constructor
    taking ``**kwargs``, or a class that reads its config itself (its own ``from_params``).
    """
    if type_name not in Model.list_available():
        return None
    try:
        registered, method = Model.resolve_class_name(type_name, search_modules=False)
    except Exception:  # noqa: BLE001 - not a name this check can read
        return None
    if method is not None:
        return _accepted_keys(getattr(registered, method), ())
    if isinstance(registered, type):
        if getattr(registered.from_params, "__func__", None) is not Model.from_params.__func__:  # type: ignore[attr-defined]
            return None
        return _accepted_keys(registered.__init__, ("self",))
    return _accepted_keys(registered, ())


def _accepted_keys(constructor: Any, passed: Tuple[str, ...]) -> Optional[Dict[str, inspect.Parameter]]:
    """
    The arguments of ``constructor`` a config may give, by name (those in ``passed`` left out:
    the caller gives them); ``None`` where it takes any (``**kwargs``) or has no signature.
    """
    try:
        parameters = inspect.signature(constructor).parameters
    except (TypeError, ValueError):
        return None
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return None
    return {name: parameter for name, parameter in parameters.items() if name not in passed}


def _may_hold_models(annotation: Any) -> bool:
    """Whether an argument so annotated may be given models (``Model``, ``Lazy[Model]``, lists of them)."""
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):
        return True  # unknown (or a string to resolve): look inside
    if isinstance(annotation, type):
        return issubclass(annotation, Model)
    return any(_may_hold_models(argument) for argument in typing.get_args(annotation))


#: How to write what the engine cannot go without, for the message that says it is missing.
_ENGINE_EXAMPLES = {"optimizer": ' (e.g. "optimizer": {"type": "torch::AdamW", "lr": 0.0001})'}


def check_splits(dataset_dict: Any, train_split: str, validation_split: Optional[str]) -> None:
    """The step's splits are the dataset's (Tango's worker, and the checks here, fail on a KeyError)."""
    for field, split in (("train_split", train_split), ("validation_split", validation_split)):
        if split is not None and split not in dataset_dict:
            splits = sorted(str(name) for name in dataset_dict.keys())
            raise ConfigurationError(
                f"{field}: the dataset has no split {split!r}; its splits are {splits}. Set {field} to one "
                "of them."
            )


def planned_train_steps(
    step_options: Dict[str, Any], dataset: Any, dataloader: Dict[str, Any], world_size: int
) -> Optional[int]:
    """
    ``train_steps``, or what Tango's worker computes from ``train_epochs`` (the batches each worker's
    loader yields per epoch, over ``grad_accum``); ``None`` where the data has no length.
    """
    if step_options.get("train_steps") is not None:
        return int(step_options["train_steps"])
    epochs = step_options.get("train_epochs")
    if epochs is None or isinstance(dataset, IterableDataset):
        return None
    try:
        batches = batches_per_worker(len(dataset), world_size, dataloader)
    except TypeError:
        return None
    return math.ceil(batches * epochs / step_options.get("grad_accum", 1)) if batches >= 0 else None


def check_callbacks(callbacks: Any, train_steps: Optional[int]) -> None:
    """
    Each callback's options, by the rules the callback's constructor applies (its ``check_options``),
    without constructing it: a constructor needs the workers' engine, and would have effects.
    """
    for index, callback in enumerate(callbacks or []):
        config = params_of(callback)
        type_name = config.get("type")
        callback_class = getattr(callback, "_constructor", None)
        if isinstance(type_name, str):
            try:
                callback_class = TrainCallback.resolve_class_name(type_name)[0]
            except Exception:  # noqa: BLE001 - an unknown name is Tango's error to report
                continue
        if isinstance(callback_class, type) and callback_class.__module__.startswith(__package__ + "."):
            # This package's callbacks take exactly their constructors' arguments (and their bases').
            options = _constructor_arguments(callback_class)
            for key in config:
                if key != "type" and key not in options:
                    raise _not_an_option(f"callbacks[{index}].{key}", repr(type_name), key, options)
        check = getattr(callback_class, "check_options", None)
        if not callable(check):
            continue
        try:
            check({key: value for key, value in config.items() if key != "type"}, train_steps)
        except ConfigurationError as error:
            raise ConfigurationError(f"callbacks[{index}]: {error}") from None


def _constructor_arguments(callback_class: type) -> List[str]:
    """The named arguments of a callback's constructor and of its bases' (Tango's included)."""
    names: List[str] = []
    for klass in callback_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        for parameter in inspect.signature(init).parameters.values():
            named = parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
            if named and parameter.name != "self" and parameter.name not in names:
                names.append(parameter.name)
    return names


def _configs_of_type(config: Any, type_name: str) -> List[Dict[str, Any]]:
    """The parts of a config (nested dicts and lists) of registered type ``type_name``."""
    if isinstance(config, list):
        return [found for item in config for found in _configs_of_type(item, type_name)]
    if not isinstance(config, dict):
        return []
    own = [config] if config.get("type") == type_name else []
    return own + [found for value in config.values() for found in _configs_of_type(value, type_name)]


def check_pretrained_models(model: Any, init_on_meta: bool) -> None:
    """Each ``fairscale::from_pretrained`` of the model (alone or wrapped), by :func:`check_pretrained`."""
    for config in _configs_of_type(params_of(model), PRETRAINED_TYPE):
        if config.get("pretrained_model_name_or_path") is None:
            continue  # Tango says it is missing
        try:
            check_pretrained(
                config["pretrained_model_name_or_path"],
                config.get("auto_class", "AutoModelForCausalLM"),
                config.get("config_overrides"),
                init_on_meta=init_on_meta,
            )
        except ConfigurationError as error:
            message = str(error)
            raise ConfigurationError(
                message if message.startswith(PRETRAINED_TYPE) else f"{PRETRAINED_TYPE}: {message}"
            ) from None


def pretrained_fingerprint(model: Any) -> str:
    """
    The fingerprint of every local directory a ``fairscale::from_pretrained`` of the model reads
    (:func:`~tango_fairscale.finetune.safetensors_files.fingerprint`), "" when it reads none: what
    the hosts of a launch compare before training.
    """
    parts = []
    for config in _configs_of_type(params_of(model), PRETRAINED_TYPE):
        name = config.get("pretrained_model_name_or_path")
        directory = Path(os.path.expanduser(str(name))) if isinstance(name, str) else None
        if directory is not None and directory.is_dir():
            parts.append(f"{directory.resolve()}={fingerprint(directory)}")
    return ";".join(sorted(parts))


def check_export_hf_model(built: Any) -> None:
    """``export_hf`` needs a ``transformers`` model in the step's model: the engine's rule and message."""
    if hf_model_in(built) is None:
        raise _no_hf_model_error()


def preflight(
    *,
    model: Any,
    training_engine: Any,
    dataset_dict: Any,
    train_dataloader: Any,
    devices: Any = None,
    train_split: str = "train",
    validation_split: Optional[str] = None,
    validation_dataloader: Any = None,
    work_dir: Optional[Path] = None,
    hosts: int = 1,
    **step_options: Any,
) -> EngineOptions:
    """
    All checks, in the order a user would fix them. Takes ``TorchTrainStep._train``'s arguments,
    and the number of ``hosts`` of a launch across hosts; returns the engine's options.
    A mistake is raised as :class:`PreflightError`, which Tango prints as its message alone.
    """
    try:
        return _preflight(
            model=model,
            training_engine=training_engine,
            dataset_dict=dataset_dict,
            train_dataloader=train_dataloader,
            devices=devices,
            train_split=train_split,
            validation_split=validation_split,
            validation_dataloader=validation_dataloader,
            work_dir=work_dir,
            hosts=hosts,
            **step_options,
        )
    except PreflightError:
        raise
    except ConfigurationError as error:
        # Without Tango's 25-line traceback above it: the config's mistake is all there is to say.
        raise PreflightError(f"{type(error).__name__}: {error}") from None


class PreflightError(ConfigurationError, CliRunError):
    """A config mistake found before the workers start; Tango logs a ``CliRunError`` as its message alone."""


def _preflight(
    *,
    model: Any,
    training_engine: Any,
    dataset_dict: Any,
    train_dataloader: Any,
    devices: Any,
    train_split: str,
    validation_split: Optional[str],
    validation_dataloader: Any,
    work_dir: Optional[Path],
    hosts: int = 1,
    **step_options: Any,
) -> EngineOptions:
    engine = params_of(training_engine)
    devices = list(devices or [])
    world_size = len(devices)
    check_counts(step_options)
    check_engine_keys(training_engine)
    check_splits(dataset_dict, train_split, validation_split)
    train_loader = params_of(train_dataloader)
    train_steps = planned_train_steps(step_options, dataset_dict[train_split], train_loader, world_size)
    options = check_engine(engine, world_size, work_dir, devices_are_cpu(devices), hosts, train_steps)
    if options.accumulate_grads_locally is True and step_options.get("grad_accum", 1) == 1:
        warnings.warn(
            "training_engine.accumulate_grads_locally has no effect with grad_accum 1: every batch is the "
            "last micro-batch of its optimizer step. Set the step's grad_accum to accumulate.",
            UserWarning,
            stacklevel=2,
        )
    check_sampler(train_loader, dataset_dict[train_split], "train_dataloader")
    check_batches(
        train_loader, dataset_dict[train_split], train_split, "train_dataloader", world_size, training=True
    )
    if validation_split is not None:
        loader = validation_dataloader if validation_dataloader is not None else train_dataloader
        name = (
            "validation_dataloader"
            if validation_dataloader is not None
            else "train_dataloader (used for validation)"
        )
        check_sampler(params_of(loader), dataset_dict[validation_split], name)
        check_batches(params_of(loader), dataset_dict[validation_split], validation_split, name, world_size)
    check_callbacks(step_options.get("callbacks"), train_steps)
    check_model_keys(model)
    check_pretrained_models(model, options.init_on_meta)
    built = check_model(
        model,
        options.fsdp_config,
        amp=options.amp,
        init_on_meta=options.init_on_meta,
        backend=options.backend,
        export_hf=options.export_hf,
        data=[(name, dataset_dict[name]) for name in (train_split, validation_split) if name is not None],
    )
    if built is not None:
        # Room for the exports, now that their size is known: before, a full disk was found after training.
        adapter = any("lora_" in name for name, _ in built.named_parameters())
        if options.export_hf_merged is not None and not adapter:
            raise _no_adapters_error()
        check_export_hf(options.export_hf, work_dir, "export_hf", export_bytes(built, trained_only=adapter))
        check_export_hf(options.export_hf_merged, work_dir, "export_hf_merged", export_bytes(built))
    return options


def export_bytes(model: Any, trained_only: bool = False) -> int:
    """What an export of ``model`` holds, about: its parameters (each tied one once) and buffers."""
    seen: Dict[int, int] = {}
    for param in model.parameters():
        if param.requires_grad or not trained_only:
            seen[id(param)] = param.numel() * param.element_size()
    if not trained_only:
        for buffer in model.buffers():
            seen[id(buffer)] = buffer.numel() * buffer.element_size()
    return sum(seen.values())
