"""
What a step's batch holds: its samples and, for a sequence model's batches, its tokens
(:func:`count_tokens` for one micro-batch, :func:`count_batch` for a step's micro-batches).
"""

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

__all__ = ["BatchCount", "TokenCount", "batch_size", "count_batch", "count_tokens", "describe_tokens"]


@dataclass(frozen=True)
class TokenCount:
    """The tokens of a micro-batch (or of a step's micro-batches)."""

    tokens: int
    """Tokens that count for tokens/s: non-padding ones where there is an attention mask."""

    positions: int
    """Sequence positions the model computes on, padding included (what its FLOPs scale with)."""

    source: str
    """``"attention_mask"`` or ``"input_ids"``."""


def count_tokens(micro_batch: Any) -> Optional[TokenCount]:
    """
    The tokens of a collated micro-batch of a sequence model: a dict with an ``attention_mask``
    (tokens: its non-zero entries; positions: its size) or ``input_ids`` (every entry is a token),
    of two or more dimensions (batch, sequence, ...). None for anything else: its throughput is
    reported in samples/s only.
    """
    if not isinstance(micro_batch, Mapping):
        return None
    mask = micro_batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() >= 2:
        return TokenCount(int(torch.count_nonzero(mask).item()), mask.numel(), "attention_mask")
    ids = micro_batch.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        return TokenCount(ids.numel(), ids.numel(), "input_ids")
    return None


def batch_size(micro_batch: Any) -> int:
    """The number of samples in a collated micro-batch: the first dimension of its first tensor."""
    if isinstance(micro_batch, torch.Tensor):
        return micro_batch.size(0) if micro_batch.dim() else 1
    if isinstance(micro_batch, Mapping):
        values: Iterable[Any] = micro_batch.values()
    elif isinstance(micro_batch, (list, tuple)):
        values = micro_batch
    else:
        return 0
    for value in values:
        size = batch_size(value)
        if size:
            return size
    return 0


@dataclass(frozen=True)
class BatchCount:
    """A step's batch: what one worker processes in one optimizer step."""

    samples: int
    """Samples of its micro-batches."""

    tokens: Optional[TokenCount]
    """Their tokens, where every micro-batch has them; else None."""


def count_batch(batch: Sequence[Any]) -> BatchCount:
    """The samples and tokens of a step's micro-batches (Tango's ``batch``, one per ``grad_accum``)."""
    counts = [count_tokens(micro_batch) for micro_batch in batch]
    known = [count for count in counts if count is not None]
    tokens = None
    if known and len(known) == len(counts):
        tokens = TokenCount(sum(c.tokens for c in known), sum(c.positions for c in known), known[0].source)
    return BatchCount(sum(batch_size(micro_batch) for micro_batch in batch), tokens)


def describe_tokens(source: Optional[str]) -> str:
    """What counts as a token, for the metrics log's run line (``source``: :attr:`TokenCount.source`)."""
    if source == "attention_mask":
        return "attention_mask: its non-zero entries"
    if source == "input_ids":
        return "input_ids: every entry"
    return "none: the batches have no input_ids or attention_mask, so throughput is samples/s only"
