"""
What the value of a ``meta`` parameter is made of (a :class:`_Track`): where it starts (the
value its constructor created it with, its pretrained tensor, or another track's value) and the
in-place ops recorded on it since, each with its operands and, for a random op, its generator's
state; and the views of a storage those ops are applied through.
"""

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

#: The methods PyTorch's own modules initialise their parameters with (``nn.MultiheadAttention``
#: has ``_reset_parameters``), in the order they are tried.
_INITIALISERS = ("reset_parameters", "_reset_parameters")

#: Attribute of a ``meta`` parameter: its :class:`_Track`, what its value is made of.
_TRACK = "_tango_fairscale_track"

_CPU = torch.device("cpu")


def _on_meta(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta"


#: A view of a storage: dtype, size, stride and offset (in elements of the dtype).
Geometry = Tuple[torch.dtype, Tuple[int, ...], Tuple[int, ...], int]


def _geometry(tensor: torch.Tensor) -> Geometry:
    return (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()))


def _is_contiguous(size: Tuple[int, ...], stride: Tuple[int, ...]) -> bool:
    expected = 1
    for length, step in zip(reversed(size), reversed(stride)):
        if length != 1 and step != expected:
            return False
        expected *= length
    return True


def _covers(view: Geometry, whole: Geometry) -> bool:
    """Whether ``view`` is every element of ``whole`` (the same view, or both contiguous from one offset)."""
    if view == whole:
        return True
    return (
        view[0] == whole[0]
        and view[3] == whole[3]
        and math.prod(view[1]) == math.prod(whole[1])
        and _is_contiguous(view[1], view[2])
        and _is_contiguous(whole[1], whole[2])
    )


def _view(storage: torch.UntypedStorage, geometry: Geometry, shift: int = 0) -> torch.Tensor:
    dtype, size, stride, offset = geometry
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset + shift, size, stride)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata  # type: ignore[no-any-return]


@dataclass(frozen=True, eq=False)
class _Slot:
    """An op's operand: the recorded tensor itself, seen through this view, when the op is replayed."""

    geometry: Geometry


@dataclass(frozen=True, eq=False)
class _Const:
    """An op's real operand, copied when the op ran (a later change to it does not reach the op)."""

    tensor: torch.Tensor


@dataclass(frozen=True, eq=False)
class _Ref:
    """An op's operand that is another recorded tensor, as it was when the op ran: its first ``upto`` ops."""

    track: "_Track"
    upto: int
    geometry: Geometry


@dataclass(eq=False)
class _Op:
    """One recorded op (an ATen op, or one of P1's ``torch.nn.init`` functions) with its operands."""

    func: Callable[..., Any]
    args: Any
    kwargs: Any
    #: Sets every element of the tensor without reading them: what came before no longer matters.
    full: bool
    #: For a random op: the generator it draws from and that generator's state before it.
    generator: Optional[torch.Generator] = None
    state: Optional[torch.Tensor] = None


class _Track:
    """What the value of one ``meta`` storage (a parameter's) is made of: a start and the ops since."""

    def __init__(self, meta: torch.Tensor, device: torch.device, recorded: bool) -> None:
        storage = meta.untyped_storage()
        self.ref = StorageWeakRef(storage)
        self.nbytes: int = storage.nbytes()
        #: The parameter's view of the storage.
        self.geometry = _geometry(meta)
        #: Where an eager build has the tensor: where ops are replayed and what generator they draw from.
        self.device = device
        #: Whether in-place ops were recorded (False: the earlier behaviour, see ``parameters_on_meta``).
        self.recorded = recorded
        #: The start, when no op set every element: the value the constructor created it with ...
        self.base: Optional[torch.Tensor] = None
        #: ... its pretrained tensor ...
        self.read: Optional[Callable[[], torch.Tensor]] = None
        #: ... from this file and tensor name (when known), ...
        self.origin: Optional[Tuple[str, str]] = None
        #: ... or another track's value after its first n ops (a ``clone`` or dtype cast of it).
        self.parent: Optional[Tuple[_Track, int]] = None
        self.log: List[_Op] = []
        #: Why an eager build's value cannot be reproduced (the parameter is refused).
        self.unexact: Optional[str] = None
        #: Read by another track's op (``_Ref``): its earlier ops are kept.
        self.referenced = False

    @classmethod
    def refused(cls, tensor: torch.Tensor, reason: str) -> "_Track":
        track = cls(tensor, _CPU, recorded=True)
        track.unexact = reason
        return track

    def holds(self, tensor: torch.Tensor) -> bool:
        return _key(tensor) == self.ref.cdata and not self.ref.expired()

    def append(self, op: _Op) -> None:
        if op.full and not self.referenced:
            self.log = [op]
            self.base = self.read = self.parent = self.origin = None
        else:
            self.log.append(op)

    def refuse(self, reason: str) -> None:
        if self.unexact is None:
            self.unexact = reason
            self.log, self.base, self.parent = [], None, None

    def known(self, upto: Optional[int] = None) -> bool:
        """Whether its value (after the first ``upto`` ops) is known without running initialisers."""
        log = self.log if upto is None else self.log[:upto]
        return any(op.full for op in log) or any(
            start is not None for start in (self.base, self.read, self.parent)
        )


def _default_generator(device: torch.device) -> Optional[torch.Generator]:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None
