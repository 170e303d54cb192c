"""
The buffers of an FSDP2 model in its checkpoints. FSDP2 shards parameters (DTensors) and leaves
buffers as plain tensors, one copy per worker, never synchronised: BatchNorm's running statistics
differ per worker, as each sees other batches. DCP saves one worker's copy of such a value; this
module makes it worker 0's (the consolidated weights' choice, as DDP's and the fairscale
backend's), and keeps each worker's own in a per-worker file of the checkpoint
(:data:`BUFFERS_STATE`), restored to that worker on resume.
"""

from typing import Any, Dict, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

#: The per-worker extra state (``worker{r}_buffers.pt``) holding that worker's own buffers.
BUFFERS_STATE = "buffers"


def _is_buffer(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


def _state_buffers(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The buffers the model's state dict holds, under DCP's names, sharing the buffers' storage."""
    return {
        name: value
        for name, value in get_model_state_dict(model).items()
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
    }


def own_buffers(model: nn.Module) -> Dict[str, torch.Tensor]:
    """This worker's buffers that its state dict holds, under DCP's names, copied to the CPU."""
    return {name: value.detach().cpu().clone() for name, value in _state_buffers(model).items()}


def restore_own_buffers(model: nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    """
    Copy a worker's saved :func:`own_buffers` into the model's buffers (the checkpoint's names and
    shapes were checked against the model's). The state dict's plain tensors share the buffers'
    storage, so copying into them writes the buffers.
    """
    held = {buffer.data_ptr() for buffer in model.buffers()}
    with torch.no_grad():
        for name, value in _state_buffers(model).items():
            if name not in saved:
                continue
            if value.numel() and value.data_ptr() not in held:
                # A torch whose state dict copies buffers: copying into it would restore nothing.
                raise RuntimeError(f"restore_own_buffers: the state dict's {name} is not the model's buffer.")
            value.copy_(saved[name])


def worker_0_buffers(model_state: Dict[str, Any]) -> Dict[str, Any]:
    """
    ``model_state`` with each buffer replaced by worker 0's value: DCP keeps one worker's copy of
    a replicated value, which was not worker 0's, so ``weights.pt`` held worker 1's statistics
    where DDP's and the fairscale backend's hold worker 0's. The model's own buffers are left as
    they are. Collective.
    """
    chosen = dict(model_state)
    for name in sorted(model_state):
        value = model_state[name]
        if _is_buffer(value):
            copy = value.detach().clone()
            dist.broadcast(copy, src=0)
            chosen[name] = copy
    return chosen
