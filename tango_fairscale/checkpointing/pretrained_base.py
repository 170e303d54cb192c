"""
Checkpoints of a model whose frozen base comes from pretrained files (LoRA, partial fine-tuning)
hold what trains, and name the rest.

Under ``init_on_meta`` each parameter read from a pretrained safetensors file and not written
since is marked with its file and tensor name (:func:`~tango_fairscale.materialize.pretrained_origin`).
Frozen, such a parameter keeps that value for the whole run: a checkpoint need not hold it, only
say where it is. :func:`frozen_base` collects them when a backend builds the model; the backends
leave them out of the model state they save (the fairscale backend a frozen flat parameter when
every parameter in it is one of them, the torch backend each one), and the marker records the
``pretrained_base``: each file's size and SHA-256 and each parameter's file and tensor name.

Resuming, the model is built from the files again (they hold the base), :func:`check_files`
refuses files that changed since the save (naming them), and only the saved parameters are
loaded. Everything that reads a checkpoint whole (``weights.pt``, ``consolidate``, the Hugging
Face export) reads the base from the files through :class:`WithPretrainedBase`, checked the same
way. For a LoRA model of r=8 the checkpoint is the adapters and their optimizer state: a small
fraction of a full fine-tune's (``docs/checkpoints.md`` has the measured bytes).
"""

import logging
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

from ..errors import CheckpointError
from ..finetune.safetensors_files import SAFETENSORS_DTYPES, SafetensorsFiles
from .files import file_digest
from .streaming import TensorEntry

logger = logging.getLogger(__name__)

#: The marker's field that describes the base (absent when the checkpoint holds every parameter).
MARKER_FIELD = "pretrained_base"
#: The model configuration beside the weight files, in the base's digests too.
CONFIG_FILE = "config.json"


class PretrainedBase:
    """The frozen parameters of a model that are, unchanged, tensors of pretrained files."""

    def __init__(self, tensors: Mapping[str, Tuple[str, str]], order: Sequence[str] = ()) -> None:
        #: Plain model parameter name (every name of a tied parameter) -> (file, tensor name).
        self.tensors: Dict[str, Tuple[str, str]] = dict(sorted(tensors.items()))
        #: The model's state-dict keys in its order, where weights.pt puts the base back.
        self.order = list(order)
        self._digests: Optional[Dict[str, Dict[str, Any]]] = None

    @property
    def names(self) -> Set[str]:
        return set(self.tensors)

    def marker_fields(self) -> Dict[str, Any]:
        """The marker's ``pretrained_base``: each file's digest, each parameter's file and tensor."""
        if self._digests is None:
            # Hashed once per run, by the processes that write markers; with each weight file's
            # directory's config.json, which shapes how the base computes (rms_norm_eps, rope):
            # a base read back unchanged under another config is not the model that was saved.
            configs = {str(Path(path).parent / CONFIG_FILE) for path in self.files}
            described = sorted(self.files | {path for path in configs if Path(path).is_file()})
            self._digests = {path: file_digest(Path(path)) for path in described}
        return {
            "files": self._digests,
            "tensors": {k: list(v) for k, v in self.tensors.items()},
            "order": self.order,
        }

    @property
    def files(self) -> Set[str]:
        return {path for path, _ in self.tensors.values()}

    def after_resuming(self, marker: Mapping[str, Any]) -> Optional["PretrainedBase"]:
        """
        The base once the checkpoint of ``marker`` is loaded: only the parameters that checkpoint
        named as its frozen base too. Any other the checkpoint held a value for, which the run
        that saved it may have trained (resumed now with more of the model frozen): no longer
        the pretrained tensor, it is saved from now on, never read back from the files.
        ``None`` when nothing is left.
        """
        saved = saved_base(marker)
        named = dict(saved["tensors"]) if saved else {}
        # The same tensor of a file of the same name, as check_same_base compares them.
        kept = {
            name: (file, tensor)
            for name, (file, tensor) in self.tensors.items()
            if name in named and Path(named[name][0]).name == Path(file).name and named[name][1] == tensor
        }
        if len(kept) == len(self.tensors):
            return self
        dropped = sorted(set(self.tensors) - set(kept))
        logger.warning(
            "The checkpoint holds %d frozen parameter(s) that this model reads from pretrained files "
            "(%s%s): its values are kept, and saved in the checkpoints from now on.",
            len(dropped),
            ", ".join(dropped[:3]),
            " ..." if len(dropped) > 3 else "",
        )
        return PretrainedBase(kept, self.order) if kept else None


