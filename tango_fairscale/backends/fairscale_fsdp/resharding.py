"""
The arithmetic of FairScale's sharded state: each flat parameter split into equal chunks, the
last one padded with zeros. Rebuilding the full model and optimizer state offline
(consolidation), and cutting a checkpoint saved by N workers into the shards of M workers
(resharding), without ever assembling a full tensor for the latter.
"""

from pathlib import Path
from typing import Any, Dict, Iterable, List, Sequence, Set, Tuple

import torch

from ... import checkpointing
from ...checkpointing.compatible import check_same_shapes
from ...checkpointing.streaming import TensorEntry
from ...errors import CheckpointError

_FSDP_PATH_PARTS = frozenset({"_fsdp_wrapped_module", "_fpw_module"})


def clean_parameter_name(name: str) -> str:
    """
    The key of an FSDP parameter in ``local_state_dict()``: its ``named_parameters()`` name
    without FSDP's wrapper levels.
    """
    return ".".join(part for part in name.split(".") if part not in _FSDP_PATH_PARTS)


def _paddings(metadata: Dict[str, Any]) -> Dict[str, int]:
    """Local state-dict key of each sharded parameter -> zeros padded onto this worker's shard."""
    paddings = {}
    for unit in metadata["param_metadata"]:
        for backing_name, info in unit["params"].items():
            key = f"{unit['fsdp_path']}.{backing_name}" if unit["fsdp_path"] else backing_name
            paddings[key] = info["padding"]
    return paddings


def _unsharded(key: str, tensors: Sequence[torch.Tensor], paddings: Sequence[Dict[str, int]]) -> torch.Tensor:
    """Concatenate one flat parameter's (or its optimizer state's) shards, without padding."""
    pieces = []
    for tensor, padding in zip(tensors, paddings):
        flat = tensor.reshape(-1)
        pieces.append(flat[: flat.numel() - padding[key]])
    return torch.cat(pieces)


def _reshard(
    key: str, tensors: Sequence[torch.Tensor], paddings: Sequence[Dict[str, int]], shard_numel: int, rank: int
) -> torch.Tensor:
    """
    Worker ``rank``'s shard of one flat parameter (or its optimizer state) saved as ``tensors``
    by other workers, in FairScale's layout: contiguous chunks of ``shard_numel`` of the
    unpadded whole, the last one padded with zeros. Copies only the elements of that chunk, so
    the whole is never assembled.
    """
    start, stop = rank * shard_numel, (rank + 1) * shard_numel
    shard = torch.zeros(shard_numel, dtype=tensors[0].dtype)
    offset = 0  # where the current saved piece starts in the unpadded whole
    for tensor, padding in zip(tensors, paddings):
        flat = tensor.reshape(-1)
        length = flat.numel() - padding[key]
        low, high = max(start, offset), min(stop, offset + length)
        if low < high:
            shard[low - start : high - start] = flat[low - offset : high - offset]
        offset += length
    return shard


def same_shapes(saved: Dict[str, torch.Tensor], local: Dict[str, torch.Tensor]) -> bool:
    """Whether a saved local state dict fits the current one shard for shard."""
    return saved.keys() == local.keys() and all(saved[key].shape == local[key].shape for key in saved)


def _check_same_parameters(saved_keys: Iterable[str], local_keys: Iterable[str]) -> None:
    saved, local = set(saved_keys), set(local_keys)
    if saved != local:
        raise CheckpointError(
            "The checkpoint was saved from a differently wrapped model, so it cannot be resharded: "
            f"parameters only in the checkpoint {sorted(saved - local)[:5]}, only in this model "
            f"{sorted(local - saved)[:5]}. Use the same modules_to_wrap/fsdp_config as the run that saved it."
        )


def reshard_model_weights(
    shards: List[Dict[str, Any]], local_weights: Dict[str, torch.Tensor], rank: int
) -> Dict[str, torch.Tensor]:
    """
    This worker's ``local_state_dict`` for a checkpoint saved by any number of workers:
    ``local_weights`` (the current local state dict) gives the keys and the shard sizes.
    """
    _check_same_parameters(shards[0]["weights"].keys(), local_weights.keys())
    paddings = [_paddings(shard["metadata"]) for shard in shards]
    resharded: Dict[str, torch.Tensor] = {}
    for key, current in local_weights.items():
        if key not in paddings[0]:  # a buffer: replicated, take worker 0's
            # A copy: the saved tensor may be a view of a memory-mapped file.
            resharded[key] = shards[0]["weights"][key].clone()
            continue
        saved = [shard["weights"][key] for shard in shards]
        resharded[key] = (
            _reshard(key, saved, paddings, current.numel(), rank).to(current.dtype).view(current.shape)
        )
    return resharded


