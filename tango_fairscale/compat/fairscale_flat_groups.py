"""
Frozen and trainable parameters in one FairScale unit: the replacement of FairScale's
``FlattenParamsWrapper`` that patch F7 (:mod:`tango_fairscale.compat`) puts into FairScale's FSDP
module. It only defines the class; ``compat`` installs it.

FairScale's FSDP flattens a unit's parameters into one ``FlatParameter``, which is trainable or
frozen as a whole, and asserts that they agree (``expects all parameters to have same
requires_grad``): a LoRA layer (a frozen base weight beside trainable adapters) or any partly
frozen block failed in every worker (llm-foundry#414 hit the same wall in PyTorch's FSDP1).
FairScale's ``FlattenParamsWrapper`` already takes several groups, one flat parameter each, and
its FSDP shards, gathers, frees and consolidates every flat parameter of a unit on its own (the
"multiple flatten groups" its comments anticipate): this wrapper only splits a mixed group into
its trainable and frozen parameters. The frozen flat parameter registers no gradient hook, gets
no ``.grad`` and so no optimizer state, and is freed after backward with the rest of the unit.
A unit whose parameters agree gets one flat parameter, ``flat_param_0``, exactly as before, so
its checkpoints are unchanged.

On CPU workers the wrapper also releases a unit's gathered parameters before autograd assembles
their flat gradient, not after (F8, :func:`release_gathered_before_flat_grad`).
"""

import weakref
from typing import Any, Iterator, List, Optional, Sequence, Union, cast

import torch
import torch.nn as nn
from fairscale.nn.misc import FlattenParamsWrapper

_ParamGroups = Optional[Union[Sequence[nn.Parameter], Sequence[Sequence[nn.Parameter]]]]


def split_by_requires_grad(param_list: _ParamGroups) -> _ParamGroups:
    """
    Each group of ``param_list`` that mixes frozen and trainable parameters split in two, the
    trainable ones first, each in its original order; groups that agree are kept as they are.
    """
    if param_list is None or len(param_list) == 0:
        return param_list
    groups = cast(
        Sequence[Sequence[nn.Parameter]],
        [param_list] if isinstance(param_list[0], nn.Parameter) else param_list,
    )
    split: List[List[nn.Parameter]] = []
    for group in groups:
        trainable = [p for p in group if p.requires_grad]
        frozen = [p for p in group if not p.requires_grad]
        if trainable and frozen:
            split += [trainable, frozen]
        else:
            split.append(list(group))
    return split


class FlattenTrainableApart(FlattenParamsWrapper):
    """FairScale's ``FlattenParamsWrapper``, frozen and trainable parameters in separate flat parameters."""

    def __init__(
        self, module: nn.Module, param_list: _ParamGroups = None, flat_param_names: Optional[Any] = None
    ) -> None:
        # Names given by the caller name its groups one for one: splitting would break that.
        if flat_param_names is None:
            # None is FairScale's "every parameter of the module", which may mix them too.
            groups = list(module.parameters()) if param_list is None else param_list
            param_list = split_by_requires_grad(groups)
        super().__init__(module, param_list=param_list, flat_param_names=flat_param_names)
        #: The FSDP unit this wrapper is the module of, where it releases the unit's gathered
        #: parameters early (F8): set by :func:`release_early_in` (CPU workers); weak, as the
        #: unit holds this wrapper.
        self._early_release_unit: Optional[weakref.ref[Any]] = None

    def forward(self, *inputs: Any, **kwinputs: Any) -> Any:
        output = super().forward(*inputs, **kwinputs)
        unit = self._early_release_unit() if self._early_release_unit is not None else None
        if unit is not None and torch.is_grad_enabled():
            release_gathered_before_flat_grad(unit, self)
        return output


# F8 upstream: none found
def release_early_in(unit: Any) -> None:
    """
    Have ``unit`` (a FairScale FSDP unit) release its gathered parameters before their flat
    gradient is assembled (:func:`release_gathered_before_flat_grad`); nothing for a unit whose
    parameters are not flattened by :class:`FlattenTrainableApart`.
    """
    wrapper = getattr(unit, "_fsdp_wrapped_module", None)
    if isinstance(wrapper, FlattenTrainableApart):
        wrapper._early_release_unit = weakref.ref(unit)


#: The attribute on a flat parameter: how many of its forwards' view gradients are still to come.
_PENDING = "_tango_fairscale_pending_views"


