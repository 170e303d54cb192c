"""
FairScale's reduce-scatter bucket: no larger than the gradients it will hold
(:func:`sufficient_bucket_cap_mb`, applied by the backend's ``build``), and filled without a
stacked copy of each gradient (F9): the replacement of ``ReduceScatterBucketer.reduce_scatter_async``
that :mod:`tango_fairscale.compat` installs on CPU workers. It only defines it; ``compat`` installs it.

FairScale allocates its bucket whole, ``bucket_cap_mb`` (25 MiB by default) and an output of
``bucket_cap_mb / workers``, in every backward that puts a gradient in it, and a gradient shard
taken from the bucket keeps the whole output alive until the gradients are cleared. Where the
gradients that go into the bucket add up to less (a LoRA model's adapters: KiBs; a full
fine-tune's root unit of embeddings and norms, whose gradient fits the bucket while the blocks'
do not), the rest of the 37.5 MiB (at 2 workers) is allocated, zeroed and never used. A bucket of
their size reduces the same gradients in the same collectives: every gradient that fits the
configured bucket fits the smaller one, and all of them fit at once, as they did.

FairScale puts a gradient whose shard fits its bucket (``bucket_cap_mb`` / workers: 12.5 MiB at 2
workers, so a Llama block of width 768, 24 MiB) into the bucket by stacking the gradient's
per-worker chunks first (``torch.stack``: a copy of the whole gradient) and copying the stack
into the bucket's columns. The stack was a unit's size more in every such unit's backward, beside
the gradient itself and the bucket: measured on a Llama of width 768 with 2 CPU workers, the
failure at 18 blocks was ``can't allocate 24 MiB`` there. Each chunk is copied into its row of
the bucket directly instead: the same bytes in the same places, one copy fewer.
"""

import functools
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

#: FairScale's unit of ``bucket_cap_mb``.
_MIB = 1 << 20


def sufficient_bucket_cap_mb(configured: int, gradients: Iterable[Tuple[int, int, int]]) -> int:
    """
    The smallest ``bucket_cap_mb`` that reduces ``gradients`` as ``configured`` does: each gradient
    is ``(numel, element_size, workers)``, its unsharded size, the bytes of its elements as it is
    reduced and the size of the group it is reduce-scattered over. FairScale buckets a gradient
    whose per-worker chunk (``numel / workers``, padded) fits ``bucket_cap_mb / workers``, one
    bucket per dtype and group, flushed when the next does not fit: the smallest cap that holds
    every gradient the configured one would take, all at once, is the sum of their bytes in the
    fullest bucket, in whole MiB (at least 1). ``0`` (no bucketing) stays ``0``, and a configured
    cap that their sum reaches stays as it is.
    """
    if configured <= 0:
        return configured
    totals: Dict[Tuple[int, int], int] = {}
    for numel, element_size, workers in gradients:
        chunk = math.ceil(numel / workers)
        if chunk <= int(configured * _MIB / element_size // workers):  # FairScale's test
            key = (element_size, workers)
            totals[key] = totals.get(key, 0) + chunk * workers * element_size
    needed = max(totals.values(), default=0)
    return min(configured, max(1, math.ceil(needed / _MIB)))


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