def frozen_base(model: nn.Module, clean: Any = None) -> Optional[PretrainedBase]:
    """
    The frozen parameters of ``model`` (built on ``meta``, not yet materialised) that are their
    pretrained tensors unchanged, under every name they have; ``None`` when there are none.
    ``clean`` maps a ``named_parameters`` name to the plain model's (identity by default).
    """
    from ..materialize import pretrained_origin

    tensors: Dict[str, Tuple[str, str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            continue
        origin = pretrained_origin(param)
        if origin is not None:
            tensors[clean(name) if clean is not None else name] = origin
    if not tensors:
        return None
    # The state dict's keys of the model on meta (nothing is allocated).
    order = [clean(name) if clean is not None else name for name in model.state_dict(keep_vars=True)]
    return PretrainedBase(tensors, order)


def saved_base(marker: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """A checkpoint marker's ``pretrained_base``, or ``None`` when the checkpoint holds every parameter."""
    base = marker.get(MARKER_FIELD)
    if base is None:
        return None
    if not (
        isinstance(base, dict)
        and isinstance(base.get("files"), dict)
        and isinstance(base.get("tensors"), dict)
        and all(isinstance(v, list) and len(v) == 2 for v in base["tensors"].values())
    ):
        raise CheckpointError(f"The checkpoint marker's {MARKER_FIELD!r} is malformed.")
    return base


def check_files(base: Mapping[str, Any], *, hashes: bool = True) -> None:
    """
    Refuse, naming the file, when a pretrained file the checkpoint leaves its base to is missing or
    differs (size, or SHA-256 with ``hashes``) from the one the run was trained from.
    """
    for path, saved in base["files"].items():
        file = Path(path)
        if not file.is_file():
            raise CheckpointError(
                f"The checkpoint's frozen base is read from {file}, which is gone. Restore the "
                "pretrained files the run was trained from (the checkpoint holds only what trains)."
            )
        size = file.stat().st_size
        if size != saved["size"] or (hashes and file_digest(file)["sha256"] != saved["sha256"]):
            raise CheckpointError(
                f"The pretrained file {file} changed since the checkpoint was saved "
                f"({'size' if size != saved['size'] else 'SHA-256'} differs): the checkpoint holds only "
                "what trains and reads its frozen base from that file. Restore the files the run was "
                "trained from."
            )


def check_same_base(
    saved: Optional[Mapping[str, Any]], current: Optional[PretrainedBase], missing: Sequence[str]
) -> None:
    """
    The parameters a checkpoint leaves out (``missing`` of the current model's) must be the frozen
    base of this model too, from the same tensors, or the resumed model would not be the saved one.
    """
    if not missing:
        return
    saved_tensors = dict(saved["tensors"]) if saved else {}
    current_tensors = current.tensors if current else {}
    wrong = [
        name
        for name in missing
        if name not in saved_tensors
        or name not in current_tensors
        or Path(saved_tensors[name][0]).name != Path(current_tensors[name][0]).name
        or saved_tensors[name][1] != current_tensors[name][1]
    ]
    if wrong:
        raise CheckpointError(
            f"The checkpoint holds no value for {', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}, "
            "and this model does not read them unchanged from the same pretrained files as the run that "
            "saved it. Resume with the model configuration it was saved from."
        )


class WithPretrainedBase:
    """
    A checkpoint's model source (see :class:`~tango_fairscale.backends.base.ModelSource`) with its
    frozen base read from the pretrained files: the parameters the checkpoint left out come from
    the files named in its marker (checked first), one tensor at a time; tied names are one tensor.
    """

    def __init__(self, source: Any, base: Mapping[str, Any], *, hashes: bool = True) -> None:
        check_files(base, hashes=hashes)
        self._source = source
        self._directories: Dict[str, SafetensorsFiles] = {}
        saved = list(source.entries)
        # Entries a source lists in place but cannot produce (the fairscale backend's left-out flat
        # parameters), and names it does not list at all (the torch backend's).
        left_in_place = set(getattr(source, "left_out", ()))
        present = {entry.name for entry in saved} - left_in_place
        #: The left-out names -> (file, tensor name).
        self._tensors: Dict[str, Tuple[str, str]] = {
            k: (v[0], v[1]) for k, v in base["tensors"].items() if k not in present
        }
        unknown = sorted(left_in_place - set(self._tensors))
        if unknown:
            raise CheckpointError(
                f"The checkpoint holds no value for {', '.join(unknown[:5])}, and names no file for it."
            )
        # A name the source does not list goes where the model's state dict has it (the marker's
        # order), the source's entries keep theirs: weights.pt lists its keys as the model does.
        rank = {name: index for index, name in enumerate(base.get("order") or [])}
        unlisted = sorted(
            set(self._tensors) - left_in_place, key=lambda name: (rank.get(name, len(rank)), name)
        )
        entries: List[TensorEntry] = []
        first: Dict[Tuple[str, str], str] = {}

        def from_file(name: str, alias_of: Optional[str] = None) -> TensorEntry:
            origin = self._tensors[name]
            shape, dtype = self._shape_dtype(origin)
            entry = TensorEntry(name, shape, dtype, alias_of or first.get(origin))
            first.setdefault(origin, name)
            return entry

        def add_unlisted(upto: int) -> None:
            while unlisted and rank.get(unlisted[0], len(rank)) < upto:
                entries.append(from_file(unlisted.pop(0)))

        by_name: Dict[str, TensorEntry] = {}
        for entry in saved:
            add_unlisted(rank.get(entry.name, len(rank)))
            if entry.name in left_in_place:
                entry = from_file(entry.name, entry.alias_of)
            elif entry.alias_of in left_in_place:  # the file's shape and dtype, as its root's
                root = by_name[entry.alias_of]
                entry = TensorEntry(entry.name, root.shape, root.dtype, entry.alias_of)
            by_name[entry.name] = entry
            entries.append(entry)
        add_unlisted(len(rank) + 1)
        self.entries = entries

    def _files(self, path: str) -> SafetensorsFiles:
        directory = str(Path(path).parent)
        if directory not in self._directories:
            self._directories[directory] = SafetensorsFiles(Path(directory), source="the checkpoint's base")
        return self._directories[directory]

    def _shape_dtype(self, origin: Tuple[str, str]) -> Tuple[Tuple[int, ...], torch.dtype]:
        _, entry = self._files(origin[0]).entry(origin[1])
        return tuple(int(n) for n in entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]]

    def produce(self, entry: TensorEntry) -> torch.Tensor:
        origin = self._tensors.get(entry.name)
        if origin is None:
            return self._source.produce(entry)  # type: ignore[no-any-return]
        # A copy of the shared, read-only mapping's view: the mapping is not this process's memory.
        return self._files(origin[0]).read(origin[1]).clone()


def with_base(source: Any, marker: Mapping[str, Any], *, hashes: bool = True) -> Any:
    """``source`` as it is, or with its frozen base from the files when the checkpoint left it out."""
    base = saved_base(marker)
    return source if base is None else WithPretrainedBase(source, base, hashes=hashes)


def add_base_tensors(
    state: Dict[str, Any], marker: Mapping[str, Any], *, hashes: bool = True
) -> Dict[str, Any]:
    """A consolidated model state dict with the frozen base its checkpoint left out, from the files."""
    base = saved_base(marker)
    if base is None:
        return state
    check_files(base, hashes=hashes)
    source = WithPretrainedBase(_Empty(), base, hashes=False)
    for entry in source.entries:
        if entry.name not in state:
            state[entry.name] = state[entry.alias_of] if entry.alias_of else source.produce(entry)
    return state


class _Empty:
    """A model source without tensors (:func:`add_base_tensors` reads only the base)."""

    entries: List[TensorEntry] = []

    def produce(self, entry: TensorEntry) -> torch.Tensor:
        raise KeyError(entry.name)


def materialize(source: Any) -> Dict[str, torch.Tensor]:
    """Every tensor of a model source in one state dict (tied names share one tensor)."""
    state: Dict[str, torch.Tensor] = {}
    for entry in source.entries:
        state[entry.name] = state[entry.alias_of] if entry.alias_of else source.produce(entry)
    return state
