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
the previous directory or none, never a half one, and the next export removes the temporaries.
It replaces only a directory an earlier export wrote (:mod:`tango_fairscale.output_paths`, whose
marker file it writes too; ``from_pretrained`` ignores it).
"""

import copy
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..backends.base import ModelSource
from ..checkpointing.files import fsync_directory, safe_load
from ..checkpointing.placing import identity, place
from ..errors import CheckpointError
from ..output_paths import (
    EXPORT_MARKER,
    HF_EXPORT,
    TEMPORARY_TOKEN,
    TOKENIZER_FILES,
    check_output,
    is_export_dir,
    mark_temporary,
    marker,
    remove_stale_temporaries,
    temporary_sibling,
)
from .safetensors_files import DTYPES

#: Shards of at most this many bytes of tensor data, as ``save_pretrained``'s default ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

_DTYPE_NAME = {dtype: name for dtype, name in DTYPES}
_DTYPE_RANK = {dtype: rank for rank, (dtype, _) in enumerate(DTYPES)}


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


def export_dtype(config: Any) -> Optional[torch.dtype]:
    """
    The floating-point dtype a ``transformers`` config records for its weights (``dtype``, earlier
    ``torch_dtype``: what ``save_pretrained`` wrote them in), ``None`` when it records none.
    """
    for field in ("dtype", "torch_dtype"):
        value = config.__dict__.get(field)
        if isinstance(value, str):
            value = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(value, torch.dtype) and value.is_floating_point:
            return value
    return None


def export_hf(
    source: TensorSource,
    directory: Path,
    config: Any,
    *,
    model_class: Any = None,
    tokenizer_from: Optional[Path] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    work_dir: Optional[Path] = None,
    sources: Sequence[Path] = (),
    label: str = "",
) -> Path:
    """
    Write ``directory`` from ``source`` (the state of a model holding a ``transformers`` model of
    ``config``, possibly inside the user's own module: :func:`weights_file`,
    :func:`model_source_tensors`), atomically. ``model_class`` defaults to the config's first
    ``architectures`` entry. Floating-point tensors are written in the dtype ``config`` records
    (:func:`export_dtype`: a bfloat16 checkpoint's fine-tuning is exported in bfloat16, though it
    trained float32 master weights), else as they are. Returns ``directory``.

    ``directory`` may be new or an earlier export; anything else is refused with a
    :class:`CheckpointError` naming it (:func:`~tango_fairscale.output_paths.check_output`, told
    the step's ``work_dir`` and the checkpoints read, ``sources``; ``label`` the option it came from).
    """
    import transformers

    directory = Path(directory)
    check_output(directory, HF_EXPORT, work_dir=work_dir, sources=sources, label=label)
    model_class = model_class or model_class_of(config)
    names, _ = hf_state_names(model_class, config)
    available, read = source
    prefix = _prefix(names, list(available))
    missing = [name for name in names if prefix + name not in available]
    if missing:
        raise CheckpointError(f"The trained weights lack {missing[:5]} of {model_class.__name__}.")
    tensors = {name: available[prefix + name] for name in names}
    # The dtype the checkpoint was saved in (its config.json's), as the hub expects: the run trained
    # float32 master weights of a bfloat16 checkpoint, and exports bfloat16 again.
    saved = export_dtype(config)
    if saved is not None:
        tensors = {
            name: (shape, saved if dtype.is_floating_point else dtype)
            for name, (shape, dtype) in tensors.items()
        }

    def produce(name: str) -> torch.Tensor:
        tensor = read(prefix + name)
        return tensor.to(saved) if saved is not None and tensor.is_floating_point() else tensor

    def fill(tmp: Path) -> None:
        config.save_pretrained(tmp)
        generation = getattr(model_class, "can_generate", None)
        if callable(generation) and generation():
            transformers.GenerationConfig.from_model_config(config).save_pretrained(tmp)
        _write_weights(tmp, tensors, produce, max_shard_bytes)
        _copy_tokenizer(tokenizer_from, tmp)

    return _write_directory(directory, fill)


def export_peft_adapter(
    source: TensorSource,
    directory: Path,
    peft_model: Any,
    *,
    base_directory: Optional[Path] = None,
    work_dir: Optional[Path] = None,
    sources: Sequence[Path] = (),
    label: str = "",
) -> Path:
    """
    Write ``directory`` as peft's adapter directory for ``peft_model`` (a ``PeftModel``, or the
    model holding it) from the trained state ``source``: ``adapter_config.json`` and
    ``adapter_model.safetensors``, named as ``PeftModel.save_pretrained`` names them, which
    ``PeftModel.from_pretrained(base, directory)`` loads onto the base model; the tokenizer files
    of ``base_directory`` (the pretrained model's, also recorded as the adapter's base) beside
    them. Atomically, replacing only an earlier export, as :func:`export_hf`.
    """
    from peft import get_peft_model
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    directory = Path(directory)
    check_output(directory, HF_EXPORT, work_dir=work_dir, sources=sources, label=label)
    available, read = source
    config = copy.deepcopy(peft_model.peft_config["default"])
    # peft finds the adapter's tensors by the names of the model's LoRA layers, which FSDP's
    # wrappers change: it is asked with the plain model's skeleton, built on meta (no memory).
    base = peft_model.get_base_model()
    with torch.device("meta"):
        skeleton = get_peft_model(type(base)(base.config), copy.deepcopy(config))
    prefix = _peft_prefix(list(available))
    # Every tensor that trained (the adapters, modules_to_save's copies, and the base's biases
    # under bias "all" or "lora_only"), and what peft's names say is the adapter's: peft picks
    # what it saves among them and names it (the adapter name dropped). Only those are read, one
    # at a time: they are a small part of the model.
    trained = {prefix + name for name, param in skeleton.named_parameters() if param.requires_grad}
    names = [
        name for name in available if name in trained or _ADAPTER_PART in name or "modules_to_save" in name
    ]
    state = {name[len(prefix) :]: read(name).clone() for name in names}
    adapter = get_peft_model_state_dict(skeleton, state_dict=state)
    if not adapter:
        raise CheckpointError("The trained weights hold none of the peft model's adapter tensors.")
    if base_directory is not None:
        config.base_model_name_or_path = str(base_directory)

    def fill(tmp: Path) -> None:
        config.save_pretrained(str(tmp))
        save_file(
            {k: v.contiguous() for k, v in adapter.items()},
            str(tmp / "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        _copy_tokenizer(base_directory, tmp)

    return _write_directory(directory, fill)


def export_merged_adapter(
    adapter: Path,
    directory: Path,
    *,
    work_dir: Optional[Path] = None,
    sources: Sequence[Path] = (),
    label: str = "",
) -> Path:
    """
    Write ``directory`` as the ``from_pretrained`` directory of the base model of the adapter
    directory ``adapter`` (:func:`export_peft_adapter`'s) with the adapters merged into it (peft's
    ``merge_and_unload``), and the adapter's tokenizer files. Atomically, replacing only an
    earlier export. Holds the whole model in memory: the base is read whole, then merged.
    """
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    check_output(directory, HF_EXPORT, work_dir=work_dir, sources=sources, label=label)
    base_path = PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path
    base = AutoModelForCausalLM.from_pretrained(base_path)
    # A head tied to the embedding is one tensor: merging an adapter of the head into it (LoRA on
    # lm_head) changed the embedding too, and a trained modules_to_save copy of the head was
    # saved under a config that ties it back to the embedding. Untied for the merge, tied again
    # where the two are still equal.
    tied = _untie_output_embeddings(base)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    if tied:
        _tie_if_equal(merged)

    def fill(tmp: Path) -> None:
        merged.save_pretrained(str(tmp))
        _copy_tokenizer(Path(adapter), tmp)

    return _write_directory(directory, fill)


def _untie_output_embeddings(model: Any) -> bool:
    """Give ``model``'s head its own copy of the embedding it is tied to; whether it was tied."""
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embeddings is None or head is None or head.weight is not embeddings.weight:
        return False
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    model.config.tie_word_embeddings = False
    return True


