"""
Recording a build on ``meta``: a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that
adds each in-place op on a parameter to the parameter's track, computes for real what does not
depend on a parameter's values, marks the rest as unknown, and draws the random numbers an eager
build draws, on scratch stand-ins (see :mod:`tango_fairscale.materialize`).
"""

import functools
import threading
import weakref
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .tracks import (
    _CPU,
    _TRACK,
    _Const,
    _covers,
    _default_generator,
    _geometry,
    _key,
    _on_meta,
    _Op,
    _Ref,
    _Slot,
    _Track,
    _view,
)

#: This thread's build: how deep inside ``parameters_on_meta`` (``depth``), paused by
#: ``real_parameters`` (``paused``), inside ``not_recorded`` (``quiet``), and its ``recorder``.
_state = threading.local()


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
