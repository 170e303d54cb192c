"""
Registration under the names of ai2-tango's bundled ``tango.integrations.fairscale``.

That integration registers ``"fairscale"`` and ``"fairscale::with_wrapped_modules"`` without
``exist_ok``, so whichever of the two packages registers second would normally fail, and
Tango's registry search (which imports every bundled integration when a config names an
unknown type) would turn any typo in a config into that clash. We therefore import the bundled
integration first, if it imports at all, and then register over its entries with
``exist_ok=True``: from then on both import orders are harmless and the names resolve to ours.
"""

import logging
from typing import Callable, TypeVar

from tango.integrations.torch import Model, TrainingEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _import_bundled_integration() -> None:
    try:
        import tango.integrations.fairscale  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any failure just means there is nothing to override
        logger.debug("tango.integrations.fairscale is not importable (%s); nothing to override", error)


_import_bundled_integration()


def register_training_engine(name: str) -> Callable[[T], T]:
    """``TrainingEngine.register(name)``, taking the name over from the bundled integration."""
    return TrainingEngine.register(name, exist_ok=True)  # type: ignore[return-value]


def register_model_constructor(name: str) -> Callable[[T], T]:
    """``Model.register(name)`` for a constructor function, taking the name over likewise."""
    return Model.register(name, exist_ok=True)  # type: ignore[return-value]
