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
import json
import math
import mmap
import os
import struct
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError

from .hf_export import SAFETENSORS_DTYPES
from .materialize import building_on_meta, mark_pretrained
from .registry import register_model_constructor

#: The files of a directory ``save_pretrained`` wrote: one safetensors file, or shards and their index.
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


#: A safetensors header larger than this is not one (the format's own limit is 100 MB).
_MAX_HEADER_BYTES = 100_000_000


def read_header(path: Path) -> Tuple[int, Dict[str, Dict[str, Any]]]:
    """
    The offset where the tensor data of safetensors file ``path`` starts, and its header's
    entries by tensor name (``dtype``, ``shape``, ``data_offsets``), each checked against the file.
    """
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        try:
            if not 0 < length <= min(_MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(handle.read(length))
            if not isinstance(header, dict):
                raise ValueError("a header that is not a JSON object")
        except ValueError as error:  # json's errors are ValueErrors too
            raise ConfigurationError(f"{path} is not a safetensors file: {error}.") from None
    header.pop("__metadata__", None)
    data_start = 8 + length
    for name, entry in header.items():
        try:
            begin, end = (int(offset) for offset in entry["data_offsets"])
            shape = [int(n) for n in entry["shape"]]
            dtype_name = str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ConfigurationError(
                f"{path} is not a safetensors file: its entry {name!r} is {entry!r}."
            ) from None
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise ConfigurationError(f"{path}: {name} has the dtype {dtype_name}, which torch cannot read.")
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != expected:
            raise ConfigurationError(
                f"{path}: {name} has {end - begin} bytes for {expected} bytes of tensor."
            )
        if begin < 0 or data_start + end > size:
            raise ConfigurationError(
                f"{path}: {name} lies past the end of the file: it is damaged or cut short."
            )
    return data_start, header


class SafetensorsFiles:
    """
    The tensors of a ``save_pretrained`` directory by name, each read on its own from its
    memory-mapped file: reading one does not read the others. The files are mapped read-only and
    shared (``MAP_SHARED``, ``PROT_READ``): the pages are the page cache's, and a tensor read is
    a view of them, which sharding copies out of (a write through it would fault, not reach the file).
    """

    def __init__(self, directory: Path, source: str = "fairscale::from_pretrained") -> None:
        self.directory = directory
        #: What loads them, for errors.
        self.source = source
        index = directory / SAFETENSORS_INDEX
        if index.is_file():
            weight_map: Dict[str, str] = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: directory / file for name, file in weight_map.items()}
        elif (directory / SAFETENSORS_FILE).is_file():
            single = directory / SAFETENSORS_FILE
            self.file_of = {name: single for name in read_header(single)[1]}
        else:
            raise ConfigurationError(
                f"{source}: {directory} has neither {SAFETENSORS_FILE} nor "
                f"{SAFETENSORS_INDEX}. Save the model with save_pretrained(..., safe_serialization=True) "
                "(transformers' default), or load it without init_on_meta."
            )
        self._headers: Dict[Path, Tuple[int, Dict[str, Dict[str, Any]]]] = {}
        self._maps: Dict[Path, mmap.mmap] = {}

    def names(self) -> List[str]:
        return list(self.file_of)

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name``, a read-only view of its file's mapping: never written through (it faults)."""
        path = self.file_of[name]
        if path not in self._headers:
            self._headers[path] = read_header(path)
        data_start, header = self._headers[path]
        if name not in header:
            raise ConfigurationError(f"{path} has no tensor {name}, which {SAFETENSORS_INDEX} places there.")
        entry = header[name]
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"]
        count = math.prod(shape)
        if count == 0:  # nothing to map (frombuffer takes no empty range)
            return torch.empty(shape, dtype=dtype)
        if path not in self._maps:
            with open(path, "rb") as handle:
                self._maps[path] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            # That the buffer is read-only is the point: the tensor is copied, never written.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensor = torch.frombuffer(
                self._maps[path], dtype=dtype, count=count, offset=data_start + entry["data_offsets"][0]
            )
        return tensor.view(shape)

    def reader(self, name: str) -> Callable[[], torch.Tensor]:
        return lambda: self.read(name)


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
        mark_pretrained(param, files.reader(name))
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


def _snapshot(repo_id: str, subfolder: str = "", **hub_arguments: Any) -> Path:
    """A hub model's config and safetensors files, downloaded (or found in the cache)."""
    from huggingface_hub import snapshot_download

    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    root = snapshot_download(
        repo_id, allow_patterns=[f"{prefix}*.json", f"{prefix}*.safetensors"], **hub_arguments
    )
    return Path(root) / subfolder if subfolder else Path(root)


def _load_files(model: nn.Module, directory: Path, source: str) -> None:
    """Mark ``model``'s ``meta`` parameters with their tensors in ``directory`` and read its buffers."""
    files = SafetensorsFiles(directory, source)
    mark_from_files(model, files)
    load_buffers(model, files)


@register_model_constructor("fairscale::from_pretrained")
def from_pretrained(
    pretrained_model_name_or_path: str,
    auto_class: str = "AutoModelForCausalLM",
    config_overrides: Optional[Dict[str, Any]] = None,
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
    # Parameters land on meta as they are registered: nothing is allocated or initialised here.
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
    buffers and ``generation_config.json`` read now. Arguments that change how or what is loaded
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
    # Parameters land on meta as they are registered: nothing is allocated or initialised here.
    model = model_class(config, *model_args, **model_kwargs)
    model.tie_weights()
    _load_files(model, directory, source)
    if model.can_generate() and (directory / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(directory))
    model.eval()  # as from_pretrained returns it; Tango's loop calls train()
    return model  # type: ignore[no-any-return]
