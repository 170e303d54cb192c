"""
The backends by name (which module and class implement each), and by checkpoint: which one
wrote a checkpoint, asked of the backends themselves (:meth:`Backend.owns`), so that nothing
outside a backend's folder knows its format.
"""

import importlib
from pathlib import Path
from typing import Any, Dict, List, Mapping, Type

from ..errors import CheckpointError
from .base import Backend

#: Each backend's name -> the module and class that implement it.
_IMPLEMENTATIONS: Dict[str, str] = {
    "fairscale": "tango_fairscale.backends.fairscale_fsdp.backend:FairScaleBackend",
    "torch": "tango_fairscale.backends.torch_fsdp2.backend:TorchBackend",
}
#: The backends' names, in the order the docs list them; the first is the default.
BACKENDS = tuple(_IMPLEMENTATIONS)
DEFAULT_BACKEND = BACKENDS[0]


def backend_class(name: str) -> Type[Backend]:
    """The backend called ``name`` (one of :data:`BACKENDS`; the caller checked the name)."""
    module_name, class_name = _IMPLEMENTATIONS[name].split(":")
    implementation: Type[Backend] = getattr(importlib.import_module(module_name), class_name)
    return implementation


def backend_of(marker: Mapping[str, Any]) -> Type[Backend]:
    """
    The backend that wrote the checkpoint whose marker this is: the first of :data:`BACKENDS`
    that owns it (each backend's module is imported only when the ones before it said no, so a
    fairscale-backend checkpoint never imports the torch backend's DCP). A marker no backend
    owns is a :class:`CheckpointError`.
    """
    for name in BACKENDS:
        implementation = backend_class(name)
        if implementation.owns(marker):
            return implementation
    raise CheckpointError(
        f"A checkpoint marker with backend {marker.get('backend')!r} and format {marker.get('format')!r} "
        f"was written by none of this version's backends ({', '.join(BACKENDS)}): upgrade tango-fairscale "
        "to the version that wrote it."
    )


def check_written_by(checkpoint_dir: Path, marker: Mapping[str, Any], backend: str) -> None:
    """A :class:`CheckpointError` naming the right backend when another one wrote the checkpoint."""
    if backend_class(backend).owns(marker):
        return
    written_by = backend_of(marker)
    raise CheckpointError(
        f"{checkpoint_dir} was written by the {written_by.name} backend ({written_by.format_description}), "
        f'not the {backend} backend: resume it with training_engine.backend: "{written_by.name}", or '
        "consolidate it to weights and start a new run."
    )


def files_of_worker(marker: Mapping[str, Any], rank: int) -> List[str]:
    """The files worker ``rank`` wrote into a checkpoint, as the backend that wrote it lists them."""
    return backend_of(marker).files_of_worker(marker, rank)


def holds_worker_files(checkpoint_dir: Path, marker: Mapping[str, Any], world_size: int, rank: int) -> bool:
    """
    Whether ``checkpoint_dir`` can be resumed by worker ``rank`` of a world of ``world_size``
    without resharding: saved by that many workers, with that worker's files there (a host's
    part of a checkpoint across hosts holds no more than its own workers' files).
    """
    return marker.get("world_size") == world_size and all(
        (Path(checkpoint_dir) / name).is_file() for name in files_of_worker(marker, rank)
    )


__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "Backend",
    "backend_class",
    "backend_of",
    "check_written_by",
    "files_of_worker",
    "holds_worker_files",
]