def _tie_if_equal(model: Any) -> None:
    """Tie ``model``'s head to its embedding again where their values are equal (as saved: once)."""
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if torch.equal(head.weight, embeddings.weight):
        model.config.tie_word_embeddings = True
        head.weight = embeddings.weight


#: What every LoRA adapter tensor's name holds.
_ADAPTER_PART = ".lora_"


def _peft_prefix(names: Sequence[str]) -> str:
    """Where the ``PeftModel`` sits in the trained model (its names start with ``base_model.model.``)."""
    for name in names:
        index = name.find("base_model.model.")
        if index >= 0:
            return name[:index]
    raise CheckpointError("The trained weights hold no peft model (no name has 'base_model.model.').")


def _copy_tokenizer(tokenizer_from: Optional[Path], directory: Path) -> None:
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file():
                shutil.copyfile(Path(tokenizer_from) / name, directory / name)


def _write_directory(directory: Path, fill: Callable[[Path], None]) -> Path:
    """
    ``fill`` a temporary sibling of ``directory``, then put it in ``directory``'s place with its
    marker (last: the files it lists are the ones a later export may replace), synced: a crash
    leaves the previous directory or none, and the next export removes what it left. What the
    caller's check found at ``directory`` (nothing, or an earlier export) is the only thing it
    replaces: anything put there during the write is left as it is, and the export stops with
    one line (:func:`~tango_fairscale.checkpointing.placing.place`).
    """
    checked = identity(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory)
    tmp = temporary_sibling(directory, "tmp")
    tmp.mkdir()
    try:
        mark_temporary(tmp)
        fill(tmp)
        (tmp / TEMPORARY_TOKEN).unlink()  # the export's files only, from here on
        (tmp / EXPORT_MARKER).write_bytes(marker(HF_EXPORT, [path.name for path in tmp.iterdir()]))
        for path in tmp.iterdir():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        fsync_directory(tmp)
        old = place(tmp, directory, checked, still_replaceable=_earlier_export, what="the export")
        fsync_directory(directory.parent)
        if old is not None:
            # The earlier export, swapped out under the temporary's name: marked as the temporary
            # it now is, so that the next write sweeps it if this process dies before removing it.
            mark_temporary(old)
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        # Ours whatever happened: the new export, or (swapped out) the earlier one it replaced.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _earlier_export(path: Path) -> bool:
    """Whether ``path`` is still an export this package wrote, holding nothing else."""
    ours, foreign = is_export_dir(path)
    return ours and not foreign


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