def reshard_optimizer_state(
    model_shards: List[Dict[str, Any]],
    optimizer_shards: List[Dict[str, Any]],
    local_weights: Dict[str, torch.Tensor],
    optimizer_keys: List[str],
    rank: int,
) -> Dict[str, Any]:
    """
    This worker's optimizer ``state_dict`` for a checkpoint saved by any number of workers.
    Per-element state (e.g. Adam's moments) is resharded like the parameters; scalar state
    (e.g. the step count) is the same on every worker and taken from worker 0.
    """
    saved_keys = model_shards[0]["optimizer_keys"]
    _check_same_parameters(saved_keys, optimizer_keys)
    paddings = [_paddings(shard["metadata"]) for shard in model_shards]
    saved_index = {key: index for index, key in enumerate(saved_keys)}
    state: Dict[int, Dict[str, Any]] = {}
    for new_index, key in enumerate(optimizer_keys):
        old_index = saved_index[key]
        per_worker = [optimizer["state"].get(old_index) for optimizer in optimizer_shards]
        if per_worker[0] is None:
            continue  # never stepped
        entry: Dict[str, Any] = {}
        for name, value in per_worker[0].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                saved = [worker[name] for worker in per_worker]
                entry[name] = _reshard(key, saved, paddings, local_weights[key].numel(), rank).to(value.dtype)
            else:  # e.g. Adam's step; copied, since it may be a view of a memory-mapped file
                entry[name] = value.clone() if isinstance(value, torch.Tensor) else value
        state[new_index] = entry
    groups = []
    for group in optimizer_shards[0]["param_groups"]:
        groups.append(
            {**group, "params": [optimizer_keys.index(saved_keys[index]) for index in group["params"]]}
        )
    return {"state": state, "param_groups": groups}


