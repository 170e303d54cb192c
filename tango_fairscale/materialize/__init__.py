"""
Building a model without ever holding all of it: parameters are created on the ``meta``
device (shapes only, no memory) and each FSDP unit's parameters are allocated and set on the
worker just before it is sharded, so a worker's peak is its shards plus one unit, not the whole
model. The values are those of an eager build of the same constructor from the same seed, bit
for bit, or the run is refused naming the parameters whose values cannot be known.

- :func:`parameters_on_meta` is the construction context: every parameter registered while it
  is active is moved to ``meta`` (patch P1). Buffers stay real, because many are computed in
  ``__init__`` (causal masks, position tables) and could not be recomputed later.
- :func:`materialize_module` allocates a module's ``meta`` parameters (outside already-built
  FSDP units) and gives each its value. :func:`check_initialisable` raises, before any worker
  starts, what materialising would raise (pre-flight and ``plan``).

What a parameter's value is, in this order:

1. **Pretrained** (:func:`mark_pretrained`: ``fairscale::from_pretrained``, or ``transformers``'
   ``from_pretrained`` routed by patch H2): its tensor in the files, then whatever in-place ops
   the constructor applied to it afterwards (replayed as below).
2. **Recorded**: while the model is built, a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
   records every in-place op applied to a ``meta`` parameter after its registration (``zero_``,
   ``fill_``, ``copy_``, ``uniform_``/``normal_`` of ``reset_parameters()``, ``kaiming_*``,
   ``xavier_*``, ``_init_weights``, writes through views and indexing, ...): deterministic ones with
   their operands (a real operand is copied), random ones with the state of the generator they
   draw from. The build draws the same random numbers as an eager build: each random op on a
   parameter runs once more on a scratch tensor of its shape on the parameter's device (views of
   one buffer, reused op after op: :meth:`_Recorder.scratch`). ``torch.nn.init``'s
   ``trunc_normal_``, ``orthogonal_``, ``dirac_`` and ``sparse_``, which return at once on
   ``meta``, are recorded and run that way whole (P1). Tensors a constructor derives from a
   parameter without reading its values (``new_empty``, ``zeros_like``, ...) are computed for
   real, as eagerly. At materialisation the ops from the last one that sets every element are
   replayed on the allocated parameter, random ones from their recorded generator state (restored
   after): the parameter holds the eager value, and the generator is left where the eager build
   left it. The ops are replayed on the device the eager build had the parameter on (the CPU; on
   GPU workers the value is then copied to the GPU). A parameter no op touched after its
   registration keeps the value its constructor created it with (``nn.Parameter(torch.ones(n))``,
   kept by reference until then).
3. **Initialised**: a parameter created uninitialised (``torch.empty``) that nothing set is
   initialised as before this recording existed: its module's ``reset_parameters()`` (or
   ``_reset_parameters()``), then a Hugging Face model's ``_init_weights`` (an eager build leaves
   such a parameter as whatever the memory held); the recorded ops, if any, are replayed after.
   Parameters no initialiser sets are refused, listed together.
4. **Refused**: a value computed on ``meta`` from other parameters' values (``p.data.copy_(q * 2)``,
   a norm of a pretrained weight as peft's DoRA computes), a parameter created on ``meta`` by the
   constructor (``nn.Linear(..., device=other.weight.device)``), or data replaced by such a tensor:
   :class:`ConfigurationError` naming each parameter and why. So is every random op after one
   that could not be run on a scratch tensor (the generator may no longer be in step).

The cost. Time: the build runs every random initialiser once, as an eager build does, and
materialising runs each parameter's ops from its last full overwrite again. Memory, between the
build and the unit's materialisation: a recorded op's operands (scalars; a copied real tensor
for ``copy_`` from one, whose memory an eager build holds as well), 5 KiB of CPU generator state
per random op still needed (earlier ops a later full overwrite made irrelevant are dropped), and
the value a constructor created a parameter with until an op overwrites it whole
(``torch.empty`` results are not kept). A model built from scratch never has more than one op's
scratch tensors real at a time; ``torch``'s own modules and ``transformers``' models create their
weights with ``torch.empty`` and overwrite them in their constructors.

Builds inside :func:`not_recorded` record nothing and draw nothing: :mod:`.pretrained` builds the
model transformers' ``from_pretrained`` would build there, whose parameters all come from the
files; ``from_pretrained`` itself draws no random numbers (transformers 4.57, tested), so neither
does that build. :func:`parameters_on_meta` with ``record=False`` keeps the earlier behaviour
(initialisers, a bare parameter's constructed value), for builds whose values are loaded anyway.
"""

import functools
import logging
import math
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ..compat import meta_parameter_registration

logger = logging.getLogger(__name__)

_state = threading.local()

#: The methods PyTorch's own modules initialise their parameters with (``nn.MultiheadAttention``
#: has ``_reset_parameters``), in the order they are tried.
_INITIALISERS = ("reset_parameters", "_reset_parameters")

#: Attribute of a ``meta`` parameter: its :class:`_Track`, what its value is made of.
_TRACK = "_tango_fairscale_track"

_CPU = torch.device("cpu")


def _moving_to_meta() -> bool:
    return getattr(_state, "depth", 0) > 0 and not getattr(_state, "paused", False)


def building_on_meta() -> bool:
    """Whether parameters registered now (on this thread) are moved to ``meta``."""
    return _moving_to_meta()


