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
"""

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
    """
    if not torch.is_grad_enabled() or not _frozen(unit):
        return
    inputs = [t for t in _tensors((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    if inputs:
        torch.autograd.graph.register_multi_grad_hook(inputs, lambda grads: release_frozen(unit))


def release_all_frozen(root: Any) -> None:
    """At the end of backward (on the root unit): every unit's frozen parameters released."""
    for module in root.modules():
        if hasattr(module, "params") and hasattr(module, "_use_fp32_param_shard"):
            release_frozen(module)


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
