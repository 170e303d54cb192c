"""
Replaying a track: a parameter's value rebuilt from its start and the ops recorded on it since
its last full overwrite, random ones from their recorded generator state (restored after), on
the device the eager build had it on.
"""

from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn
from tango.common.exceptions import ConfigurationError
from torch.utils._pytree import tree_leaves, tree_map

from .recording import _copied_track, _Recorder, _state
from .tracks import _TRACK, _Const, _Op, _Ref, _Slot, _Track, _view


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
