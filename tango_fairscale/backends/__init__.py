"""
The sharding backends, one :class:`~tango_fairscale.backends.base.Backend` each, chosen by the
engine's ``backend`` option:

- ``"fairscale"`` (:mod:`.fairscale_fsdp`): FairScale's FSDP, flat per-unit shards; the default.
- ``"torch"`` (:mod:`.torch_fsdp2`): PyTorch's own FSDP2 (:func:`torch.distributed.fsdp.fully_shard`),
  checkpoints through ``torch.distributed.checkpoint``; see ``docs/torch-backend.md``.

:func:`.lookup.backend_class` imports a backend's module only when it is asked for: the torch backend
pulls in FSDP2 and DCP (about a second per process), which a fairscale run does without.
The folders are not called ``fairscale`` and ``torch``: Tango's ``include_package`` walks the
package with ``pkgutil.walk_packages``, which imports each subpackage by its bare name, and would
import (and walk) the real ``torch`` and ``fairscale`` instead.

Nothing is imported here, so that :mod:`tango_fairscale.compat` can install the fairscale
backend's CPU stand-ins without the backends' dependencies.
"""
