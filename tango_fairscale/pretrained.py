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
"""

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

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / SAFETENSORS_INDEX
        if index.is_file():
            weight_map: Dict[str, str] = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: directory / file for name, file in weight_map.items()}
        elif (directory / SAFETENSORS_FILE).is_file():
            single = directory / SAFETENSORS_FILE
            self.file_of = {name: single for name in read_header(single)[1]}
        else:
            raise ConfigurationError(
                f"fairscale::from_pretrained: {directory} has neither {SAFETENSORS_FILE} nor "
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
            f"fairscale::from_pretrained: {files.directory} has no tensor for {shown}. Is it a "
            "checkpoint of this model class (auto_class)? Loading it without init_on_meta lets "
            "transformers map or initialise what it lacks."
        )
    return marked


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

    directory = _local_directory(pretrained_model_name_or_path)
    if directory is None:
        from huggingface_hub import snapshot_download

        directory = Path(
            snapshot_download(pretrained_model_name_or_path, allow_patterns=["*.json", "*.safetensors"])
        )
    config = AutoConfig.from_pretrained(str(directory), **overrides)
    # Parameters land on meta as they are registered: nothing is allocated or initialised here.
    model = model_class.from_config(config)
    mark_from_files(model, SafetensorsFiles(directory))
    return model  # type: ignore[no-any-return]
