"""The ring all-gather and reduce-scatter of the CPU support give what gloo's own give."""

from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tango_fairscale.cpu.collectives import GlooCollectives
from tests.helpers import free_port


def _gloo_reduce_scatter(full: torch.Tensor) -> torch.Tensor:
    want = torch.empty(full.shape[1])
    dist.reduce_scatter(want, [row.clone() for row in full.unbind(0)])
    return want


def _check(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    ours = GlooCollectives("torch.distributed")
    generator = torch.Generator().manual_seed(rank)

    # all_gather copies, so any floats must come back bit for bit: into back-to-back chunks of
    # one buffer (FairScale's layout), into separate tensors, and from a shard already in place.
    shard = torch.randn(5, generator=generator)
    expected: List[torch.Tensor] = [torch.empty(5) for _ in range(world_size)]
    dist.all_gather(expected, shard)
    buffer = torch.full((5 * world_size,), float("nan"))
    ours.all_gather(list(buffer.chunk(world_size)), shard)
    assert torch.equal(buffer, torch.cat(expected))
    separate = [torch.full((5,), float("nan")) for _ in range(world_size)]
    ours.all_gather(separate, shard)
    assert all(torch.equal(a, b) for a, b in zip(separate, expected))
    in_place = torch.full((5 * world_size,), float("nan"))
    chunks = list(in_place.chunk(world_size))
    chunks[rank].copy_(shard)
    ours.all_gather(chunks, chunks[rank])
    assert torch.equal(in_place, torch.cat(expected))

    # reduce_scatter of integer values (exact in any order) from one buffer, from rows with gaps
    # between them, and into an output that aliases an input (gloo's own path).
    full = torch.randint(-50, 50, (world_size, 8), generator=generator).float()
    want = _gloo_reduce_scatter(full)
    got = torch.full((8,), float("nan"))
    ours.reduce_scatter(got, list(full.clone().unbind(0)))
    assert torch.equal(got, want)
    padded = torch.zeros(world_size, 12)
    padded[:, :8] = full
    got_rows = torch.full((8,), float("nan"))
    ours.reduce_scatter(got_rows, list(padded[:, :8].unbind(0)))
    assert torch.equal(got_rows, want)
    aliased = list(full.clone().unbind(0))
    ours.reduce_scatter(aliased[rank], aliased)
    assert torch.equal(aliased[rank], want)

    if world_size == 2:
        # Two addends commute exactly, so random floats reduce to gloo's values (and DDP's)
        # bit for bit.
        floats = torch.randn(2, 1000, generator=generator)
        got_floats = torch.empty(1000)
        ours.reduce_scatter(got_floats, list(floats.clone().unbind(0)))
        assert torch.equal(got_floats, _gloo_reduce_scatter(floats))
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_collectives_match_gloo(world_size: int) -> None:
    mp.spawn(_check, args=(world_size, free_port()), nprocs=world_size)
