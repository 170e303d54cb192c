"""
Building a model without ever holding all of it: parameters are created on the ``meta``
device (shapes only, no memory) and each FSDP unit's parameters are allocated and set on the
worker just before it is sharded, so a worker's peak is its shards plus one unit, not the whole
model. The values are those of an eager build of the same constructor from the same seed, bit
for bit, or the run is refused naming the parameters whose values cannot be known.

- :func:`parameters_on_meta` is the construction context: every parameter registered while it
  is active is moved to ``meta`` (patch P1). Buffers stay real, because many are computed in
  ``__init__`` (causal masks, position tables) and could not be recomputed later.
- :func:`materialize_module` allocates a module's ``meta`` parameters (outside already-built
  FSDP units) and gives each its value. :func:`check_initialisable` raises, before any worker
  starts, what materialising would raise (pre-flight and ``plan``).

What a parameter's value is, in this order:

1. **Pretrained** (:func:`mark_pretrained`: ``fairscale::from_pretrained``, or ``transformers``'
   ``from_pretrained`` routed by patch H2): its tensor in the files, then whatever in-place ops
   the constructor applied to it afterwards (replayed as below).
2. **Recorded**: while the model is built, a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
   records every in-place op applied to a ``meta`` parameter after its registration (``zero_``,
   ``fill_``, ``copy_``, ``uniform_``/``normal_`` of ``reset_parameters()``, ``kaiming_*``,
   ``xavier_*``, ``_init_weights``, writes through views and indexing, ...): deterministic ones with
   their operands (a real operand is copied), random ones with the state of the generator they
   draw from. The build draws the same random numbers as an eager build: each random op on a
   parameter runs once more on a scratch tensor of its shape on the parameter's device (views of
   one buffer, reused op after op: :meth:`.recording._Recorder.scratch`). ``torch.nn.init``'s
   ``trunc_normal_``, ``orthogonal_``, ``dirac_`` and ``sparse_``, which return at once on
   ``meta``, are recorded and run that way whole (P1). Tensors a constructor derives from a
   parameter without reading its values (``new_empty``, ``zeros_like``, ...) are computed for
   real, as eagerly. At materialisation the ops from the last one that sets every element are
   replayed on the allocated parameter, random ones from their recorded generator state (restored
   after): the parameter holds the eager value, and the generator is left where the eager build
   left it. The ops are replayed on the device the eager build had the parameter on (the CPU; on
   GPU workers the value is then copied to the GPU). A parameter no op touched after its
   registration keeps the value its constructor created it with (``nn.Parameter(torch.ones(n))``,
   kept by reference until then).
3. **Initialised**: a parameter created uninitialised (``torch.empty``) that nothing set is
   initialised as before this recording existed: its module's ``reset_parameters()`` (or
   ``_reset_parameters()``), then a Hugging Face model's ``_init_weights`` (an eager build leaves
   such a parameter as whatever the memory held); the recorded ops, if any, are replayed after.
   Parameters no initialiser sets are refused, listed together.
4. **Refused**: a value computed on ``meta`` from other parameters' values (``p.data.copy_(q * 2)``,
   a norm of a pretrained weight as peft's DoRA computes), a parameter created on ``meta`` by the
   constructor (``nn.Linear(..., device=other.weight.device)``), or data replaced by such a tensor:
   :class:`ConfigurationError` naming each parameter and why. So is every random op after one
   that could not be run on a scratch tensor (the generator may no longer be in step).

The cost. Time: the build runs every random initialiser once, as an eager build does, and
materialising runs each parameter's ops from its last full overwrite again. Memory, between the
build and the unit's materialisation: a recorded op's operands (scalars; a copied real tensor
for ``copy_`` from one, whose memory an eager build holds as well), 5 KiB of CPU generator state
per random op still needed (earlier ops a later full overwrite made irrelevant are dropped), and
the value a constructor created a parameter with until an op overwrites it whole
(``torch.empty`` results are not kept). A model built from scratch never has more than one op's
scratch tensors real at a time; ``torch``'s own modules and ``transformers``' models create their
weights with ``torch.empty`` and overwrite them in their constructors.

Builds inside :func:`not_recorded` record nothing and draw nothing: :mod:`.pretrained` builds the
model transformers' ``from_pretrained`` would build there, whose parameters all come from the
files; ``from_pretrained`` itself draws no random numbers (transformers 4.57, tested), so neither
does that build. :func:`parameters_on_meta` with ``record=False`` keeps the earlier behaviour
(initialisers, a bare parameter's constructed value), for builds whose values are loaded anyway.
"""

from .allocation import check_initialisable, materialize_module
from .building import (
    building_on_meta,
    has_meta_parameters,
    mark_pretrained,
    not_recorded,
    parameters_on_meta,
    pretrained_origin,
    real_parameters,
)
from .tracks import _TRACK as _TRACK  # the attribute a built parameter's track is kept in, for tests

__all__ = [
    "building_on_meta",
    "check_initialisable",
    "has_meta_parameters",
    "mark_pretrained",
    "materialize_module",
    "not_recorded",
    "parameters_on_meta",
    "pretrained_origin",
    "real_parameters",
]
