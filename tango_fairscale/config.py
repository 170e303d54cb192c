"""
:class:`FSDPConfig`, the options of an FSDP unit as users write them (``fsdp_config`` of the engine
and of ``fairscale::with_wrapped_modules``), with ``wrap()`` for the users of ai2-tango's bundled
integration. The fields and their rules are :class:`~tango_fairscale.fsdp_options.FSDPOptions`'s,
which the backends read; this module sits above the backends, so that ``wrap()`` reaches the
default backend through :mod:`tango_fairscale.backends.lookup`.
"""

from dataclasses import dataclass

import torch

from .backends.lookup import DEFAULT_BACKEND, backend_class
from .fsdp_options import DTYPE_NAMES, FSDPOptions, parse_dtype


@dataclass
class FSDPConfig(FSDPOptions):
    __doc__ = FSDPOptions.__doc__

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """
        ``module`` as one FSDP unit with these options, by the default backend (FairScale's
        :class:`~fairscale.nn.FullyShardedDataParallel`, as the bundled integration's ``wrap``).
        Needs an initialised default process group. On CPU workers (no CUDA, or a gloo process
        group) it computes on the CPU.
        """
        return backend_class(DEFAULT_BACKEND).wrap_unit(self, module)


__all__ = ["DTYPE_NAMES", "FSDPConfig", "FSDPOptions", "parse_dtype"]
