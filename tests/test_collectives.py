"""The all-reduce based all-gather and reduce-scatter of the CPU support give what gloo's own give."""

from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tango_fairscale.compat import _GlooCollectives
from tests.helpers import free_port


def _check(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    ours = _GlooCollectives("torch.distributed")
    generator = torch.Generator().manual_seed(rank)
    # Integer values: sums are exact in any order, so results must be identical.
    shard = torch.randint(-50, 50, (5,), generator=generator).float()

    # all_gather into back-to-back chunks of one buffer (the all-reduce path) and into separate
    # tensors (gloo's own path).
    expected: List[torch.Tensor] = [torch.empty(5) for _ in range(world_size)]
    dist.all_gather(expected, shard)
    buffer = torch.full((5 * world_size,), float("nan"))
    ours.all_gather(list(buffer.chunk(world_size)), shard)
    assert torch.equal(buffer, torch.cat(expected))
    separate = [torch.empty(5) for _ in range(world_size)]
    ours.all_gather(separate, shard)
    assert all(torch.equal(a, b) for a, b in zip(separate, expected))

    # reduce_scatter from one buffer (one all-reduce), and from rows with gaps (one per row).
    full = torch.randint(-50, 50, (world_size, 8), generator=generator).float()
    want = torch.empty(8)
    dist.reduce_scatter(want, [row.clone() for row in full.unbind(0)])
    got = torch.empty(8)
    ours.reduce_scatter(got, list(full.clone().unbind(0)))
    assert torch.equal(got, want)
    padded = torch.zeros(world_size, 12)
    padded[:, :8] = full
    got_rows = torch.empty(8)
    ours.reduce_scatter(got_rows, list(padded[:, :8].unbind(0)))
    assert torch.equal(got_rows, want)
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_based_collectives_match_gloo(world_size: int) -> None:
    mp.spawn(_check, args=(world_size, free_port()), nprocs=world_size)
