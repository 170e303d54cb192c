"""
A worker's exit: after :func:`tango_fairscale.teardown.close_process_groups` no gloo thread is
left that could ask for the GIL while the interpreter finalizes (the cause of the workers'
SIGABRT at exit, see the module). Two gloo workers (:func:`tests.harness.spawn`), in seconds.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch
import torch.distributed as dist

from examples.toy.components import ToyRegressor
from tango_fairscale import FSDPConfig, WrapPlan
from tango_fairscale.backends.torch_fsdp2.sharding import make_mesh, shard_model
from tango_fairscale.teardown import close_process_groups, gloo_threads
from tests import harness
from tests.helpers import free_port, tango_env

pytestmark = pytest.mark.skipif(gloo_threads() is None, reason="needs /proc/self/task (Linux)")


def _worker(rank: int, port: int, out_dir: str, close: str, backend: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    torch.manual_seed(0)
    model = ToyRegressor(in_features=8, width=16, num_blocks=3)
    if backend == "torch":
        plan = WrapPlan.build(model, modules_to_wrap=["blocks\\.[0-9]+"])
        shard_model(model, plan, FSDPConfig(), make_mesh(2))
    else:
        from tango_fairscale import compat

        compat.enable_cpu_fsdp()
        model = FSDPConfig().wrap(model)  # type: ignore[assignment]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        x, y = torch.randn(4, 8), torch.randn(4)
        model(x, y)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    counts: Dict[str, object] = {"while_training": gloo_threads()}
    del model, optimizer
    if close == "close_process_groups":
        close_process_groups()
    else:  # what the workers did before: destroy only
        dist.destroy_process_group()
    counts["after"] = gloo_threads()
    (Path(out_dir) / f"threads{rank}.json").write_text(json.dumps(counts))


def _threads_left(tmp_path: Path, close: str, backend: str) -> Dict[int, Dict[str, int]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    harness.spawn(_worker, args=(free_port(), str(tmp_path), close, backend), nprocs=2)
    return {rank: json.loads((tmp_path / f"threads{rank}.json").read_text()) for rank in range(2)}


def test_close_process_groups_joins_every_gloo_thread_of_fsdp2(tmp_path: Path) -> None:
    counts = _threads_left(tmp_path, "close_process_groups", "torch")
    for rank, count in counts.items():
        assert count["while_training"] > 0, (rank, count)  # the check can see the threads
        assert count["after"] == 0, (rank, count)


def test_close_process_groups_releases_what_python_holds_of_fairscale_groups(tmp_path: Path) -> None:
    # FairScale's FSDP makes two groups besides the default one; its group cache and the units'
    # attributes are released (the default group's threads are joined), the groups its units'
    # autograd hooks keep alive from C++ are not (the grace period covers those).
    destroyed = _threads_left(tmp_path / "destroy", "destroy_process_group", "fairscale")
    closed = _threads_left(tmp_path / "close", "close_process_groups", "fairscale")
    for rank in range(2):
        assert closed[rank]["after"] < destroyed[rank]["after"], (closed, destroyed)


def test_destroying_the_group_alone_leaves_fsdp2_threads_running(tmp_path: Path) -> None:
    # The situation close_process_groups exists for: with FSDP2, torch's DTensor caches keep the
    # device mesh, and so the process group and its threads, alive after destroy_process_group.
    # If torch stops doing that, this fails, and the mesh release in teardown can go.
    counts = _threads_left(tmp_path, "destroy_process_group", "torch")
    assert all(count["after"] > 0 for count in counts.values()), counts


_HOSTILE = """
from tango_fairscale.teardown import release_process_groups

class ComputedMapping(dict):  # its items are computed, as transformers' lazy auto-mappings are
    def items(self):
        raise AssertionError("release_process_groups called a dict subclass's items()")

class GuardedAttributes:
    @property
    def __dict__(self):
        raise AssertionError("release_process_groups read a guarded __dict__")

mapping, guarded = ComputedMapping(key=[1, 2]), GuardedAttributes()
plain = {"nested": [object()], "value": 3}
print(release_process_groups())
assert dict.__getitem__(mapping, "key") == [1, 2] and plain["value"] == 3
"""


def test_release_process_groups_leaves_other_objects_alone() -> None:
    # In a process of its own: it drops references to process groups wherever they are.
    result = subprocess.run(
        [sys.executable, "-c", _HOSTILE], capture_output=True, text=True, timeout=120, env=tango_env()
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["0"]  # no process group in that process
