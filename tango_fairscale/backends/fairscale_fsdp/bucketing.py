"""
FairScale's reduce-scatter bucket no larger than the gradients it will hold
(:func:`sufficient_bucket_cap_mb`, applied by the backend's ``build`` and counted by its memory
model). How the bucket is filled on CPU workers is patch F9
(:mod:`tango_fairscale.compat.fairscale_bucket`).

FairScale allocates its bucket whole, ``bucket_cap_mb`` (25 MiB by default) and an output of
``bucket_cap_mb / workers``, in every backward that puts a gradient in it, and a gradient shard
taken from the bucket keeps the whole output alive until the gradients are cleared. Where the
gradients that go into the bucket add up to less (a LoRA model's adapters: KiBs; a full
fine-tune's root unit of embeddings and norms, whose gradient fits the bucket while the blocks'
do not), the rest of the 37.5 MiB (at 2 workers) is allocated, zeroed and never used. A bucket of
their size reduces the same gradients in the same collectives: every gradient that fits the
configured bucket fits the smaller one, and all of them fit at once, as they did.
"""

import math
from typing import Dict, Iterable, Tuple

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
