"""
:class:`LiveTensorBytes`: a dispatch mode adding up the bytes of the tensors alive after each
operation, on real, fake or ``meta`` tensors alike: how ``plan`` measures a step, and an
optimizer's step, without memory.
"""

import functools
import weakref
from typing import Any, Dict, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """
    The bytes of the tensors that the operations run inside it made and that are still alive, and
    the most there were at once (:attr:`peak`), with what :meth:`hold` adds for memory the
    operations do not show (FSDP's gathered parameters). A tensor is counted once per storage (a
    view adds nothing) from the operation that made it until its storage is freed (a weak
    reference's callback): saved for backward, it stays counted until backward releases it.
    Storages alive before (``known``: parameters, buffers, inputs) are not counted. Works on real,
    fake and ``meta`` tensors alike: a fake tensor's storage has a size but no memory.

    What it cannot see: memory a kernel allocates for itself without returning it as a tensor
    (workspaces, scratch buffers), and what an allocator keeps beyond live tensors.
    """

    def __init__(self, known: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = 0
        """Bytes of the tracked tensors alive now."""
        self.peak = 0
        self.held: Dict[str, int] = {}
        """Bytes added by :meth:`hold`, by kind."""
        self.at_peak: Dict[str, int] = {}
        """:attr:`held` and ``"tensors"`` (:attr:`live`) at the peak."""
        self.excluded = 0
        """Of :attr:`live`, bytes that :attr:`peak_alone` leaves out (parameters' gradients)."""
        self.peak_alone = 0
        """The most bytes of tracked tensors at once, :attr:`excluded` left out."""
        self._tracked: Dict[int, Any] = {}
        self._known = {tensor.untyped_storage()._cdata for tensor in known}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._known or key in self._tracked:
            return
        size = storage.nbytes()
        self._tracked[key] = weakref.ref(storage, functools.partial(self._release, key, size))
        self.live += size
        self.peak_alone = max(self.peak_alone, self.live - self.excluded)
        self._update()

    def _release(self, key: int, size: int, _storage: Any = None) -> None:
        if self._tracked.pop(key, None) is not None:
            self.live -= size

    def hold(self, kind: str, size: int) -> None:
        """Count ``size`` more bytes (less, if negative) of ``kind``, which no operation here made."""
        self.held[kind] = self.held.get(kind, 0) + size
        self._update()

    def _update(self) -> None:
        total = self.live + sum(self.held.values())
        if total > self.peak:
            self.peak = total
            self.at_peak = {"tensors": self.live, "excluded": self.excluded, **self.held}
