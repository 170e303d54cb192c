"""The ring all-gather and reduce-scatter of the CPU support give what gloo's own give."""

import copy
from pathlib import Path
from typing import Any, List, Tuple

import pytest
import torch
import torch.distributed as dist

from tango_fairscale.backends.torch_fsdp2.collectives import (
    RingAllGather,
    RingReduceScatter,
    UnitBuffer,
    param_groups,
)
from tango_fairscale.cpu.collectives import GlooCollectives
from tango_fairscale.launch.teardown import close_process_groups
from tests import harness
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
    close_process_groups()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_collectives_match_gloo(world_size: int) -> None:
    harness.spawn(_check, args=(world_size, free_port()), nprocs=world_size)


def _check_fsdp2(rank: int, world_size: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tango_fairscale.backends.torch_fsdp2.collectives import RingAllGather, RingReduceScatter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(rank)
    gather, scatter = RingAllGather(), RingReduceScatter()

    # FSDP2's layout: one flat output, this worker's shard as the input.
    shard = torch.randn(7, generator=generator)
    want = torch.empty(7 * world_size)
    dist.all_gather_into_tensor(want, shard)
    got = gather.allocate((7 * world_size,), dtype=torch.float32, device=torch.device("cpu"))
    assert gather(got, shard, group, async_op=True) is None  # done when it returns
    assert torch.equal(got, want)

    # Integer values, exact in any order; the average as gloo's (a sum, divided).
    full = torch.randint(-50, 50, (6 * world_size,), generator=generator).float()
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        expected = torch.empty(6)
        dist.reduce_scatter_tensor(expected, full.clone(), op=op)
        out = torch.full((6,), float("nan"))
        scatter(out, full.clone(), group, op=op)
        assert torch.equal(out, expected), (op, out, expected)

    # Installed on every unit of a model sharded by the torch backend on a CPU mesh.
    from tango_fairscale import FSDPConfig, WrapPlan
    from tango_fairscale.backends.torch_fsdp2.sharding import shard_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    shard_model(model, WrapPlan.build(model, ["0"]), FSDPConfig(), mesh)
    units = [m for m in model.modules() if hasattr(m, "set_custom_all_gather")]
    assert len(units) == 2
    for unit in units:
        (param_group,) = param_groups(unit)
        assert isinstance(param_group._all_gather_comm, RingAllGather)
        assert isinstance(param_group._reduce_scatter_comm, RingReduceScatter)
    close_process_groups()


class _Recording(RingReduceScatter):
    """The ring reduce-scatter, recording each input's address and what is left of its memory."""

    def __init__(self, inputs: UnitBuffer, record: List[Tuple[int, int]], *, ends_backward: bool) -> None:
        super().__init__(inputs, ends_backward=ends_backward)
        self.record = record

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        address = input_tensor.untyped_storage().data_ptr()
        result = super().__call__(output_tensor, input_tensor, *args, **kwargs)
        self.record.append((address, input_tensor.untyped_storage().nbytes()))
        return result


def _check_fsdp2_buffers(rank: int, world_size: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tango_fairscale import FSDPConfig, WrapPlan
    from tango_fairscale.backends.torch_fsdp2.sharding import shard_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)]
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), *blocks, torch.nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world_size,))
    shard_model(model, WrapPlan.build(model, ["1", "2", "3", "4"]), FSDPConfig(), mesh)
    units = [m for m in model.modules() if hasattr(m, "set_custom_all_gather")]
    assert units[0] is model  # the root, then the blocks
    gathers, scatters, record = UnitBuffer(), UnitBuffer(), []
    for unit in units:
        unit.set_custom_all_gather(RingAllGather(gathers))
        unit.set_custom_reduce_scatter(_Recording(scatters, record, ends_backward=unit is model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 1:
            # A validation forward, as Tango's loop runs it (under inference_mode): the buffers it
            # allocates (the root's, then the blocks') are written by the training steps after it.
            with torch.inference_mode():
                model(torch.randn(2, 3, generator=generator))
        inputs = torch.randn(4 * world_size, 3, generator=generator)
        model(inputs.chunk(world_size)[rank]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        # The same step on one worker: the mean over all workers' samples of the mean per worker.
        reference(inputs).square().view(world_size, -1).mean(dim=1).mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        # Per step: the root's all-gather, then the blocks' (one size, one buffer): two buffers,
        # where a fresh one per all-gather would be 1 + 4 in forward and 4 in backward. (The
        # validation forward gathers the root and the blocks; the root, which does not reshard
        # after forward, stays gathered for step 1, whose blocks reuse the validation's buffer.)
        assert gathers.allocations == 2 * (step + 1), gathers.allocations
        # The blocks' reduce-scatter inputs: one buffer per step, let go after the root's.
        assert scatters.allocations == step + 1, scatters.allocations
        assert scatters.nbytes == 0, scatters.nbytes
    # Per step, the blocks reduce (backward runs from the last block) into one buffer, kept; then
    # the root, last, into an input of its own, freed when its ring returned.
    assert len(record) == 3 * len(units), record
    for step in range(3):
        blocks_, root = record[step * 5 : step * 5 + 4], record[step * 5 + 4]
        assert len({address for address, _ in blocks_}) == 1, blocks_
        assert all(size > 0 for _, size in blocks_), blocks_
        assert root[1] == 0 and root[0] != blocks_[0][0], (root, blocks_)
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p, rtol=0, atol=1e-6)
    close_process_groups()


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_units_share_their_gather_and_reduce_scatter_buffers(world_size: int) -> None:
    harness.spawn(_check_fsdp2_buffers, args=(world_size, free_port()), nprocs=world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_ring_collectives_match_gloo(world_size: int) -> None:
    harness.spawn(_check_fsdp2, args=(world_size, free_port()), nprocs=world_size)


def test_a_reduce_scatter_output_in_the_shared_input_buffer_is_refused() -> None:
    # FSDP2 asks for a reduce-scatter's input, then its output: the first allocation is the
    # shared buffer. Asked the other way round, the output would be overwritten by the next unit.
    inputs = UnitBuffer()
    scatter = RingReduceScatter(inputs)
    first = scatter.allocate((8,), dtype=torch.float32, device=torch.device("cpu"))
    second = scatter.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
    assert inputs.holds(first) and not inputs.holds(second)
    with pytest.raises(RuntimeError, match="asked for a reduce-scatter's output before its input"):
        scatter(output_tensor=first[:4], input_tensor=second, group=None)  # type: ignore[arg-type]
    # The call put the allocations back in step: the next one is an input again.
    assert inputs.holds(scatter.allocate((8,), dtype=torch.float32, device=torch.device("cpu")))
    # An allocation that fails leaves them in step: a failed input is asked for again as an
    # input, a failed output is followed by an input.
    fresh = RingReduceScatter(UnitBuffer())
    with pytest.raises(RuntimeError):
        fresh.allocate((-1,), dtype=torch.float32, device=torch.device("cpu"))
    assert fresh.inputs is not None and fresh.inputs.holds(
        fresh.allocate((8,), dtype=torch.float32, device=torch.device("cpu"))
    )
    with pytest.raises(RuntimeError):
        fresh.allocate((-1,), dtype=torch.float32, device=torch.device("cpu"))
    assert fresh.inputs.holds(fresh.allocate((8,), dtype=torch.float32, device=torch.device("cpu")))
    # The root's input is its own.
    root = RingReduceScatter(inputs, ends_backward=True)
    assert not inputs.holds(root.allocate((8,), dtype=torch.float32, device=torch.device("cpu")))


def _check_ring_timeout(rank: int, port: int, done: str) -> None:
    import datetime
    import time
    from pathlib import Path

    from tango_fairscale.cpu.collectives import CollectiveTimeoutError

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=2),
    )
    if rank == 0:
        # Worker 1 never joins this all-gather (workers that disagree on their collectives).
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as error:
            GlooCollectives("torch.distributed").all_gather([torch.empty(4), torch.empty(4)], torch.ones(4))
        elapsed = time.monotonic() - started
        Path(done).write_text(f"{elapsed}")
        message = str(error.value)
        assert message.startswith("worker 0 waited 2 s (collective_timeout) to "), message
        assert "worker 1" in message and "\n" not in message, message
        assert elapsed < 10, elapsed
    else:
        deadline = time.monotonic() + 30
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Path(done).exists()


def test_a_ring_whose_peer_never_joins_ends_within_the_timeout(tmp_path: Path) -> None:
    # It waited forever: gloo applies the group's timeout to collectives, not to send/recv waits.
    harness.spawn(_check_ring_timeout, args=(free_port(), str(tmp_path / "done")), nprocs=2)


def _skips_a_block_on_worker_1(backend: str, collective_timeout: int) -> Any:
    """The toy regressor, each block a unit, whose forward skips its second block on worker 1 only."""
    from tests.helpers import train_config

    config = train_config(
        engine="fairscale",
        wrap="nested",
        model={"type": "test::skips_a_block_on_worker_1"},
        callbacks=[],
        engine_extra={"collective_timeout": collective_timeout, "backend": backend},
    )
    config["steps"]["train"]["model"]["modules_to_wrap"] = ["inner\\.blocks\\.[0-9]+"]
    return config


def test_torch_backend_workers_that_run_different_collectives_are_told_so(tmp_path: Path) -> None:
    # Worker 1's ring received a chunk of another size and gloo aborted it from its I/O thread:
    # `process 1 terminated with signal SIGABRT`, 6 s after the start, nothing else said. Each
    # worker now tells the next what it is about to run, and both end at once, naming both.
    import time

    started = time.monotonic()
    (result,) = harness.run(
        [harness.Train(_skips_a_block_on_worker_1("torch", 60), tmp_path / "work")],
        out=tmp_path / "h",
        timeout=120,
    )
    elapsed = time.monotonic() - started
    errors = [error for error in result.errors if error is not None]
    print(f"ended in {elapsed:.1f} s: {errors}")
    assert len(errors) == 2 and elapsed < 60, (elapsed, result.describe())
    expected = {
        0: "worker 0 was to run collective #3, the all-gather of 'inner.blocks.1' (",
        1: "worker 1 was to run collective #3, the all-gather of 'inner.blocks.2' (",
    }
    for worker, error in enumerate(result.errors):
        assert error is not None and "CollectiveMismatchError" in error, error
        assert expected[worker] in error and f"where worker {1 - worker} ran collective #3" in error, error
        assert "the workers ran different collectives" in error, error


@pytest.mark.extended
def test_torch_backend_workers_that_run_different_collectives_end_tango_run_in_one_line(
    tmp_path: Path,
) -> None:
    # Through `tango run`: the one line, not `process 1 terminated with signal SIGABRT`.
    import time

    from tests.helpers import run_tango

    config = _skips_a_block_on_worker_1("torch", 60)
    config["steps"]["train"]["train_steps"] = 2
    started = time.monotonic()
    result = run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd", check=False, timeout=240)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if "CollectiveMismatchError: worker" in line]
    print(f"exit code {result.returncode} after {elapsed:.1f} s: {lines}")
    assert result.returncode == 1 and elapsed < 60, output[-4000:]
    assert len(lines) == 1 and "the workers ran different collectives" in lines[0], output[-4000:]
    assert "SIGABRT" not in output and "Traceback" not in output, output[-4000:]
