"""
Trained weights out as a directory ``transformers`` loads with ``from_pretrained``:
``config.json`` (and ``generation_config.json`` for generative models), the weights as
safetensors (one file, or shards and their index, named as ``save_pretrained`` names them) and
the tokenizer files of the directory the model was loaded from, if it had them.

The weights come from a ``weights.pt`` (the engine's, or one ``consolidate`` wrote), mapped
shared rather than read into private memory, and are written one tensor at a time in
safetensors' own layout (:func:`write_safetensors`; for one file the bytes are
``safetensors.torch.save_file``'s), so an export needs the largest tensor's memory, not the
model's. The directory is written under a temporary name and renamed into place: a crash leaves
the previous directory or none, never a half one.
"""

import json
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .backends.base import ModelSource
from .checkpointing.files import fsync_directory, safe_load
from .errors import CheckpointError

#: Shards of at most this many bytes of tensor data, as ``save_pretrained``'s default ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
#: Files of a model's directory that go with its weights: the tokenizer's (any of them).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
)

#: safetensors' dtype names, in the order of its ``Dtype`` enum: tensors are laid out by
#: descending dtype (so larger alignments come first), then by name.
_DTYPES: List[Tuple[torch.dtype, str]] = [
    (torch.bool, "BOOL"),
    (torch.uint8, "U8"),
    (torch.int8, "I8"),
    (torch.float8_e5m2, "F8_E5M2"),
    (torch.float8_e4m3fn, "F8_E4M3"),
    (torch.int16, "I16"),
    (torch.uint16, "U16"),
    (torch.float16, "F16"),
    (torch.bfloat16, "BF16"),
    (torch.int32, "I32"),
    (torch.uint32, "U32"),
    (torch.float32, "F32"),
    (torch.float64, "F64"),
    (torch.int64, "I64"),
    (torch.uint64, "U64"),
]
_DTYPE_NAME = {dtype: name for dtype, name in _DTYPES}
#: torch's dtype of each safetensors dtype name (for reading).
SAFETENSORS_DTYPES = {name: dtype for dtype, name in _DTYPES}
_DTYPE_RANK = {dtype: rank for rank, (dtype, _) in enumerate(_DTYPES)}


def _layout(tensors: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]]) -> List[str]:
    """The names in the order safetensors lays their data out."""
    return sorted(tensors, key=lambda name: (-_DTYPE_RANK[tensors[name][1]], name))


def write_safetensors(
    path: Path,
    tensors: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    metadata: Optional[Dict[str, str]] = None,
) -> int:
    """
    Write a safetensors file of ``tensors`` (name: shape and dtype), calling ``produce(name)``
    for one tensor at a time, in the format's layout. Returns the bytes of tensor data written.
    """
    for name, (_, dtype) in tensors.items():
        if dtype not in _DTYPE_NAME:
            raise ValueError(f"{name}: safetensors has no dtype {dtype}")
    header: Dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    order = _layout(tensors)
    for name in order:
        shape, dtype = tensors[name]
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _DTYPE_NAME[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "xb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for name in order:
            shape, dtype = tensors[name]
            tensor = produce(name).detach().to("cpu")
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(
                    f"{name}: got {tensor.dtype} {list(tensor.shape)}, announced {dtype} {list(shape)}"
                )
            handle.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)
            del tensor
        handle.flush()
        os.fsync(handle.fileno())
    return offset


def hf_state_names(model_class: Any, config: Any) -> Tuple[List[str], Dict[str, str]]:
    """
    The names ``save_pretrained`` writes for ``model_class(config)``, from the model built on
    ``meta`` (nothing allocated), and its tied names (alias: the name written).
    """
    with torch.device("meta"):
        model: nn.Module = model_class(config)
    first: Dict[int, str] = {}
    aliases: Dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    names = [name for name in model.state_dict() if name not in aliases]
    return names, aliases


