"""
F9: FairScale's reduce-scatter bucket filled without a stacked copy of each gradient, the
replacement of ``ReduceScatterBucketer.reduce_scatter_async`` that
:mod:`tango_fairscale.compat.fairscale_patches` installs on CPU workers.

FairScale puts a gradient whose shard fits its bucket (``bucket_cap_mb`` / workers: 12.5 MiB at 2
workers, so a Llama block of width 768, 24 MiB) into the bucket by stacking the gradient's
per-worker chunks first (``torch.stack``: a copy of the whole gradient) and copying the stack
into the bucket's columns. The stack was a unit's size more in every such unit's backward, beside
the gradient itself and the bucket: measured on a Llama of width 768 with 2 CPU workers, the
failure at 18 blocks was ``can't allocate 24 MiB`` there. Each chunk is copied into its row of
the bucket directly instead: the same bytes in the same places, one copy fewer.
"""

import functools
from typing import Any, Callable, List, Optional

import torch


@torch.no_grad()
def reduce_scatter_async(
    original: Callable[..., None],
    bucketer: Any,
    input_list: List[torch.Tensor],
    group: Any,
    callback_fn: Optional[Callable[..., Any]] = None,
) -> None:
    """
    ``ReduceScatterBucketer.reduce_scatter_async`` (FairScale 0.4.13) without the stack: a
    gradient too large for the bucket goes to FairScale's ``original`` as before (it is reduced at
    once); one that fits is copied chunk by chunk into the bucket's rows, one row per worker, at
    the bucket's offset, which is what FairScale's copy of the stacked chunks wrote.
    """
    world_size = group.size()
    first = input_list[0]
    size = first.numel()
    if len(input_list) != world_size or size > bucketer._get_shard_size(first.element_size(), world_size):
        # FairScale's own checks and its direct path for gradients larger than the bucket's shard.
        return original(bucketer, input_list, group, callback_fn)
    bucket = bucketer._get_bucket(first, group)
    if size > bucket.data.size(1) - bucket.offset:
        bucket.flush()
    offset = bucket.offset
    for row, chunk in zip(bucket.data, input_list):
        row[offset : offset + size].copy_(chunk.reshape(-1))
    bucket.offset += size
    if callback_fn is not None:
        result = bucket.output_shard[offset : offset + size].view_as(first)
        bucket.callbacks.append(functools.partial(callback_fn, result))
    return None
