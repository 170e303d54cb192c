"""
The construction context: :func:`parameters_on_meta` (parameters registered inside it moved to
``meta``, with P1, and their in-place ops recorded), its pauses (:func:`real_parameters`,
:func:`not_recorded`), and the marks of pretrained values (:func:`mark_pretrained`).
"""

import weakref
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Tuple

import torch
import torch.nn as nn

from ..compat import meta_parameter_registration
from .recording import _initialiser_on_meta, _Recorder, _recorder, _state
from .replay import _kind, _track_of
from .tracks import _CPU, _INITIALISERS, _TRACK, _on_meta, _Track


def _moving_to_meta() -> bool:
    return getattr(_state, "depth", 0) > 0 and not getattr(_state, "paused", False)


def building_on_meta() -> bool:
    """Whether parameters registered now (on this thread) are moved to ``meta``."""
    return _moving_to_meta()


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
