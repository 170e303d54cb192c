"""
Pretrained Hugging Face models as the model of a ``torch::train`` step: the model constructor
``"fairscale::from_pretrained"``.

With the engine's ``init_on_meta``, the model is built from its ``config.json`` on ``meta`` and
every parameter is marked with where its pretrained value lies in the directory's safetensors
files (:func:`~tango_fairscale.materialize.mark_pretrained`): each FSDP unit reads its own tensors
from the memory-mapped files as it is allocated and sharded, so no worker holds the whole model at
once. The files are mapped read-only and shared, so their pages are the page cache's, not the
worker's private memory (``safetensors``' own ``safe_open`` maps them private and writable, which
``VmData``, ``RLIMIT_DATA`` and cgroups count in full for as long as a file is open). Without
``init_on_meta`` (and with Tango's DDP engine), it is ``from_pretrained`` of the ``transformers``
class, the whole model on every worker. Tied parameters (an embedding and its LM head) are one
parameter of the model either way, so they stay tied.

Any other way to ``from_pretrained`` (Tango's own ``transformers::AutoModelForCausalLM::from_pretrained``
and the like, or a model constructor of the user's that calls it) loads the same way under
``init_on_meta``: patch H2 of :mod:`tango_fairscale.compat` routes ``transformers``'
``PreTrainedModel.from_pretrained`` to :func:`load_on_meta` in a thread that builds on ``meta``.
"""

import copy
import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError

from ..errors import did_you_mean
from ..materialize import building_on_meta, mark_pretrained, not_recorded
from ..registry import register_model_constructor

# read_header and SAFETENSORS_FILE are also this module's for the benchmarks' and tests' use.
from .safetensors_files import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    SafetensorsFiles,
    has_safetensors,
    read_header,
)

__all__ = [
    "PRETRAINED_TYPE",
    "SAFETENSORS_FILE",
    "SafetensorsFiles",
    "from_pretrained",
    "load_on_meta",
    "read_header",
    "shapes_only",
]

#: The registered name of :func:`from_pretrained`.
PRETRAINED_TYPE = "fairscale::from_pretrained"


def _model_class(auto_class: str) -> Any:
    import transformers

    model_class = getattr(transformers, auto_class, None)
    if model_class is None or not hasattr(model_class, "from_pretrained"):
        raise ConfigurationError(
            f"fairscale::from_pretrained: auto_class {auto_class!r} is not a transformers model class: "
            "use one such as 'AutoModelForCausalLM', 'AutoModelForSeq2SeqLM' or 'AutoModel'."
        )
    return model_class


def _local_directory(pretrained_model_name_or_path: str) -> Optional[Path]:
    path = Path(os.path.expanduser(pretrained_model_name_or_path))
    return path if path.is_dir() else None


def mark_from_files(model: nn.Module, files: SafetensorsFiles) -> int:
    """
    Mark every ``meta`` parameter of ``model`` with its tensor in ``files`` (tied parameters are
    one parameter, under their first name). Raises naming the parameters the files lack.
    Returns the number of parameters marked.
    """
    available = set(files.names())
    missing, marked = [], 0
    for name, param in model.named_parameters():
        if name not in available:
            missing.append(name)
            continue
        mark_pretrained(param, files.reader(name), origin=(str(files.file_of[name]), name))
        marked += 1
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigurationError(
            f"{files.source}: {files.directory} has no tensor for {shown}. Is it a checkpoint of "
            "this model class? Loading it without init_on_meta lets "
            "transformers map or initialise what it lacks."
        )
    return marked


@torch.no_grad()
def load_buffers(model: nn.Module, files: SafetensorsFiles) -> int:
    """
    Copy into ``model``'s persistent buffers the values ``files`` hold for them (e.g. batch norm
    statistics), as ``from_pretrained`` does. Buffers stay real under ``init_on_meta`` (they are
    small, and many are computed in ``__init__``), so they are read here, not per unit; a buffer
    the files lack keeps its computed value, as with ``from_pretrained``. Returns how many were read
    (buffers on ``meta`` are skipped).
    """
    available = set(files.names())
    loaded = 0
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():
            key = f"{prefix}.{name}" if prefix else name
            if buffer is None or name in module._non_persistent_buffers_set or key not in available:
                continue
            if buffer.is_meta:  # a model built under a meta device (pre-flight): nothing to hold values
                continue
            buffer.copy_(files.read(key))
            loaded += 1
    return loaded


