"""
Pretrained Hugging Face models as the model of a ``torch::train`` step: the model constructor
``"fairscale::from_pretrained"``.

With the engine's ``init_on_meta``, the model is built from its ``config.json`` on ``meta`` and
every parameter is marked with where its pretrained value lies in the directory's safetensors
files (:func:`~tango_fairscale.materialize.mark_pretrained`): each FSDP unit reads its own tensors
from the memory-mapped files as it is allocated and sharded, so no worker holds the whole model at
once, and the files' pages are shared with the page cache rather than copied. Without
``init_on_meta`` (and with Tango's DDP engine), it is ``from_pretrained`` of the ``transformers``
class, the whole model on every worker. Tied parameters (an embedding and its LM head) are one
parameter of the model either way, so they stay tied.
"""

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError

from .materialize import building_on_meta, mark_pretrained
from .registry import register_model_constructor

#: The files of a directory ``save_pretrained`` wrote: one safetensors file, or shards and their index.
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class SafetensorsFiles:
    """
    The tensors of a ``save_pretrained`` directory by name, each read on its own from its
    memory-mapped file (``safetensors.safe_open``): reading one does not read the others.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = directory / SAFETENSORS_INDEX
        if index.is_file():
            weight_map: Dict[str, str] = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: directory / file for name, file in weight_map.items()}
        elif (directory / SAFETENSORS_FILE).is_file():
            from safetensors import safe_open

            single = directory / SAFETENSORS_FILE
            with safe_open(str(single), framework="pt") as handle:
                self.file_of = {name: single for name in handle.keys()}
        else:
            raise ConfigurationError(
                f"fairscale::from_pretrained: {directory} has neither {SAFETENSORS_FILE} nor "
                f"{SAFETENSORS_INDEX}. Save the model with save_pretrained(..., safe_serialization=True) "
                "(transformers' default), or load it without init_on_meta."
            )
        self._handles: Dict[Path, Any] = {}

    def names(self) -> List[str]:
        return list(self.file_of)

    def read(self, name: str) -> torch.Tensor:
        path = self.file_of[name]
        handle = self._handles.get(path)
        if handle is None:
            from safetensors import safe_open

            handle = self._handles[path] = safe_open(str(path), framework="pt")
        return handle.get_tensor(name)  # type: ignore[no-any-return]

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