def _prefix(names: Sequence[str], available: Sequence[str]) -> str:
    """
    Where the Hugging Face model sits in the trained model: the prefix before its names in
    ``weights.pt`` (``""`` when the step's model is the ``transformers`` model itself).
    """
    probe = names[0]
    for key in available:
        if key == probe or key.endswith("." + probe):
            return key[: len(key) - len(probe)]
    raise CheckpointError(
        f"The weights have no tensor named like the model's {probe!r}: they are not of this model class."
    )


#: The tensors to export: name to shape and dtype, and a function that gives one by name.
TensorSource = Tuple[Dict[str, Tuple[Tuple[int, ...], torch.dtype]], Callable[[str], torch.Tensor]]


def weights_file(path: Path) -> TensorSource:
    """The tensors of a ``weights.pt``, mapped shared (its pages are the page cache's)."""
    state = safe_load(Path(path), mmap=True, shared=True)
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}, state.__getitem__


def model_source_tensors(source: ModelSource) -> TensorSource:
    """The tensors of a checkpoint's :class:`ModelSource`, each built when asked for."""
    entries = {entry.name: entry for entry in source.entries if entry.alias_of is None}
    shapes = {name: (tuple(entry.shape), entry.dtype) for name, entry in entries.items()}
    return shapes, lambda name: source.produce(entries[name])


def model_class_of(config: Any) -> Any:
    """The ``transformers`` class a config names first in its ``architectures``."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is None:
        raise CheckpointError(
            f"The model's config names no transformers class to export as (architectures: {architectures})."
        )
    return model_class


def export_hf(
    source: TensorSource,
    directory: Path,
    config: Any,
    *,
    model_class: Any = None,
    tokenizer_from: Optional[Path] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """
    Write ``directory`` from ``source`` (the state of a model holding a ``transformers`` model of
    ``config``, possibly inside the user's own module: :func:`weights_file`,
    :func:`model_source_tensors`), atomically. ``model_class`` defaults to the config's first
    ``architectures`` entry. Returns ``directory``.
    """
    import transformers

    model_class = model_class or model_class_of(config)
    names, _ = hf_state_names(model_class, config)
    available, read = source
    prefix = _prefix(names, list(available))
    missing = [name for name in names if prefix + name not in available]
    if missing:
        raise CheckpointError(f"The trained weights lack {missing[:5]} of {model_class.__name__}.")
    tensors = {name: available[prefix + name] for name in names}

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()
    try:
        config.save_pretrained(tmp)
        generation = getattr(model_class, "can_generate", None)
        if callable(generation) and generation():
            transformers.GenerationConfig.from_model_config(config).save_pretrained(tmp)
        _write_weights(tmp, tensors, lambda name: read(prefix + name), max_shard_bytes)
        if tokenizer_from is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_from) / name).is_file():
                    shutil.copyfile(Path(tokenizer_from) / name, tmp / name)
        for path in tmp.iterdir():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        fsync_directory(tmp)
        old = directory.with_name(f".{directory.name}.{uuid.uuid4().hex[:8]}.old")
        if directory.exists():
            os.replace(directory, old)
        os.replace(tmp, directory)
        fsync_directory(directory.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _write_weights(
    directory: Path,
    tensors: Dict[str, Tuple[Tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    max_shard_bytes: int,
) -> None:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and their index."""

    def nbytes(name: str) -> int:
        shape, dtype = tensors[name]
        return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()

    shards: List[List[str]] = [[]]
    size = 0
    for name in tensors:
        if shards[-1] and size + nbytes(name) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes(name)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        write_safetensors(directory / "model.safetensors", tensors, produce, metadata)
        return
    weight_map: Dict[str, str] = {}
    total = 0
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(directory / file, {n: tensors[n] for n in shard}, produce, metadata)
        weight_map.update({name: file for name in shard})
    index_file = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps(index_file, indent=2, sort_keys=True) + "\n"
    )


def hf_model_in(model: nn.Module) -> Optional[Any]:
    """The outermost ``transformers`` model inside ``model`` (wrapped or not), if there is one."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    return None


def source_directory(config: Any) -> Optional[Path]:
    """The local directory the model was loaded from (``config._name_or_path``), if it is one."""
    path = Path(str(getattr(config, "_name_or_path", "") or ""))
    return path if str(path) and path.is_dir() else None
