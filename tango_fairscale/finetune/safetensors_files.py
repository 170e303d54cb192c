"""
Reading the safetensors files ``save_pretrained`` writes, one tensor at a time, without the
process paying for the whole file: each file is mapped read-only and shared (``MAP_SHARED``,
``PROT_READ``), so its pages are the page cache's, not the process's private memory
(``safetensors``' own ``safe_open`` maps a file private and writable, which ``VmData``,
``RLIMIT_DATA`` and cgroups count in full while it is open). Each tensor read maps only its own
pages and owns that mapping: it is unmapped when the tensor is dropped, so nothing stays mapped
once what was read has been copied (sharded) or thrown away, whoever still holds the reader.
Headers and indexes are checked against the files, so a damaged file is named, not read past its end.
"""

import json
import math
import mmap
import struct
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
from tango.common.exceptions import ConfigurationError

#: safetensors' dtype names, in the order of its ``Dtype`` enum: tensors are laid out by
#: descending dtype (so larger alignments come first), then by name.
DTYPES: List[Tuple[torch.dtype, str]] = [
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
#: torch's dtype of each safetensors dtype name (for reading).
SAFETENSORS_DTYPES = {name: dtype for dtype, name in DTYPES}

#: The files of a directory ``save_pretrained`` wrote: one safetensors file, or shards and their index.
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def has_safetensors(directory: Path) -> bool:
    """Whether ``directory`` holds a ``save_pretrained`` model's safetensors file or index."""
    return any((directory / name).is_file() for name in (SAFETENSORS_FILE, SAFETENSORS_INDEX))


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


def read_index(index: Path) -> Dict[str, str]:
    """
    The weight map of a sharded model's ``model.safetensors.index.json`` (tensor name -> file),
    checked: it is one, and every file it names is in its directory.
    """
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
            raise ValueError("its weight_map does not map tensor names to file names")
    except (KeyError, TypeError, ValueError) as error:  # json's errors are ValueErrors too
        raise ConfigurationError(
            f"{index} is not a safetensors index ({type(error).__name__}: {error}): save the model again "
            "with save_pretrained."
        ) from None
    missing = sorted({file for file in weight_map.values() if not (index.parent / file).is_file()})
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ConfigurationError(
            f"{index} names shard(s) that are not in {index.parent}: {shown}. Copy every shard the index "
            "lists into the directory (or save the model again with save_pretrained)."
        )
    return weight_map


class SafetensorsFiles:
    """
    The tensors of a ``save_pretrained`` directory by name, each read on its own from its
    memory-mapped file: reading one does not read the others. A tensor read is a view of a mapping
    of its own pages, read-only and shared (``MAP_SHARED``, ``PROT_READ``): the pages are the page
    cache's, sharding copies out of them (a write through the view would fault, not reach the
    file), and the mapping lives exactly as long as the tensor. The object itself holds no mapping
    and no open file, so a reader kept on a parameter (or in a reference cycle) pins nothing.
    """

    def __init__(self, directory: Path, source: str = "fairscale::from_pretrained") -> None:
        self.directory = directory
        #: What loads them, for errors.
        self.source = source
        index = directory / SAFETENSORS_INDEX
        if index.is_file():
            self.file_of = {name: directory / file for name, file in read_index(index).items()}
        elif (directory / SAFETENSORS_FILE).is_file():
            single = directory / SAFETENSORS_FILE
            self.file_of = {name: single for name in read_header(single)[1]}
        else:
            # The way out depends on what is there: weights in PyTorch's format load without
            # init_on_meta; without any weights nothing loads, init_on_meta or not.
            others = sorted(path.name for path in directory.glob("pytorch_model*.bin*"))
            fix = (
                f"or load it without init_on_meta (transformers then reads {', '.join(others[:2])})"
                if others
                else "it holds no weights at all: give the directory save_pretrained wrote the model to"
            )
            raise ConfigurationError(
                f"{source}: {directory} has neither {SAFETENSORS_FILE} nor "
                f"{SAFETENSORS_INDEX}. Save the model with save_pretrained(..., safe_serialization=True) "
                f"(transformers' default), {fix}."
            )
        self._headers: Dict[Path, Tuple[int, Dict[str, Dict[str, Any]]]] = {}

    def names(self) -> List[str]:
        return list(self.file_of)

    def entry(self, name: str) -> Tuple[int, Dict[str, Any]]:
        """Where tensor ``name``'s file's data starts, and its header entry (``dtype``, ``shape``, ...)."""
        path = self.file_of[name]
        if path not in self._headers:
            self._headers[path] = read_header(path)
        data_start, header = self._headers[path]
        if name not in header:
            raise ConfigurationError(f"{path} has no tensor {name}, which {SAFETENSORS_INDEX} places there.")
        return data_start, header[name]

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name``, a read-only view of its file's mapping: never written through (it faults)."""
        path = self.file_of[name]
        data_start, entry = self.entry(name)
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"]
        count = math.prod(shape)
        if count == 0:  # nothing to map (frombuffer takes no empty range)
            return torch.empty(shape, dtype=dtype)
        begin, end = data_start + entry["data_offsets"][0], data_start + entry["data_offsets"][1]
        # A mapping starts at a multiple of the allocation granularity: map from the one below.
        start = begin - begin % mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as handle:
            mapping = mmap.mmap(handle.fileno(), end - start, access=mmap.ACCESS_READ, offset=start)
        with warnings.catch_warnings():
            # That the buffer is read-only is the point: the tensor is copied, never written.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            # frombuffer keeps a reference to ``mapping`` until the tensor's storage is freed: the
            # mapping is closed (unmapped) with the last view of it, by reference count, not gc.
            tensor = torch.frombuffer(mapping, dtype=dtype, count=count, offset=begin - start)
        return tensor.view(shape)

    def reader(self, name: str) -> Callable[[], torch.Tensor]:
        return lambda: self.read(name)


#: What :func:`fingerprint` reads of each file: its first bytes (a safetensors header, a JSON
#: file whole) and this many chunks spread over the rest.
_FINGERPRINT_HEAD = 1 << 20
_FINGERPRINT_CHUNKS = 64
_FINGERPRINT_CHUNK = 4096


def fingerprint(directory: Path) -> str:
    """
    A short digest of a pretrained directory's files (their names, sizes, first MiB and 64
    chunks spread over each), read in milliseconds whatever their size: what hosts compare at
    their rendezvous, so that two hosts reading different files at one path (another seed, a
    stale copy) are told apart. Weights trained or initialised differently differ almost
    everywhere, so sampled chunks tell them apart; a change of a few bytes may not be seen (the
    checkpoints' full SHA-256 of the base, under ``init_on_meta``, is what catches that).
    """
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(Path(directory).iterdir()):
        if not path.is_file():
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(_FINGERPRINT_HEAD))
            if size > _FINGERPRINT_HEAD:
                step = (size - _FINGERPRINT_HEAD) // _FINGERPRINT_CHUNKS
                for index in range(_FINGERPRINT_CHUNKS):
                    handle.seek(_FINGERPRINT_HEAD + index * step)
                    digest.update(handle.read(_FINGERPRINT_CHUNK))
    return digest.hexdigest()[:16]