def _on_meta(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta"


# --- what a parameter's value is made of ---------------------------------------------------------

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


# --- recording a build ---------------------------------------------------------------------------

#: Ops whose result does not depend on their tensor operands' values: computed for real on a
#: scratch stand-in when those operands are on meta, as an eager build computes them.
_VALUE_INDEPENDENT = frozenset(
    f"aten::{name}"
    for name in (
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    )
)
#: In-place ops that set every element of ``self`` without reading it.
_FULL_WRITES = frozenset(
    f"aten::{name}"
    for name in (
        "fill_",
        "zero_",
        "copy_",
        "uniform_",
        "normal_",
        "random_",
        "bernoulli_",
        "exponential_",
        "cauchy_",
        "log_normal_",
        "geometric_",
    )
)
#: Factories whose result holds whatever the memory held.
_UNINITIALISED = frozenset(
    f"aten::{name}" for name in ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided")
)
#: A copy of a whole recorded tensor: recorded as a tensor whose start is the original's value.
_COPIES = frozenset(("aten::_to_copy", "aten::clone"))


@functools.cache
def _written_arguments(func: Any) -> Tuple[Tuple[int, str], ...]:
    return tuple(
        (index, argument.name)
        for index, argument in enumerate(func._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def _written(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Tuple[str, torch.Tensor]]:
    """The tensors an ATen op writes to, each with its argument's name."""
    written = []
    for index, name in _written_arguments(func):
        value = args[index] if index < len(args) else kwargs.get(name)
        written += [(name, t) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _generator_of(args: Any, kwargs: Any, device: torch.device) -> Optional[torch.Generator]:
    given = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Generator)]
    return given[0] if given else _default_generator(device)


def _off_meta(leaf: Any) -> Any:
    """An op's ``device`` argument for the real run of an op an eager build runs on the CPU."""
    return _CPU if isinstance(leaf, torch.device) and leaf.type == "meta" else leaf


_Entry = Tuple[StorageWeakRef, Any]


class _Recorder(TorchDispatchMode):
    """
    The ops of one build (one thread) on ``meta`` tensors: recorded when they write to a
    parameter, computed for real when their values do not depend on a parameter's, or marked as
    unknown. Storages are told apart by identity (each held by a weak reference, so none is
    reused while it is listed).
    """

    def __init__(self) -> None:
        super().__init__()
        #: meta storages: parameters' (and copies of them), tensors computed for real (their real
        #: storage), tensors whose values are not known (why).
        self.tracks: Dict[int, _Entry] = {}
        self.shadows: Dict[int, _Entry] = {}
        self.unknown: Dict[int, _Entry] = {}
        #: real storages made by an uninitialised factory and not written since; those of them a
        #: registered parameter was created with, with its track and view.
        self.uninitialised: Dict[int, _Entry] = {}
        self.watched: Dict[int, _Entry] = {}
        #: The parameters registered during the build (resolved again when it ends).
        self.parameters: List[weakref.ref[nn.Parameter]] = []
        #: The buffers scratch stand-ins are views of, by device (see :meth:`scratch`).
        self._arenas: Dict[torch.device, torch.UntypedStorage] = {}
        #: The op after which the random generator may no longer be where the eager build has it.
        self.lost: Optional[str] = None
        self._added = 0
        self._next_prune = 4096

    # -- storages ---------------------------------------------------------------------------

    def _find(self, table: Dict[int, _Entry], tensor: torch.Tensor) -> Optional[_Entry]:
        key = _key(tensor)
        entry = table.get(key)
        if entry is not None and entry[0].expired():
            del table[key]
            return None
        return entry

    def _put(self, table: Dict[int, _Entry], tensor: torch.Tensor, value: Any) -> None:
        storage = tensor.untyped_storage()
        table[storage._cdata] = (StorageWeakRef(storage), value)
        self._added += 1
        if self._added >= self._next_prune:
            live = 0
            for each in (self.tracks, self.shadows, self.unknown, self.uninitialised, self.watched):
                for key in [key for key, (ref, _) in each.items() if ref.expired()]:
                    del each[key]
                live += len(each)
            self._added, self._next_prune = 0, 2 * live + 4096

    def classify(self, tensor: torch.Tensor) -> Tuple[str, Any]:
        """``("track", _Track)``, ``("shadow", real storage)``, ``("unknown", why)``, or ``("", None)``."""
        for kind, table in (("track", self.tracks), ("shadow", self.shadows), ("unknown", self.unknown)):
            entry = self._find(table, tensor)
            if entry is not None:
                return kind, entry[1]
        return "", None

    def mark(self, tensor: torch.Tensor, kind: str, value: Any) -> None:
        key = _key(tensor)
        for table in (self.tracks, self.shadows, self.unknown):
            table.pop(key, None)
        tables = {"track": self.tracks, "shadow": self.shadows, "unknown": self.unknown}
        self._put(tables[kind], tensor, value)

    def adopt(self, meta: nn.Parameter, track: _Track, created: torch.Tensor) -> None:
        """A parameter just moved to meta by P1; ``created`` is the real tensor it was created with."""
        self.mark(meta, "track", track)
        self.parameters.append(weakref.ref(meta))
        if self._find(self.uninitialised, created) is None:
            track.base = created
        else:  # uninitialised memory: nothing to keep, unless the real tensor is written later
            self._put(self.watched, created, (track, _geometry(created)))

    def resolve(self, param: nn.Parameter) -> _Track:
        """The track of a meta parameter's current data (after a ``param.data = ...``, a new one)."""
        kind, value = self.classify(param)
        if kind == "track":
            return value  # type: ignore[no-any-return]
        # A parameter had a track before: its data was replaced (``param.data = other``).
        replaced = "its data was replaced by a tensor " if getattr(param, _TRACK, None) is not None else ""
        if kind == "unknown":
            return _Track.refused(param, f"{replaced}{value}")
        return _Track.refused(param, f"{replaced}created on the meta device by the model's constructor")

    def finish(self) -> None:
        """At the end of the build: each registered parameter's track is that of its data now."""
        for ref in self.parameters:
            param = ref()
            if param is None or not _on_meta(param):
                continue
            track = getattr(param, _TRACK, None)
            if track is None or not track.holds(param):
                setattr(param, _TRACK, self.resolve(param))
        # What only the build needed: the scratch buffers and the real values of derived tensors.
        self._arenas.clear()
        for table in (self.shadows, self.unknown, self.uninitialised, self.watched):
            table.clear()

    # -- ops --------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _recorder() is not self:
            return func(*args, **kwargs)
        metas = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and _on_meta(t)]
        written = _written(func, args, kwargs)
        if not metas:
            out = func(*args, **kwargs)
            self._note_real(func, written, out)
            made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if made and not written and all(_on_meta(t) and t.numel() <= 1 for t in made):
                # A scalar made on meta because a parameter is there (the scalar_tensor of
                # ``p.data[i] = 1.0``): made for real, as an eager build makes it.
                self._shadow(made, func(*tree_map(_off_meta, args), **tree_map(_off_meta, kwargs)), set())
            return out
        classes = [self.classify(t) for t in metas]
        if not any(kind for kind, _ in classes):
            return func(*args, **kwargs)  # made on meta on purpose, not from the build's parameters
        random = torch.Tag.nondeterministic_seeded in func.tags
        written_meta = [(name, t) for name, t in written if _on_meta(t)]
        if written_meta:
            return self._write(func, args, kwargs, written_meta, random)
        if func.is_view:
            return func(*args, **kwargs)  # shares its operand's storage, hence its class
        name = func._schema.name
        if name in _COPIES and len(metas) == 1 and classes[0][0] == "track":
            copy = self._copy(func, args, kwargs, metas[0], classes[0][1])
            if copy is not None:
                return copy
        if name in _VALUE_INDEPENDENT or all(kind == "shadow" for kind, _ in classes):
            return self._compute(func, args, kwargs, metas)
        out = func(*args, **kwargs)
        reasons = [str(value) for kind, value in classes if kind == "unknown"]
        why = reasons[0] if reasons else f"computed on meta by {func} from a parameter's values"
        inputs = {_key(t) for t in metas}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and _on_meta(tensor) and _key(tensor) not in inputs:
                self.mark(tensor, "unknown", why)
        if random:
            self._advance(func, args, kwargs)
        return out

    def _note_real(self, func: Any, written: List[Tuple[str, torch.Tensor]], out: Any) -> None:
        """Real tensors: which hold uninitialised memory, and a parameter's creation tensor written after."""
        for _, tensor in written:
            key = _key(tensor)
            self.uninitialised.pop(key, None)
            entry = self.watched.pop(key, None)
            if entry is not None and not entry[0].expired():
                track, geometry = entry[1]
                if track.unexact is None and not track.known():
                    track.base = _view(tensor.untyped_storage(), geometry)
        if func._schema.name in _UNINITIALISED:
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and not _on_meta(tensor):
                    self._put(self.uninitialised, tensor, None)

    def _write(
        self, func: Any, args: Any, kwargs: Any, written: List[Tuple[str, torch.Tensor]], random: bool
    ) -> Any:
        targets = []
        for argument, tensor in written:
            kind, value = self.classify(tensor)
            if kind == "track":
                targets.append((argument, tensor, value))
        for argument, tensor, track in targets:
            full = (func._schema.name in _FULL_WRITES and argument == "self") or argument == "out"
            self.record(func, args, kwargs, tensor, track, random, full)
        others = [tensor for _, tensor in written if self.classify(tensor)[0] != "track"]
        metas = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and _on_meta(t)]
        if not targets and all(self.classify(t)[0] == "shadow" for t in metas):
            return self._compute(func, args, kwargs, metas)
        why = f"set on meta by {func} from values that are not known"
        for tensor in others:
            if self.classify(tensor)[0] == "shadow":
                self.mark(tensor, "unknown", why)
        if random and (targets or any(self.classify(t)[0] == "unknown" for t in others)):
            self._advance(func, args, kwargs)
        return func(*args, **kwargs)

    def record(
        self,
        func: Callable[..., Any],
        args: Any,
        kwargs: Any,
        target: torch.Tensor,
        track: _Track,
        random: bool,
        full: bool,
    ) -> None:
        """Add an op that writes to ``target`` (a view of ``track``'s storage) to the track's log."""
        if track.unexact is not None:
            return
        problems: List[str] = []
        slots = 0

        def operand(leaf: Any) -> Any:
            nonlocal slots
            if not isinstance(leaf, torch.Tensor):
                return leaf
            if not _on_meta(leaf):
                return _Const(leaf.detach().clone())
            if track.holds(leaf):
                slots += 1
                return _Slot(_geometry(leaf))
            kind, value = self.classify(leaf)
            if kind == "shadow":
                return _Const(_view(value, _geometry(leaf)).clone())
            if kind == "track" and value.unexact is None and value.known():
                value.referenced = True
                return _Ref(value, len(value.log), _geometry(leaf))
            problems.append(_unknown_operand(kind, value))
            return leaf

        recorded_args, recorded_kwargs = tree_map(operand, args), tree_map(operand, kwargs)
        if problems:
            track.refuse(f"set by {_op_name(func)} from {problems[0]}")
            return
        generator = state = None
        if random and self.lost is not None:
            track.refuse(
                f"drawn after {self.lost}: the random generator may not be where the eager build has it"
            )
            return
        if random:
            generator = _generator_of(args, kwargs, track.device)
            if generator is None:
                track.refuse(f"a random op on {track.device}, whose generator is not recorded")
                return
            state = generator.get_state()
        full = full and slots == 1 and _covers(_geometry(target), track.geometry)
        track.append(_Op(func, recorded_args, recorded_kwargs, full, generator, state))

    def scratch(
        self, metas: List[torch.Tensor], zeros: AbstractSet[int] = frozenset()
    ) -> Dict[int, torch.Tensor]:
        """
        Real stand-ins for meta tensors (by ``id``; zeros for those in ``zeros``, else whatever the
        memory holds), each on the device an eager build has it on and in its layout: views of one
        buffer per device, kept and reused op after op. A tensor
        per op, freed at once, fragmented the heap: building GPT-2 small (124 M parameters) under
        glibc's default malloc settings peaked 471 MiB above the start, against 170 MiB.
        """
        placed: List[Tuple[torch.Tensor, torch.device, int, int]] = []
        totals: Dict[torch.device, int] = {}
        for tensor in metas:
            kind, value = self.classify(tensor)
            device = value.device if kind == "track" else _CPU
            span = sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride()))
            nbytes = (span + 1) * tensor.element_size() if tensor.numel() else 0
            start = totals.get(device, 0)
            totals[device] = start + -(-nbytes // 64) * 64  # aligned for any dtype
            placed.append((tensor, device, start, nbytes))
        for device, total in totals.items():
            if device not in self._arenas or self._arenas[device].nbytes() < total:
                self._arenas.pop(device, None)  # freed before the larger one is made
                self._arenas[device] = torch.UntypedStorage(total, device=device)
        views = {}
        for tensor, device, start, nbytes in placed:
            arena = self._arenas[device]
            if id(tensor) in zeros and nbytes:
                torch.empty(0, dtype=torch.uint8, device=device).set_(arena, start, (nbytes,), (1,)).zero_()
            offset = start // tensor.element_size()
            views[id(tensor)] = torch.empty(0, dtype=tensor.dtype, device=device).set_(
                arena, offset, tensor.shape, tensor.stride()
            )
        return views

    def _advance(self, func: Callable[..., Any], args: Any, kwargs: Any) -> None:
        """Draw the random numbers the eager build draws for this op, on scratch stand-ins."""
        metas = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and _on_meta(t)]
        # Operands read get zeros (a valid probability, mean, ...); what the op only writes, nothing.
        read = {id(t) for t in metas} - {id(t) for _, t in _written(func, args, kwargs)}
        stand_ins = self.scratch(metas, zeros=read)

        def scratch(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and _on_meta(leaf):
                return stand_ins[id(leaf)]
            return _off_meta(leaf)

        self.run_for_real(func, tree_map(scratch, args), tree_map(scratch, kwargs), random=True)

    def run_for_real(self, func: Callable[..., Any], args: Any, kwargs: Any, random: bool) -> Any:
        """``func`` on real stand-ins; ``None`` if it fails (then the generator may be out of step)."""
        try:
            return func(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a stand-in the op refuses: what depends on it is refused
            if random and self.lost is None:
                first = str(error).splitlines()[0] if str(error) else type(error).__name__
                self.lost = f"{_op_name(func)}, which failed on a scratch tensor ({first})"
            return None

    def _compute(self, func: Any, args: Any, kwargs: Any, metas: List[torch.Tensor]) -> Any:
        """Run the op for real on the real values of its meta operands (or on stand-ins it does not read)."""
        stand_ins = self.scratch([t for t in metas if self.classify(t)[0] != "shadow"])

        def real(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and _on_meta(leaf):
                kind, value = self.classify(leaf)
                return _view(value, _geometry(leaf)) if kind == "shadow" else stand_ins[id(leaf)]
            return _off_meta(leaf)

        random = isinstance(func, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in func.tags
        real_out = self.run_for_real(func, tree_map(real, args), tree_map(real, kwargs), random)
        out = func(*args, **kwargs)
        if real_out is not None:
            self._shadow(tree_leaves(out), real_out, {_key(t) for t in metas})
            return out
        why = f"computed on meta by {func}, which failed on real values"
        for tensor in [*tree_leaves(out), *(t for _, t in _written(func, args, kwargs))]:
            if isinstance(tensor, torch.Tensor) and _on_meta(tensor) and self.classify(tensor)[0] != "track":
                self.mark(tensor, "unknown", why)
        return out

    def _shadow(self, outputs: List[Any], real_out: Any, inputs: Set[int]) -> None:
        """Keep the real values of an op's meta outputs (those not its operands' own storages)."""
        for meta, value in zip(outputs, tree_leaves(real_out)):
            if not (isinstance(meta, torch.Tensor) and _on_meta(meta) and isinstance(value, torch.Tensor)):
                continue
            if _key(meta) in inputs:
                continue  # in place: the real op wrote into the operand's real storage
            storage = torch.UntypedStorage(meta.untyped_storage().nbytes(), device=value.device)
            _view(storage, _geometry(meta)).copy_(value)
            self.mark(meta, "shadow", storage)

    def _copy(self, func: Any, args: Any, kwargs: Any, source: torch.Tensor, track: _Track) -> Any:
        """A copy of a whole parameter (``clone``, a dtype cast): a track that starts from its value."""
        if track.unexact is not None or not track.known() or not _covers(_geometry(source), track.geometry):
            return None
        out = func(*args, **kwargs)
        if not (isinstance(out, torch.Tensor) and _on_meta(out)):
            return out
        copy = _Track(out, track.device, recorded=True)
        copy.parent = (track, len(track.log))
        track.referenced = True
        self.mark(out, "track", copy)
        _remember_copy(out, copy)
        return out


def _remember_copy(tensor: torch.Tensor, track: _Track) -> None:
    """
    Keep a copy's track on its storage (whose Python object lives as long as it does): a parameter
    made over the copy without being registered (``copy.deepcopy`` of a module: peft's
    ``modules_to_save`` makes its trainable copy so) finds it there after the build, instead of
    being left to initialisers (a fresh random value where the eager build has the copied one).
    """
    setattr(tensor.untyped_storage(), _TRACK, track)


def _copied_track(param: nn.Parameter) -> Optional[_Track]:
    """The track of a copy made during a build whose storage ``param`` holds, if it is one."""
    track: Optional[_Track] = getattr(param.untyped_storage(), _TRACK, None)
    return track if track is not None and track.holds(param) else None


def _op_name(func: Any) -> str:
    if isinstance(func, torch._ops.OpOverload):
        return str(func)
    return f"{func.__module__}.{func.__qualname__}"


def _unknown_operand(kind: str, value: Any) -> str:
    """What an operand whose value cannot be known is, for the refusal."""
    if kind == "unknown":
        return f"a value {value}"
    if kind == "track" and value.unexact:
        return f"a parameter {value.unexact}"
    if kind == "track":
        return "a parameter that was given no value before"
    return "a tensor created on the meta device"


def _recorder() -> Optional[_Recorder]:
    """This thread's recorder while it records (not while paused, nor inside :func:`not_recorded`)."""
    recorder = getattr(_state, "recorder", None)
    if recorder is None or getattr(_state, "paused", False) or getattr(_state, "quiet", 0):
        return None
    return recorder  # type: ignore[no-any-return]


def _initialiser_on_meta(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """
    P1's stand-in for the ``torch.nn.init`` functions that return at once on a meta tensor
    (``trunc_normal_``, ``orthogonal_``, ``dirac_``, ``sparse_``): on a parameter being recorded,
    the call is recorded whole (it sets every element) and run on a scratch tensor, drawing what
    the eager call draws; elsewhere the function itself.
    """
    recorder = _recorder()
    tensor = args[0] if args else kwargs.get("tensor")
    if recorder is None or not isinstance(tensor, torch.Tensor) or not _on_meta(tensor):
        return original(*args, **kwargs)
    kind, value = recorder.classify(tensor)
    if not kind:
        return original(*args, **kwargs)  # on meta in an eager build as well: a no-op there too
    if kind == "track":
        recorder.record(original, args, kwargs, tensor, value, random=True, full=True)
    if kind == "shadow":
        stand_in = _view(value, _geometry(tensor))
    else:
        stand_in = recorder.scratch([tensor])[id(tensor)]  # the initialisers set every element

    def swap(leaf: Any) -> Any:
        return stand_in if leaf is tensor else leaf

    recorder.run_for_real(original, tree_map(swap, args), tree_map(swap, kwargs), random=True)
    return tensor


# --- the build -----------------------------------------------------------------------------------


def _has_initialiser(module: nn.Module) -> bool:
    return any(callable(getattr(module, name, None)) for name in _INITIALISERS)


def _to_meta(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """
    Registration hook (P1): in a thread inside :func:`parameters_on_meta`, move the new parameter
    to meta, with its :class:`_Track`. Without recording (``record=False``, :func:`not_recorded`),
    as before the recording: a parameter that no initialiser could set again (a bare
    ``nn.Parameter`` on a module without ``reset_parameters``, e.g. a learned scale) keeps the
    value its constructor gave it; Hugging Face modules are left to the model's ``_init_weights``.
    """
    if not _moving_to_meta():
        return
    recorder = _recorder()
    if _on_meta(param):
        if recorder is not None and getattr(param, _TRACK, None) is None:
            # Another Parameter over a recorded storage (nn.Parameter(other)), or one made on meta.
            setattr(param, _TRACK, recorder.resolve(param))
            recorder.parameters.append(weakref.ref(param))
        return
    meta = nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)
    track = _Track(meta, param.device, recorded=recorder is not None)
    if recorder is not None:
        recorder.adopt(meta, track, param.data)
    elif not _has_initialiser(module) and not type(module).__module__.startswith("transformers."):
        track.base = param.data
    setattr(meta, _TRACK, track)
    module._parameters[name] = meta


@contextmanager
def parameters_on_meta(record: bool = True) -> Iterator[None]:
    """
    Within this context (on this thread), new parameters are moved to the ``meta`` device, and
    (``record``) the ops applied to them are recorded, so that :func:`materialize_module` gives
    them an eager build's values (see the module's docstring). Other threads are not affected;
    the registration hook itself is installed process-wide by
    :func:`tango_fairscale.compat.meta_parameter_registration` (patch P1). Nested, the
    outermost decides whether to record.
    """
    depth = getattr(_state, "depth", 0)
    recorder = _Recorder() if depth == 0 and record else None
    _state.depth = depth + 1
    try:
        with meta_parameter_registration(_to_meta, _initialiser_on_meta):
            if recorder is None:
                yield
            else:
                _state.recorder = recorder
                try:
                    with recorder:
                        yield
                finally:
                    recorder.finish()
                    _state.recorder = None
    finally:
        _state.depth = depth


@contextmanager
def real_parameters() -> Iterator[None]:
    """Suspend :func:`parameters_on_meta` and its recording (while materialising or wrapping a unit)."""
    paused = getattr(_state, "paused", False)
    _state.paused = True
    try:
        yield
    finally:
        _state.paused = paused


@contextmanager
def not_recorded() -> Iterator[None]:
    """
    Within a :func:`parameters_on_meta` build, build on meta without recording ops or drawing
    random numbers: for a model whose parameters are all marked pretrained right after, built as
    ``transformers``' ``from_pretrained`` builds it (which draws none).
    """
    _state.quiet = getattr(_state, "quiet", 0) + 1
    try:
        yield
    finally:
        _state.quiet -= 1


def mark_pretrained(
    param: nn.Parameter, read: Callable[[], torch.Tensor], origin: Optional[Tuple[str, str]] = None
) -> None:
    """
    Give a ``meta`` parameter its pretrained value, read by ``read()`` only when its unit is
    materialised (:func:`materialize_module`), in place of any initialiser: a worker reads one
    unit's tensors at a time from memory-mapped files, never the whole model. The tensor
    ``read()`` returns may become the parameter's data until the unit is sharded (see
    ``one_allocation``), never written through. In-place ops on the parameter after this (in a
    recorded build) are replayed on the value read. ``origin`` is the file and the tensor name
    ``read`` reads (see :func:`pretrained_origin`).
    """
    if not _on_meta(param):
        raise ValueError("mark_pretrained takes meta parameters")
    track = _Track(param, _CPU, recorded=True)
    track.read = read
    track.origin = origin
    recorder = getattr(_state, "recorder", None)
    if recorder is not None:
        recorder.mark(param, "track", track)
        recorder.parameters.append(weakref.ref(param))
    setattr(param, _TRACK, track)


def pretrained_origin(param: nn.Parameter) -> Optional[Tuple[str, str]]:
    """
    The file and tensor name a ``meta`` parameter's value is, unchanged, when it has one: marked
    by :func:`mark_pretrained` with an ``origin`` and not written since. Such a parameter, frozen,
    keeps that value for the whole run, so checkpoints can name it instead of holding it
    (:mod:`tango_fairscale.checkpointing.pretrained_base`). ``None`` for any other parameter.
    """
    if not _on_meta(param):
        return None
    track = _track_of(param)
    if track is None or _kind(track) != "read":
        return None
    return track.origin


def has_meta_parameters(module: nn.Module) -> bool:
    return any(_on_meta(p) for p in module.parameters())


# --- materialising -------------------------------------------------------------------------------


def _track_of(param: nn.Parameter) -> Optional[_Track]:
    """A meta parameter's track, for its current data; ``None`` if not built by :func:`parameters_on_meta`."""
    track: Optional[_Track] = getattr(param, _TRACK, None)
    if track is not None and (track.holds(param) or not track.recorded):
        return track
    recorder: Optional[_Recorder] = getattr(_state, "recorder", None)
    if recorder is not None:
        track = recorder.resolve(param)
        setattr(param, _TRACK, track)
        return track
    if track is not None:
        return _Track.refused(param, "its data was replaced on meta after the model was built")
    track = _copied_track(param)
    if track is not None:
        setattr(param, _TRACK, track)
    return track


def _kind(track: Optional[_Track]) -> str:
    """``"refuse"``, ``"read"`` (its pretrained tensor as it is), ``"exact"`` or ``"initialise"``."""
    if track is None:
        return "initialise"
    if track.unexact is not None:
        return "refuse"
    if track.read is not None and not track.log:
        return "read"
    return "exact" if track.known() else "initialise"


def _workspace(
    track: _Track, into: Optional[torch.Tensor], log: List[_Op]
) -> Tuple[torch.UntypedStorage, int, bool]:
    """Where to replay: ``into``'s storage when it has the parameter's layout and device, else a new one."""
    dtype, _, stride, offset = track.geometry
    if (
        into is not None
        and into.device.type == track.device.type == "cpu"
        and into.dtype == dtype
        and tuple(into.stride()) == stride
        and offset == 0
        and track.nbytes == into.numel() * into.element_size()
        and all(
            leaf.geometry[0] == dtype
            for op in log
            for leaf in tree_leaves((op.args, op.kwargs))
            if isinstance(leaf, _Slot)
        )
    ):
        return into.untyped_storage(), int(into.storage_offset()), True
    return torch.UntypedStorage(track.nbytes, device=track.device), 0, False


def _start(track: _Track) -> torch.Tensor:
    if track.base is not None:
        return track.base
    if track.read is not None:
        value = track.read()
        if tuple(value.shape) != track.geometry[1]:
            raise ConfigurationError(
                f"the pretrained value to load has shape {list(value.shape)}, "
                f"the parameter {list(track.geometry[1])}."
            )
        return value
    assert track.parent is not None
    parent, upto = track.parent
    return _evaluate(parent, upto=upto)


@torch.no_grad()
def _evaluate(
    track: _Track, into: Optional[torch.Tensor] = None, upto: Optional[int] = None, initialised: bool = False
) -> torch.Tensor:
    """
    ``track``'s value after its first ``upto`` ops (all of them by default), replayed on the device
    the eager build had it on; written into ``into`` when given, whose value is the start when
    ``initialised`` (set by initialisers). Returns it in the parameter's view.
    """
    log = track.log if upto is None else track.log[:upto]
    start = max((index for index, op in enumerate(log) if op.full), default=None)
    storage, shift, in_place = _workspace(track, into, log)
    value = _view(storage, track.geometry, shift)
    if start is None:
        if initialised:
            assert into is not None
            if not in_place:
                value.copy_(into)
        else:
            value.copy_(_start(track))
        start = 0
    for op in log[start:]:
        _replay(op, storage, shift, track.device)
    if into is not None and not in_place:
        into.copy_(value)
    return value


def _replay(op: _Op, storage: torch.UntypedStorage, shift: int, device: torch.device) -> None:
    def operand(leaf: Any) -> Any:
        if isinstance(leaf, _Slot):
            return _view(storage, leaf.geometry, shift)
        if isinstance(leaf, _Const):
            return leaf.tensor.to(device)
        if isinstance(leaf, _Ref):
            source = _evaluate(leaf.track, upto=leaf.upto)
            offset = int(source.storage_offset()) - leaf.track.geometry[3]
            return _view(source.untyped_storage(), leaf.geometry, offset)
        return leaf

    args, kwargs = tree_map(operand, op.args), tree_map(operand, op.kwargs)
    if op.generator is None:
        op.func(*args, **kwargs)
        return
    assert op.state is not None
    saved = op.generator.get_state()
    op.generator.set_state(op.state)
    try:
        op.func(*args, **kwargs)
    finally:
        op.generator.set_state(saved)


def _modules_outside_units(
    module: nn.Module, is_unit: Optional[Callable[[nn.Module], bool]]
) -> Iterator[nn.Module]:
    """``module`` and its submodules, those inside a submodule that ``is_unit`` says is a unit left out."""
    stack = [module]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(child for child in current.children() if is_unit is None or not is_unit(child))


def _hf_init_function(root: nn.Module) -> Optional[Callable[[nn.Module], None]]:
    """The ``_init_weights`` of the outermost Hugging Face model in ``root``, if there is one."""
    for candidate in root.modules():
        init = getattr(candidate, "_init_weights", None)
        if callable(init) and hasattr(candidate, "config"):
            return init  # type: ignore[no-any-return]
    return None


@torch.no_grad()
def _initialise(touched: List[nn.Module], check: Set[int], root: nn.Module) -> List[str]:
    """Run the initialisers of the ``touched`` modules; the names of those in ``check`` still unset (NaN)."""
    hf_init = _hf_init_function(root)
    for submodule in touched:
        for initialiser in _INITIALISERS:
            reset = getattr(submodule, initialiser, None)
            if callable(reset):
                reset()
                break
        if hf_init is not None:
            hf_init(submodule)
    return [
        f"{type(submodule).__name__}.{name}"
        for submodule in touched
        for name, p in submodule._parameters.items()
        if p is not None and id(p) in check and torch.isnan(p).any()
    ]


def _uncovered_error(names: List[str]) -> ConfigurationError:
    return ConfigurationError(
        f"init_on_meta: no initialiser sets {sorted(set(names))}: their modules have no reset_parameters() "
        "(or _reset_parameters()) that sets them and no Hugging Face _init_weights covers them. Give "
        "those modules a reset_parameters() method, or set init_on_meta: false."
    )


def _unexact_error(refused: List[Tuple[str, str]]) -> ConfigurationError:
    shown = "; ".join(f"{name} ({why})" for name, why in refused[:5])
    more = f"; and {len(refused) - 5} more" if len(refused) > 5 else ""
    return ConfigurationError(
        f"init_on_meta cannot give these parameters the values an eager build of the model gives them: "
        f"{shown}{more}. While the model is built its parameters are on meta, without values: compute "
        "these from constants and random draws (e.g. in reset_parameters()), or set "
        "training_engine.init_on_meta: false."
    )


@torch.no_grad()
def materialize_module(
    module: nn.Module,
    device: torch.device,
    root: Optional[nn.Module] = None,
    one_allocation: bool = False,
    is_unit: Optional[Callable[[nn.Module], bool]] = None,
) -> int:
    """
    Allocate ``module``'s ``meta`` parameters on ``device`` and give them their values (see the
    module's docstring). Returns the number of elements materialised.

    ``is_unit``, given by the backend that shards right after: whether a submodule is already a
    unit of its own (built and sharded), whose parameters are the unit's and are skipped, with
    everything inside it. This module knows no backend's types.

    ``one_allocation``, for a module that FSDP2, or FairScale with ``flatten_parameters``, shards
    right after (both copy every parameter out before anything writes to it):

    - the new parameters of one dtype are views of one buffer, so that a unit is one allocation,
      freed as one once sharding has copied every parameter out of it. Allocated parameter by
      parameter, those under the CPU mmap threshold (:mod:`tango_fairscale.cpu.memory`) came from
      the heap, which each unit's shard then fragmented: loading GPT-2 small (124 M parameters, 2
      workers, a unit per block) grew a worker's private memory 133 MiB more than its shards;
    - a pretrained parameter of a module not initialised (none of its parameters left to an
      initialiser) on the CPU, with no op recorded on it, is the tensor its reader gives, not a
      copy: from ``fairscale::from_pretrained``, a view of the read-only mapped file, whose pages
      are the page cache's. Copying it first held every unit twice in private memory while it was
      sharded.

    Not for FairScale's unflattened sharding, which frees each parameter's storage in place: views
    of one buffer share it, and a mapped file's cannot be freed.
    """
    found: List[Tuple[nn.Module, str, nn.Parameter]] = []
    for submodule in _modules_outside_units(module, is_unit):
        for name, param in submodule._parameters.items():
            if param is not None and _on_meta(param):
                found.append((submodule, name, param))
    fresh = {id(p): p for _, _, p in found}  # tied parameters once
    tracks = {key: _track_of(p) for key, p in fresh.items()}
    kinds = {key: _kind(track) for key, track in tracks.items()}
    refused = [
        (f"{type(m).__name__}.{n}", str(tracks[id(p)].unexact))  # type: ignore[union-attr]
        for m, n, p in found
        if kinds[id(p)] == "refuse"
    ]
    if refused:
        raise _unexact_error(refused)
    # Modules with a parameter left to initialisers run them, which may overwrite their others:
    # those are set after, and none of a touched module's parameters can be a read-only mapping.
    touched = list(dict.fromkeys(m for m, _, p in found if kinds[id(p)] == "initialise"))
    in_touched = {id(p) for m in touched for p in m._parameters.values() if p is not None}
    values: Dict[int, torch.Tensor] = {}
    for key, old in fresh.items():
        if kinds[key] != "read":
            continue
        value = tracks[key].read()  # type: ignore[union-attr,misc]
        if tuple(value.shape) != tuple(old.shape):
            holder, name = next((m, n) for m, n, p in found if p is old)
            raise ConfigurationError(
                f"{type(holder).__name__}.{name}: the value to load has shape {list(value.shape)}, "
                f"the parameter {list(old.shape)}."
            )
        values[key] = value
    aliased = {
        key
        for key, value in values.items()
        if one_allocation
        and key not in in_touched
        and value.dtype == fresh[key].dtype
        and value.device.type == device.type == "cpu"
    }
    buffers: Dict[torch.dtype, torch.Tensor] = {}
    if one_allocation:
        for dtype in dict.fromkeys(p.dtype for key, p in fresh.items() if key not in aliased):
            total = sum(p.numel() for key, p in fresh.items() if p.dtype == dtype and key not in aliased)
            buffers[dtype] = torch.empty(total, dtype=dtype, device=device)
    offsets = dict.fromkeys(buffers, 0)
    replaced: Dict[int, nn.Parameter] = {}
    for key, old in fresh.items():
        if key in aliased:
            new = values[key]
        elif one_allocation:
            start = offsets[old.dtype]
            offsets[old.dtype] += old.numel()
            new = buffers[old.dtype][start : start + old.numel()].view(old.shape)
        else:
            new = torch.empty(old.shape, dtype=old.dtype, device=device)
        if kinds[key] == "initialise":
            new.fill_(math.nan)  # NaN marks what no initialiser touched
        replaced[key] = nn.Parameter(new, requires_grad=old.requires_grad)
    for submodule, name, old in found:
        submodule._parameters[name] = replaced[id(old)]
    if touched:
        check = {id(replaced[key]) for key, kind in kinds.items() if kind == "initialise"}
        unset = _initialise(touched, check, root if root is not None else module)
        if unset:
            raise _uncovered_error(unset)
    for key, kind in kinds.items():
        new = replaced[key]
        track = tracks[key]
        if kind == "read" and key not in aliased:
            new.copy_(values[key])
        elif kind == "exact":
            _evaluate(track, into=new)  # type: ignore[arg-type]
        elif kind == "initialise" and track is not None and track.log:
            _evaluate(track, into=new, initialised=True)
    return sum(p.numel() for p in replaced.values())


def check_initialisable(model: nn.Module) -> None:
    """
    Raise one :class:`ConfigurationError` listing every parameter of a model built under
    :func:`parameters_on_meta` whose eager value cannot be reproduced, or, failing that, every one
    that materialising would leave unset, without materialising the model: the modules with
    parameters left to initialisers are tried on the CPU, one per class and set of such
    parameters (initialisers act per class), so the cost is bounded by the distinct classes, not
    the model's size. For pre-flight and ``plan``.
    """
    refused: List[Tuple[str, str]] = []
    for path, param in model.named_parameters():
        if _on_meta(param):
            track = _track_of(param)
            if _kind(track) == "refuse":
                refused.append((path, str(track.unexact)))  # type: ignore[union-attr]
    if refused:
        raise _unexact_error(refused)
    tried: Dict[Tuple[type, Tuple[str, ...]], List[str]] = {}
    unset: List[str] = []
    for path, module in model.named_modules():
        left = tuple(
            name
            for name, p in module._parameters.items()
            if p is not None and _on_meta(p) and _kind(_track_of(p)) == "initialise"
        )
        if not left:
            continue
        kind = (type(module), left)
        if kind not in tried:
            check = _allocate_own(module, left)
            tried[kind] = [name.split(".", 1)[1] for name in _initialise([module], check, model)]
        unset += [f"{path}.{name}" if path else name for name in tried[kind]]
    if unset:
        raise _uncovered_error(unset)


@torch.no_grad()
def _allocate_own(module: nn.Module, left: Tuple[str, ...]) -> Set[int]:
    """
    Allocate ``module``'s own ``meta`` parameters on the CPU for a trial initialisation: NaN for
    those ``left`` to initialisers (whose ids are returned), zeros for the others.
    """
    check: Set[int] = set()
    for name, old in list(module._parameters.items()):
        if old is None or not _on_meta(old):
            continue
        fresh = torch.full(old.shape, math.nan if name in left else 0.0, dtype=old.dtype)
        module._parameters[name] = nn.Parameter(fresh, requires_grad=old.requires_grad)
        if name in left:
            check.add(id(module._parameters[name]))
    return check