def _unit_info(key: str, metadata: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """The FSDP unit path and the metadata entry of one flat parameter (by local state-dict key)."""
    for unit in metadata["param_metadata"]:
        for backing_name, info in unit["params"].items():
            unit_key = f"{unit['fsdp_path']}.{backing_name}" if unit["fsdp_path"] else backing_name
            if unit_key == key:
                return unit["fsdp_path"], info
    raise CheckpointError(f"No shard metadata for parameter {key!r}.")


def original_names(key: str, metadata: Dict[str, Any]) -> List[str]:
    """The plain model's names of the parameters flattened into ``key``."""
    fsdp_path, info = _unit_info(key, metadata)
    prefix = f"{fsdp_path}." if fsdp_path else ""
    return [prefix + name for name in info["names"]]


def _unflatten(key: str, full: torch.Tensor, metadata: Dict[str, Any]) -> List[Tuple[str, torch.Tensor]]:
    """Split a full flat parameter (or state of the same shape) into the original named tensors."""
    _, info = _unit_info(key, metadata)
    pieces = full.split(info["numels"])
    return [
        (name, piece.view(shape))
        for name, piece, shape in zip(original_names(key, metadata), pieces, info["shapes"])
    ]


def consolidate_optimizer_state(
    model_shards: List[Dict[str, Any]], optimizer_shards: List[Dict[str, Any]]
) -> Dict[str, Any]:
    """
    The full optimizer state, keyed by the plain model's parameter names:
    ``{"state": {name: {"exp_avg": tensor, "step": ..., ...}}, "param_groups": [... "params": [names]]}``.
    """
    keys = model_shards[0]["optimizer_keys"]
    paddings = [_paddings(shard["metadata"]) for shard in model_shards]
    metadata = model_shards[0]["metadata"]
    state: Dict[str, Dict[str, Any]] = {}
    for index, key in enumerate(keys):
        per_worker = [optimizer["state"].get(index) for optimizer in optimizer_shards]
        if per_worker[0] is None:
            continue  # never stepped
        for name, value in per_worker[0].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                full = _unsharded(key, [worker[name] for worker in per_worker], paddings)
                for param_name, piece in _unflatten(key, full, metadata):
                    state.setdefault(param_name, {})[name] = piece
            else:
                for param_name in original_names(key, metadata):
                    state.setdefault(param_name, {})[name] = value
    groups = [
        {
            **group,
            "params": [name for index in group["params"] for name in original_names(keys[index], metadata)],
        }
        for group in optimizer_shards[0]["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def module_aliases(model: torch.nn.Module) -> List[Tuple[str, str]]:
    """
    ``(canonical, alias)`` paths of modules reachable under several names (e.g. T5's
    ``shared`` embedding, which is also ``encoder.embed_tokens``). FairScale's shard metadata
    names such a module's parameters once, under its first path; the plain model's state dict
    has them under every path.
    """
    first_path: Dict[int, str] = {}
    aliases: List[Tuple[str, str]] = []
    for path, module in model.named_modules(remove_duplicate=False):
        path = clean_parameter_name(path)
        if id(module) not in first_path:
            first_path[id(module)] = path
        elif first_path[id(module)] != path and path:
            canonical = first_path[id(module)]
            # Submodules of an alias are reached again below it; only record the top of it.
            if not any(path.startswith(alias + ".") for _, alias in aliases):
                aliases.append((canonical, path))
    return aliases


def shared_parameters(unit: Dict[str, Any]) -> List[Tuple[str, str]]:
    """
    ``(source, destination)`` plain names of the parameters one FSDP unit's metadata records as
    tied. FairScale names them relative to the unit's module: a weight tied inside a nested unit
    (``blocks.0``'s ``b.weight = a.weight``) is ``("a.weight", "b.weight")``, and only the root's
    pairs were the model's names (a ``KeyError`` writing ``weights.pt``).
    """
    prefix = f"{unit['fsdp_path']}." if unit["fsdp_path"] else ""
    return [(prefix + source, prefix + destination) for source, destination in unit["shared_param_info"]]


def consolidate_model_state(shards: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """
    The full, unsharded state dict of the model, with the plain model's keys, from every
    worker's model file.
    """
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    weights = [shard["weights"] for shard in shards]
    metadata = [shard["metadata"] for shard in shards]
    # FairScale copies the tied parameters of its last unit only, by names relative to that unit:
    # a KeyError for a nested unit's. Given none, it copies none; they are copied below.
    untied = [
        {**m, "param_metadata": [{**unit, "shared_param_info": []} for unit in m["param_metadata"]]}
        for m in metadata
    ]
    full = FSDP.consolidate_shard_weights(weights, untied, with_module_buffers=False)
    # Buffers are replicated: worker 0's. FairScale's metadata also lists non-persistent
    # buffers (e.g. GPT-2's causal mask), which are in no state dict: skip those.
    for name in metadata[0]["buffer_names"]:
        if name in weights[0]:
            full[name] = weights[0][name]
    # FairScale restores tied (shared) parameters only for the last FSDP unit's metadata, and
    # without the unit's path; do it for every unit.
    for unit in metadata[0]["param_metadata"]:
        for source, destination in shared_parameters(unit):
            full[destination] = full[source]
    for canonical, alias in shards[0].get("module_aliases", []):
        prefix = f"{canonical}." if canonical else ""
        for key in [k for k in full if k.startswith(prefix)]:
            full[f"{alias}.{key[len(prefix) :]}"] = full[key]
    return full


def parameter_shapes(metadata: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """The plain model's name -> shape of every parameter FSDP flattened, from its shard metadata."""
    shapes: Dict[str, Tuple[int, ...]] = {}
    for unit in metadata["param_metadata"]:
        prefix = f"{unit['fsdp_path']}." if unit["fsdp_path"] else ""
        for info in unit["params"].values():
            for name, shape in zip(info["names"], info["shapes"]):
                shapes[prefix + name] = tuple(shape)
    return shapes


def check_same_parameter_shapes(
    saved: Dict[str, Any], local: Dict[str, Any], source: str = "checkpoint"
) -> None:
    """
    Refuse a checkpoint whose parameters differ in name or shape from this model's, by the shard
    metadata of both: a flat shard of the same size can hold another model (a width-64 run's
    first elements fit a width-32 model), so sizes of flat shards prove nothing.
    """
    saved_shapes, local_shapes = parameter_shapes(saved), parameter_shapes(local)
    _check_same_parameters(saved_shapes, local_shapes)
    check_same_shapes(saved_shapes, local_shapes, source)


class ConsolidatedModel:
    """
    The full state dict of :func:`consolidate_model_state`, one tensor at a time: :attr:`entries`
    lists every key (shape, dtype, and which keys are the same tensor), :meth:`produce` builds
    one of them from the shards. With :func:`~tango_fairscale.checkpointing.streaming.stream_save`
    the peak is the largest parameter, not the model. The shards are read only; memory-mapped
    (shared), they stay out of the process's private memory.
    """

    def __init__(self, shards: List[Dict[str, Any]]) -> None:
        self._weights = [shard["weights"] for shard in shards]
        metadata = [shard["metadata"] for shard in shards]
        #: The entries of flat parameters the checkpoint left out (a pretrained frozen base).
        self.left_out: Set[str] = set()
        #: name -> (flat parameter key, offset in its unpadded whole, unit index) for parameters.
        self._slices: Dict[str, Tuple[str, int, int]] = {}
        self._paddings = [_paddings(m) for m in metadata]
        self._single: Dict[str, bool] = {}
        entries: Dict[str, TensorEntry] = {}
        for unit in metadata[0]["param_metadata"]:
            for backing_name, info in unit["params"].items():
                key = f"{unit['fsdp_path']}.{backing_name}" if unit["fsdp_path"] else backing_name
                held = key in self._weights[0]
                self._single[key] = bool(unit["no_broadcast_optim_state"])
                # A frozen flat parameter of pretrained tensors the checkpoint names instead of
                # holding: listed in its place, produced from the files by
                # checkpointing.pretrained_base (the dtype is the file's).
                dtype = self._weights[0][key].dtype if held else torch.float32
                offset = 0
                for name, shape, numel in zip(info["names"], info["shapes"], info["numels"]):
                    out = f"{unit['fsdp_path']}.{name}" if unit["fsdp_path"] else name
                    if not held:
                        self.left_out.add(out)
                    entries[out] = TensorEntry(out, tuple(shape), dtype)
                    self._slices[out] = (key, offset, numel)
                    offset += numel

        def alias(destination: str, source: str) -> None:
            root = entries[source].alias_of or source
            entries[destination] = TensorEntry(destination, entries[root].shape, entries[root].dtype, root)

        # As consolidate_model_state: buffers from worker 0 (non-persistent ones are in no file).
        for name in metadata[0]["buffer_names"]:
            if name in self._weights[0]:
                tensor = self._weights[0][name]
                entries[name] = TensorEntry(name, tuple(tensor.shape), tensor.dtype)
        for unit in metadata[0]["param_metadata"]:
            for source, destination in shared_parameters(unit):
                alias(destination, source)
        for canonical, module_alias in shards[0].get("module_aliases", []):
            prefix = f"{canonical}." if canonical else ""
            for key in [k for k in entries if k.startswith(prefix)]:
                alias(f"{module_alias}.{key[len(prefix) :]}", key)
        self.entries = list(entries.values())

    def produce(self, entry: TensorEntry) -> torch.Tensor:
        """The full tensor of ``entry`` (one of :attr:`entries`, not an alias)."""
        if entry.name in self.left_out:
            raise CheckpointError(f"The checkpoint holds no value for {entry.name} (its pretrained base).")
        if entry.name not in self._slices:  # a buffer
            return self._weights[0][entry.name]
        key, start, numel = self._slices[entry.name]
        ranks = 1 if self._single[key] else len(self._weights)
        result = torch.empty(numel, dtype=entry.dtype)
        offset = 0  # where the current worker's piece starts in the unpadded whole
        for rank in range(ranks):
            flat = self._weights[rank][key].reshape(-1)
            length = flat.numel() - self._paddings[rank][key]
            low, high = max(start, offset), min(start + numel, offset + length)
            if low < high:
                result[low - start : high - start] = flat[low - offset : high - offset]
            offset += length
        if offset < start + numel:
            raise CheckpointError(
                f"The shards of {key} hold {offset} elements, fewer than {entry.name} needs."
            )
        return result.view(entry.shape)


def load_model_shards(checkpoint_dir: Path, hashes: bool = True) -> List[Dict[str, Any]]:
    """Every worker's ``{"weights", "metadata", ...}`` model state of a complete checkpoint, in rank order."""
    marker = checkpointing.require_complete(checkpoint_dir)
    return [
        checkpointing.read_worker_state(checkpoint_dir, marker, w, "model", hashes=hashes)
        for w in range(marker["world_size"])
    ]


def load_optimizer_shards(checkpoint_dir: Path, hashes: bool = True) -> List[Dict[str, Any]]:
    """Every worker's optimizer state of a complete checkpoint, in rank order."""
    marker = checkpointing.require_complete(checkpoint_dir)
    return [
        checkpointing.read_worker_state(checkpoint_dir, marker, w, "optimizer", hashes=hashes)
        for w in range(marker["world_size"])
    ]
