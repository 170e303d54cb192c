"""The backends by name: which module and class implement each."""

import importlib
from typing import Dict, Type

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


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "Backend", "backend_class"]