# --- The inputs of fairscale::from_pretrained, checked (pre-flight calls check_pretrained) ---------------

#: Seconds pre-flight waits for the hub to answer whether a model exists, once, without retrying
#: (``huggingface_hub`` retries an unreachable hub for about 25 s per file, transformers per file).
HUB_PROBE_SECONDS = 10.0
#: Keyword arguments a ``transformers`` config takes that are not fields of it.
_CONFIG_ARGUMENTS = ("attn_implementation",)


def _shown(names: Sequence[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _hub_offline() -> bool:
    """Whether ``huggingface_hub`` and ``transformers`` use the local cache only (``HF_HUB_OFFLINE``)."""
    from huggingface_hub import constants
    from transformers.utils import is_offline_mode

    return bool(constants.HF_HUB_OFFLINE) or bool(is_offline_mode())


def pretrained_directory(pretrained_model_name_or_path: str) -> Optional[Path]:
    """
    The local directory ``pretrained_model_name_or_path`` names, or ``None`` for a hub name that
    ``transformers`` can load: in the Hugging Face cache, or (unless ``HF_HUB_OFFLINE`` is set)
    on a hub that answered at once that it has it. Anything else is a one-line
    :class:`ConfigurationError`, instead of transformers' retries (minutes without a network).
    """
    from huggingface_hub import constants, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status, validate_repo_id

    name = pretrained_model_name_or_path
    where = f"fairscale::from_pretrained: pretrained_model_name_or_path {name!r}"
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return path
    if path.exists():
        raise ConfigurationError(
            f"{where} is a file, not a directory: give the directory save_pretrained wrote (config.json "
            "and the weights)."
        )
    try:
        validate_repo_id(name)
    except ValueError:  # HFValidationError: a path, not a hub name
        raise ConfigurationError(
            f"{where}: no such directory. Give the directory save_pretrained wrote (config.json and the "
            "weights), or a Hugging Face hub name such as 'openai-community/gpt2'."
        ) from None
    cached = try_to_load_from_cache(name, "config.json")
    if isinstance(cached, str):
        return None  # the cache holds it: transformers loads it from there when the hub is unreachable
    fix = (
        "Give a local directory save_pretrained wrote, or download the model into the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}) first (huggingface-cli download {name})"
    )
    if _hub_offline():
        raise ConfigurationError(
            f"{where} is not a local directory, and HF_HUB_OFFLINE is set while the Hugging Face cache "
            f"does not hold it. {fix}."
        )
    try:
        response = get_session().head(
            hf_hub_url(name, "config.json"),
            headers=build_hf_headers(),
            timeout=HUB_PROBE_SECONDS,
            allow_redirects=False,
        )
        hf_raise_for_status(response)
    except OSError as error:  # requests' errors are OSErrors, huggingface_hub's HTTP errors too
        if getattr(error, "response", None) is not None:
            raise ConfigurationError(
                f"{where} is not a local directory, and the hub does not give it: {_first_line(error)}. "
                f"{fix}; a gated or private model needs a token (huggingface-cli login)."
            ) from None
        raise ConfigurationError(
            f"{where} is not a local directory, and the Hugging Face hub ({constants.ENDPOINT}) cannot be "
            f"reached ({type(error).__name__}). {fix}, and set HF_HUB_OFFLINE=1 to load it from there."
        ) from None
    return None


def check_config_overrides(config: Any, overrides: Mapping[str, Any], where: str) -> None:
    """
    Every key of ``config_overrides`` is a field of ``config`` (read from ``where``): transformers
    drops a key that is not one without a word (under ``init_on_meta``), or fails in the model's
    constructor. Raises naming the key and the nearest field.
    """
    fields = sorted({*config.to_dict(), *getattr(config, "attribute_map", {})})
    for key in overrides:
        if key in fields or key in _CONFIG_ARGUMENTS:
            continue
        hint = did_you_mean(str(key), fields) or f"use a field of {where}."
        raise ConfigurationError(
            f"fairscale::from_pretrained: config_overrides.{key} is not a field of {type(config).__name__} "
            f"({where}), so it would change nothing: {hint}"
        )
    for key, value in overrides.items():
        current = getattr(config, key, None) if key in fields else None
        if not _same_kind(current, value):
            raise ConfigurationError(
                f"fairscale::from_pretrained: config_overrides.{key}: {value!r} is of type "
                f"{type(value).__name__}, where {type(config).__name__}'s {key} is of type "
                f"{type(current).__name__} ({current!r} in {where})."
            )


def _same_kind(current: Any, value: Any) -> bool:
    """Whether an override ``value`` can stand where the config holds ``current`` (scalars only)."""
    if current is None or value is None or not isinstance(current, (bool, int, float, str)):
        return True  # unset, or a structure whose form the model's config checks itself
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, (int, float)):
        return isinstance(value, (int, float))  # a field such as rope_theta is saved either way
    return isinstance(value, str)


def check_auto_class(model_class: Any, auto_class: str, config: Any, where: str) -> None:
    """That ``auto_class`` builds the model ``config`` (from ``where``) describes, else which do."""
    import transformers

    def fits(candidate: Any) -> bool:
        mapping = getattr(candidate, "_model_mapping", None)
        if mapping is not None:  # an Auto class
            return type(config) in mapping
        config_class = getattr(candidate, "config_class", None)
        return config_class is None or isinstance(config, config_class)

    if fits(model_class):
        return
    fitting = [
        name
        for name in sorted(dir(transformers))
        if name.startswith("AutoModel") and fits(getattr(transformers, name, None))
    ]
    raise ConfigurationError(
        f"fairscale::from_pretrained: auto_class {auto_class!r} does not build the model of {where} "
        f"({type(config).__name__}, model_type {getattr(config, 'model_type', '?')!r}): use one of "
        f"{', '.join(repr(name) for name in fitting[:6]) or 'a transformers class of that model'}."
    )


def _unexpected_keys(model: nn.Module) -> Optional["re.Pattern[str]"]:
    """The names transformers itself loads past without a word (``_keys_to_ignore_on_load_unexpected``)."""
    patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    if any(name.endswith("rotary_emb.inv_freq") for name, _ in model.named_buffers()):
        patterns.append(r"rotary_emb\.inv_freq")  # as transformers: old checkpoints have one per layer
    return re.compile("|".join(f"({pattern})" for pattern in patterns)) if patterns else None


def check_fits(model: nn.Module, files: SafetensorsFiles, *, exact: bool) -> None:
    """
    That ``files`` hold ``model``'s weights (``model`` built from the directory's ``config.json``,
    on ``meta``), reading every file's header: each tensor for a parameter or persistent buffer of
    the model has its shape; with ``exact`` (under ``init_on_meta``, where names must match and a
    tensor without a parameter is dropped without a word) every tensor has a place in the model.
    Without it, names are matched as transformers matches them (with or without the base model's
    prefix), and tensors without a place are transformers' to warn about. Raises naming the tensors
    and their files.
    """
    shapes: Dict[str, Optional[Tuple[int, ...]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shapes[name] = tuple(param.shape)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None:
                # A non-persistent buffer is computed, not loaded: any shape in a file is harmless.
                persistent = name not in module._non_persistent_buffers_set
                shapes[f"{prefix}.{name}" if prefix else name] = tuple(buffer.shape) if persistent else None
    base = getattr(model, "base_model_prefix", "") or ""
    ignored = _unexpected_keys(model)
    differing: List[str] = []
    unused: List[str] = []
    for name in files.names():
        saved = tuple(int(n) for n in files.entry(name)[1]["shape"])  # reads and checks the header
        candidates = [name] if exact or not base else [name, f"{base}.{name}", name.removeprefix(f"{base}.")]
        place = next((candidate for candidate in candidates if candidate in shapes), None)
        if place is None:
            if ignored is None or ignored.search(name) is None:
                unused.append(name)
            continue
        expected = shapes[place]
        if expected is not None and expected != saved:
            differing.append(
                f"{name} is {list(saved)} in {files.file_of[name]}, {list(expected)} in the model"
            )
    directory = files.directory
    if differing:
        more = f" (and {len(differing) - 2} more)" if len(differing) > 2 else ""
        raise ConfigurationError(
            f"{files.source}: the model {directory / 'config.json'} describes does not fit the weights "
            f"beside it: {'; '.join(differing[:2])}{more}. Use the config.json saved with these weights, "
            "without config_overrides that change the model's shape."
        )
    if exact and unused:
        held_in = sorted({str(files.file_of[name]) for name in unused})
        raise ConfigurationError(
            f"{files.source}: {_shown(unused)} in {_shown(held_in, 2)} have no place in the "
            f"{type(model).__name__} that {directory / 'config.json'} describes (fewer layers than the "
            "weights?), and under init_on_meta they would be dropped without a word. Use the config.json "
            "saved with these weights, or save only the tensors the model has."
        )


def check_pretrained(
    pretrained_model_name_or_path: Any,
    auto_class: Any = "AutoModelForCausalLM",
    config_overrides: Optional[Mapping[str, Any]] = None,
    *,
    init_on_meta: bool = False,
) -> None:
    """
    The inputs of a ``fairscale::from_pretrained`` model, in Tango's main process before any worker
    starts (``init_on_meta`` as the engine's): the class, the directory (or hub name, see
    :func:`pretrained_directory`), its ``config.json``, ``config_overrides``, and without
    ``init_on_meta`` the safetensors headers against the model the config describes (under
    ``init_on_meta`` pre-flight's build on ``meta`` loads as the workers do, and :func:`_load_files`
    checks them there). One :class:`ConfigurationError` naming the field or file.
    """
    model_class = _model_class(str(auto_class))
    directory = pretrained_directory(str(pretrained_model_name_or_path))
    if directory is None:
        return  # a hub model: transformers fetches it and its files
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigurationError(
            f"fairscale::from_pretrained: {directory} has no config.json, so which model its weights are "
            "of is unknown: give the directory save_pretrained wrote (config.json beside the weights)."
        )
    from transformers import AutoConfig

    overrides = dict(config_overrides or {})
    try:
        config = AutoConfig.from_pretrained(str(directory))
        check_config_overrides(config, overrides, str(config_file))
        config = AutoConfig.from_pretrained(str(directory), **overrides)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigurationError(
            f"fairscale::from_pretrained: {config_file} is not a config transformers can read: "
            f"{_first_line(error)}"
        ) from None
    check_auto_class(model_class, str(auto_class), config, str(config_file))
    in_safetensors = any((directory / name).is_file() for name in (SAFETENSORS_FILE, SAFETENSORS_INDEX))
    if init_on_meta or not in_safetensors:
        return  # weights in another format: transformers reads and checks them
    files = SafetensorsFiles(directory)
    with torch.device("meta"):
        # An Auto class builds from a config with from_config, a model class with its constructor.
        build = getattr(model_class, "from_config", model_class)
        model = build(config)
    check_fits(model, files, exact=False)


def _snapshot(repo_id: str, subfolder: str = "", **hub_arguments: Any) -> Path:
    """A hub model's config and safetensors files, downloaded (or found in the cache)."""
    from huggingface_hub import snapshot_download

    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    root = snapshot_download(
        repo_id, allow_patterns=[f"{prefix}*.json", f"{prefix}*.safetensors"], **hub_arguments
    )
    return Path(root) / subfolder if subfolder else Path(root)


#: The directories built from their ``config.json`` alone within :func:`shapes_only`; ``None`` outside it.
_SHAPES_ONLY: ContextVar[Optional[List[Path]]] = ContextVar("tango_fairscale_shapes_only", default=None)


@contextmanager
def shapes_only() -> Iterator[List[Path]]:
    """
    For ``plan``, which needs a model's shapes, never its values: within this context a pretrained
    directory without safetensors files (only its ``config.json``: a 7 B model planned before its
    weights are downloaded) builds on ``meta`` as it would with them, its parameters marked as
    read from files that a run needs there. Yields the list of such directories, filled as they
    are built. A directory with the files is read and checked as always.
    """
    directories: List[Path] = []
    token = _SHAPES_ONLY.set(directories)
    try:
        yield directories
    finally:
        _SHAPES_ONLY.reset(token)


def _not_there(directory: Path, name: str) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        raise ConfigurationError(
            f"{directory} has no weights to read {name} from (planned from config.json alone)"
        )

    return read


def _load_files(model: nn.Module, directory: Path, source: str) -> None:
    """Mark ``model``'s ``meta`` parameters with their tensors in ``directory`` and read its buffers."""
    planned = _SHAPES_ONLY.get()
    if planned is not None and not has_safetensors(directory):
        # Marked, not initialised: checking or drawing initial values of 7 B parameters is what
        # made such a plan take minutes; buffers keep the values the constructor computed.
        for name, param in model.named_parameters():
            mark_pretrained(param, _not_there(directory, name))
        if directory not in planned:
            planned.append(directory)
        return
    files = SafetensorsFiles(directory, source)
    mark_from_files(model, files)
    check_fits(model, files, exact=True)
    load_buffers(model, files)


@register_model_constructor(PRETRAINED_TYPE)
def from_pretrained(
    pretrained_model_name_or_path: str,
    auto_class: str = "AutoModelForCausalLM",
    # A plain dict: under Dict[str, Any] Tango reads a nested dict with a "type" key (Llama's
    # rope_scaling: {"type": "linear", ...}) as an object to construct, and fails.
    config_overrides: Optional[dict] = None,  # type: ignore[type-arg]
) -> nn.Module:
    """
    A pretrained ``transformers`` model, by ``auto_class`` (``"AutoModelForCausalLM"`` by
    default) from ``pretrained_model_name_or_path``: a local directory ``save_pretrained`` wrote,
    or a hub name where the hub is reachable. ``config_overrides`` change fields of its config
    (e.g. ``{"resid_pdrop": 0.0}``). Under the engine's ``init_on_meta`` a local directory's
    tensors are read unit by unit as the model is sharded (see the module's docstring); a hub name
    is downloaded first.
    """
    model_class = _model_class(auto_class)
    overrides = dict(config_overrides or {})
    if not building_on_meta():
        return model_class.from_pretrained(pretrained_model_name_or_path, **overrides)  # type: ignore[no-any-return]
    from transformers import AutoConfig

    directory = _local_directory(pretrained_model_name_or_path) or _snapshot(pretrained_model_name_or_path)
    config = AutoConfig.from_pretrained(str(directory), **overrides)
    check_config_overrides(config, overrides, str(directory / "config.json"))
    # Parameters land on meta as they are registered: nothing is allocated or initialised here,
    # and, as in transformers' from_pretrained, no random number is drawn (see not_recorded).
    with not_recorded():
        model = model_class.from_config(config)
    _load_files(model, directory, "fairscale::from_pretrained")
    return model  # type: ignore[no-any-return]


# --- transformers' from_pretrained, routed here under init_on_meta (patch H2) -------------------------

#: ``from_pretrained`` arguments (transformers 4.57) that say where the files are and how to fetch them.
_HUB_ARGUMENTS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "proxies")
#: Arguments that change nothing this loader does: internal to transformers' own calls, or no-ops there.
_IGNORED_ARGUMENTS = (
    "_from_auto",
    "_from_pipeline",
    "_commit_hash",
    "code_revision",
    "trust_remote_code",
    "weights_only",
    "resume_download",
    "mirror",
    "_fast_init",
    "low_cpu_mem_usage",
    "offload_state_dict",
)
#: Arguments that change what or how transformers loads, which reading each unit's tensors as they
#: are saved cannot do, each with the value that changes nothing.
_UNSUPPORTED_ARGUMENTS: Dict[str, Any] = {
    "dtype": None,
    "torch_dtype": None,
    "state_dict": None,
    "from_tf": False,
    "from_flax": False,
    "output_loading_info": False,
    "ignore_mismatched_sizes": False,
    "variant": None,
    "device_map": None,
    "max_memory": None,
    "offload_folder": None,
    "offload_buffers": False,
    "load_in_8bit": False,
    "load_in_4bit": False,
    "quantization_config": None,
    "adapter_name": "default",
    "generation_config": None,
    "gguf_file": None,
    "tp_plan": None,
    "tp_size": None,
    "distributed_config": None,
    "device_mesh": None,
    "use_kernels": False,
    "key_mapping": None,
}


def _unsupported(kwargs: Dict[str, Any]) -> List[str]:
    """The arguments of a ``from_pretrained`` call that :func:`load_on_meta` cannot honour."""
    refused = [
        f"{name}={kwargs[name]!r}"
        for name, neutral in _UNSUPPORTED_ARGUMENTS.items()
        if name in kwargs and kwargs[name] != neutral
    ]
    if kwargs.get("use_safetensors") is False:
        refused.append("use_safetensors=False")
    adapter = kwargs.get("adapter_kwargs") or {}
    if "_adapter_model_path" in adapter:
        refused.append(f"a PEFT adapter ({adapter['_adapter_model_path']})")
    return refused


def _split_arguments(kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], str, Dict[str, Any]]:
    """``from_pretrained``'s keyword arguments: (the hub's, the subfolder, the config's and the model's)."""
    rest = dict(kwargs)
    for name in (*_IGNORED_ARGUMENTS, *_UNSUPPORTED_ARGUMENTS, "use_safetensors", "adapter_kwargs"):
        rest.pop(name, None)
    hub = {name: rest.pop(name) for name in _HUB_ARGUMENTS if name in rest}
    legacy_token = rest.pop("use_auth_token", None)
    if legacy_token is not None and hub.get("token") is None:
        hub["token"] = legacy_token
    subfolder = rest.pop("subfolder", "") or ""
    return hub, subfolder, rest


def load_on_meta(
    model_class: Any, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any
) -> nn.Module:
    """
    ``model_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)`` (a
    ``transformers`` model class) in a thread that builds on ``meta``: H2 calls this instead of
    transformers' loading, whose values the engine's ``init_on_meta`` would lose. Built from the
    config as ``from_pretrained`` builds it (config arguments and ``config`` as it takes them, the
    remaining keyword arguments to the model's ``__init__``, tied weights tied, evaluation mode),
    its parameters on ``meta``, each marked with its tensor in the safetensors files and read when
    its unit is materialised, exactly as ``fairscale::from_pretrained`` reads them; persistent
    buffers and ``generation_config.json`` read now. Like ``from_pretrained`` (transformers 4.57:
    its modules are created without initialising them), it draws no random number, so a
    constructor that adds modules after it (peft's adapters, a new head) draws the numbers an eager
    build draws, and init_on_meta gives them the eager values. Arguments that change how or what is loaded
    (``dtype``, ``device_map``, quantization, adapters, ...) and files that are not safetensors
    are refused, naming them: loading something else than the saved tensors is never silent.
    """
    from transformers import PretrainedConfig

    source = (
        f"{model_class.__name__}.from_pretrained({str(pretrained_model_name_or_path)!r}) under init_on_meta"
    )
    refused = _unsupported(kwargs)
    if refused:
        raise ConfigurationError(
            f"{source}: {', '.join(refused)} cannot be applied when each FSDP unit reads its tensors "
            "from the saved safetensors files as it is sharded. Remove "
            f"{'it' if len(refused) == 1 else 'them'} from the model's config, or set "
            "training_engine.init_on_meta: false (every worker then loads the whole model with "
            "transformers' own from_pretrained)."
        )
    hub, subfolder, rest = _split_arguments(kwargs)
    config = rest.pop("config", None)
    attn_implementation = rest.pop("attn_implementation", None)
    name = str(pretrained_model_name_or_path)
    directory = _local_directory(name)
    if directory is not None:
        directory = directory / subfolder if subfolder else directory
    else:
        directory = _snapshot(name, subfolder, **hub)
    if isinstance(config, PretrainedConfig):
        config, model_kwargs = copy.deepcopy(config), rest
    else:
        # As transformers: arguments that name fields of the config set them, the rest go to the model.
        config_source, config_hub = (str(config), hub) if config is not None else (str(directory), {})
        config, model_kwargs = model_class.config_class.from_pretrained(
            config_source, return_unused_kwargs=True, **config_hub, **rest
        )
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    config.name_or_path = name
    # Parameters land on meta as they are registered: nothing is allocated or initialised here,
    # and, as in transformers' from_pretrained, no random number is drawn (see not_recorded).
    with not_recorded():
        model = model_class(config, *model_args, **model_kwargs)
        model.tie_weights()
    _load_files(model, directory, source)
    if model.can_generate() and (directory / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    model.eval()  # as from_pretrained returns it; Tango's loop calls train()
    return model  # type: ignore[no-any-return]
