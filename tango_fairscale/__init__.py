"""
tango-fairscale: FairScale's Fully Sharded Data Parallel (ZeRO-3) for AI2 Tango's
``torch::train`` step, on GPUs and on CPU workers.

Importing this package registers:

- :class:`FairScaleTrainingEngine` as the training engine ``"fairscale"``;
- :func:`with_wrapped_modules` as the model constructor ``"fairscale::with_wrapped_modules"``.

Use it with ``tango run config.jsonnet -i tango_fairscale``, or list ``tango_fairscale``
under ``include_package`` in ``tango.yml``.
"""

from . import checkpointing
from .callbacks import MemoryCallback
from .config import FSDPConfig
from .engine import FairScaleTrainingEngine
from .errors import CheckpointError
from .preflight import install as _install_preflight
from .version import VERSION as __version__
from .wrapping import plan_wrapping, with_wrapped_modules

_install_preflight()

__all__ = [
    "CheckpointError",
    "FSDPConfig",
    "FairScaleTrainingEngine",
    "MemoryCallback",
    "__version__",
    "checkpointing",
    "plan_wrapping",
    "with_wrapped_modules",
]