def release_gathered_before_flat_grad(unit: Any, wrapper: FlattenTrainableApart) -> None:
    """
    After a forward of ``unit`` (F8): its gathered (full) flat parameters are released as soon as
    autograd has every gradient of their views, before it concatenates them into the flat
    parameter's gradient.

    Why: FairScale frees a gathered parameter in its post-backward hook, on the flat parameter's
    gradient accumulator, which runs after autograd's backward of ``split_with_sizes`` (the
    wrapper's views) has allocated the flat gradient. So a unit's backward held three copies of
    its size at once: the gathered parameter, its views' gradients and the flat gradient. By the
    time that backward node runs, every operation that read the views has run (each gave it a
    gradient), so nothing reads the gathered parameter again in this backward; a pre-hook on the
    node frees it there, as FairScale's hook would, and the flat gradient reuses the memory.
    Measured on a residual MLP of width 1024 (a 32 MiB flat parameter) with 2 CPU workers: a
    unit's backward rose 96 MiB above what it started from, the torch backend's 32 MiB (above its
    64 MiB of buffers shared by the units); see ``docs/capacity.md``.

    A flat parameter whose views several forwards made (a unit called twice) is released when the
    last of their nodes runs: a count per parameter, cleared at the end of backward
    (:func:`release_all_frozen`). FairScale's conditions hold: nothing is released under
    ``no_sync`` without ``reshard_after_forward``, nor where the parameter is not sharded. What
    releasing changes is when memory is freed, never a value: FairScale's own hook then finds
    it freed (freeing is idempotent), and a later backward of the unit gathers it again first.
    """
    views = getattr(wrapper._fpw_module, "_unflattened_param_views", None) or []
    trainable = {id(p) for p in unit.params if p.requires_grad}
    seen = set()
    for view in views:
        node = view.grad_fn
        if node is None or not node.next_functions:
            continue
        split = node.next_functions[0][0]
        if split is None or not type(split).__name__.startswith("SplitWithSizesBackward"):
            continue
        accumulate = split.next_functions[0][0] if split.next_functions else None
        flat = getattr(accumulate, "variable", None)
        if flat is None or id(flat) not in trainable or id(flat) in seen:
            continue
        seen.add(id(flat))
        setattr(flat, _PENDING, getattr(flat, _PENDING, 0) + 1)
        split.register_prehook(_release_when_last(unit, flat))


def _release_when_last(unit: Any, flat: nn.Parameter) -> Any:
    def prehook(grad_outputs: Any) -> None:
        pending = max(0, getattr(flat, _PENDING, 0) - 1)
        setattr(flat, _PENDING, pending)
        sharded = getattr(flat, "_is_sharded", False)
        if pending == 0 and sharded and (unit._require_backward_grad_sync or unit.reshard_after_forward):
            unit._free_full_params([flat])

    return prehook


#: The attribute on a unit: the handles of the hooks that release its frozen parameters in this
#: backward (:func:`release_frozen_after_backward`), removed at its end.
_RELEASE_HOOKS = "_tango_fairscale_frozen_release_hooks"


def _frozen(unit: Any) -> List[nn.Parameter]:
    return [p for p in unit.params if not p.requires_grad]


def release_frozen(unit: Any) -> None:
    """
    What FairScale's post-backward hook does for a trainable parameter of ``unit`` (free the
    gathered full parameter unless it is kept for ``no_sync``, free the low-precision shard,
    point the parameter at its FP32 shard), done for its frozen ones. FairScale registers that
    hook on gradient accumulators, which a frozen parameter does not have: its gathered copy
    stayed allocated until the end of backward (nested units) or for good (the root unit, whose
    ``local_state_dict`` then saved the whole parameter as the worker's shard). Idempotent.
    """
    frozen = _frozen(unit)
    if not frozen:
        return
    if unit._require_backward_grad_sync or unit.reshard_after_forward:
        unit._free_full_params(frozen)
    if unit.mixed_precision:
        unit._free_fp16_param_shard(frozen)
    unit._use_fp32_param_shard(frozen)


def release_frozen_after_backward(unit: Any, args: Any, kwargs: Any) -> None:
    """
    After ``unit``'s forward: once every gradient with respect to its inputs has been computed in
    backward, nothing of the unit's backward is left to use its frozen parameters, so they are
    released then (:func:`release_frozen`), one unit at a time as FairScale does for trainable
    ones, instead of all at the end of backward. PyTorch's FSDP resharded its frozen flat
    parameters the same way (a multi-grad hook on the unit's inputs). A unit whose inputs need no
    gradient (the first one) is released at the end of backward (:func:`release_all_frozen`).

    The hook is removed at the end of backward (:func:`release_all_frozen`): torch's multi-grad
    hook holds the inputs' autograd nodes, which hold the hook, so a hook left registered kept its
    step's graph (the nodes of every earlier unit) alive until Python's cyclic collector ran a full
    collection, which a training loop, making few Python objects, seldom starts. Measured on a
    LoRA Llama of width 768 with 2 CPU workers: the heap in use grew 0.05 MiB per unit and step,
    and the step's buffers, placed past that garbage, grew the heap (VmData) 12.5 MiB a step with
    8 units and 20 to 60 MiB with 16; with the hooks removed it stops growing after step 2.
    """
    if not torch.is_grad_enabled() or not _frozen(unit):
        return
    inputs = [t for t in _tensors((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    if inputs:
        handle = torch.autograd.graph.register_multi_grad_hook(inputs, lambda grads: release_frozen(unit))
        unit.__dict__.setdefault(_RELEASE_HOOKS, []).append(handle)


def release_all_frozen(root: Any) -> None:
    """
    At the end of backward (on the root unit): every unit's frozen parameters released, and the
    count of view gradients to come (F8) cleared, of forwards whose graph no backward ran through.
    The hooks :func:`release_frozen_after_backward` registered are removed (they have run, or
    their forward's graph had no backward), so that nothing holds their graphs.
    """
    for module in root.modules():
        if hasattr(module, "params") and hasattr(module, "_use_fp32_param_shard"):
            release_frozen(module)
            for param in module.params:
                if hasattr(param, _PENDING):
                    setattr(param, _PENDING, 0)
            for handle in module.__dict__.pop(_RELEASE_HOOKS, ()):
                handle.remove()


def _tensors(value: Any) -> Iterator[Any]:
    """The tensors in nested tuples, lists and dicts (a unit's positional and keyword inputs)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    else:
        yield value
