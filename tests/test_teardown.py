"""
A worker's exit (:mod:`tango_fairscale.launch.teardown`): a distributed worker that finished ends with
status 0 without the interpreter's finalization, after what a normal exit would have flushed and
run; one that raised is left to ``mp.spawn``'s error reporting. Two gloo workers of
:mod:`tests.harness`, in seconds.
"""

import atexit
import json
import logging
import logging.handlers
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List

import pytest
import torch

from examples.toy.components import ToyRegressor
from tango_fairscale import FSDPConfig, WrapPlan, train_step
from tango_fairscale.backends.torch_fsdp2.sharding import make_mesh, shard_model
from tango_fairscale.launch import teardown
from tango_fairscale.launch.teardown import gloo_threads
from tests import harness
from tests.helpers import free_port, tango_env

pytestmark = pytest.mark.skipif(gloo_threads() is None, reason="needs /proc/self/task (Linux)")


def _raising_worker(worker: harness.Worker) -> None:
    """Tango's worker function raising, inside the package's (T2)."""

    def original(process_index: int, workspace: Any, config: Any) -> None:
        raise RuntimeError(f"worker {process_index} failed")

    train_step.run_worker(original, worker.rank, None, SimpleNamespace(is_distributed=True))


class _Cycle:
    """Garbage only the collector finds: a reference cycle whose finalizer writes a file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.me = self

    def __del__(self) -> None:
        self.path.write_text("finalized\n")


def _finishing_worker(worker: harness.Worker, out: str) -> None:
    """Tango's worker function training FSDP2 and returning, inside the package's (T2)."""
    out_dir = Path(out)
    rank = worker.rank

    def original(process_index: int, workspace: Any, config: Any) -> str:
        worker.init_process_group()
        torch.manual_seed(0)
        model = ToyRegressor(in_features=8, width=16, num_blocks=3)
        shard_model(
            model, WrapPlan.build(model, modules_to_wrap=["blocks\\.[0-9]+"]), FSDPConfig(), make_mesh(2)
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        for _ in range(2):
            model(torch.randn(4, 8), torch.randn(4))["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
        # What only a normal exit used to complete: an atexit handler, log records held in a
        # buffering handler, standard output in a block buffer, garbage with a finalizer.
        at_exit = out_dir / f"atexit{rank}.json"
        atexit.register(lambda: at_exit.write_text(json.dumps({"gloo_threads": gloo_threads()})))
        held = logging.handlers.MemoryHandler(
            capacity=1000, flushLevel=logging.CRITICAL, target=logging.FileHandler(out_dir / f"log{rank}.txt")
        )
        logging.getLogger("tests.teardown").addHandler(held)
        logging.getLogger("tests.teardown").warning("worker %d finished training", rank)
        sys.stdout = open(out_dir / f"stdout{rank}.txt", "w", buffering=1 << 20)  # noqa: SIM115
        print(f"worker {rank} printed")
        _Cycle(out_dir / f"garbage{rank}.txt")
        # Work left to an executor, never shut down: a normal exit waits for it. The work goes on
        # until the exit begins (threading's exit callbacks, run last registered first: this one,
        # then concurrent.futures', which joins the executor's thread), so it is still pending
        # when the worker ends; an exit that does not wait ends it with nothing written.
        exiting = threading.Event()
        threading._register_atexit(exiting.set)  # type: ignore[attr-defined]
        pending = out_dir / f"pending{rank}.txt"
        ThreadPoolExecutor(1).submit(lambda: exiting.wait(timeout=60) and pending.write_text("done"))
        return "trained"

    train_step.run_worker(original, rank, None, SimpleNamespace(is_distributed=True))
    (out_dir / f"returned{rank}").touch()  # never: the worker ended in run_worker


def _later_job(worker: harness.Worker, out: str) -> None:
    (Path(out) / f"later{worker.rank}").touch()


def test_a_finished_worker_ends_with_status_0_after_what_an_exit_flushes(tmp_path: Path) -> None:
    out = tmp_path / "files"
    out.mkdir()
    failed, finished, later = harness.run(
        [
            harness.Call(_raising_worker),
            harness.Call(_finishing_worker, (str(out),)),
            harness.Call(_later_job, (str(out),)),
        ],
        out=tmp_path / "harness",
    )
    # A worker that raised is not ended: its error goes on to mp.spawn (and the worker to its next job).
    assert [w.error if w else None for w in failed.workers] == [
        f"RuntimeError: worker {r} failed" for r in (0, 1)
    ]
    # One that finished ends there, with status 0 (what mp.spawn counts as success), and nothing after.
    assert finished.exitcodes == [0, 0], finished.describe()
    assert finished.workers == [None, None] and later.workers == [None, None]
    assert sorted(path.name for path in out.iterdir() if path.name.startswith(("returned", "later"))) == []
    for rank in (0, 1):
        assert (out / f"log{rank}.txt").read_text().strip() == f"worker {rank} finished training"
        assert (out / f"stdout{rank}.txt").read_text() == f"worker {rank} printed\n"
        assert (out / f"garbage{rank}.txt").read_text() == "finalized\n"
        assert (out / f"pending{rank}.txt").read_text() == "done"
        # The atexit handlers ran while FSDP2's gloo threads were alive (DTensor's caches keep its
        # device mesh and groups): what made finalization abort 1 run in 6 is still there, and no
        # longer matters. If torch stops keeping them, this fails and says so.
        assert json.loads((out / f"atexit{rank}.json").read_text())["gloo_threads"] > 0


def test_close_process_groups_destroys_the_group_and_collects_its_holders() -> None:
    # In a process of its own (no group may outlive the test in this one).
    script = f"""
import gc, weakref, torch.distributed as dist
from tango_fairscale.launch.teardown import close_process_groups
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
class Holder:
    def __init__(self):
        self.group, self.me = dist.group.WORLD, self
holder = weakref.ref(Holder())
gc.disable()
close_process_groups()
print(dist.is_initialized(), holder() is None)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=tango_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "True"]


def test_the_package_walks_no_objects_of_the_garbage_collector() -> None:
    # The exit no longer scans every object of the process for process groups (issue #34).
    sources: List[str] = [path.read_text() for path in Path(teardown.__file__).parent.rglob("*.py")]
    assert not [source for source in sources if "gc.get_objects" in source]
    assert not hasattr(teardown, "release_process_groups")
