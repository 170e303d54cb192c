"""
Patch S1 (``compat.enable_cpu_fsdp2``, ``compat/fsdp2_gathered_memory.py``): FSDP2's
gathered parameters on a CPU worker each in a memory mapping of their own, unmapped at reshard.
"""

from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

from tango_fairscale import WrapPlan, compat, versions
from tango_fairscale.backends.torch_fsdp2.sharding import shard_model
from tango_fairscale.compat import fsdp2_gathered_memory as gathered_memory
from tango_fairscale.config import FSDPConfig
from tests import harness

#: S1 swaps memory into FSDP2's storage with ``UntypedStorage._swap_data_ptr_``, which torch 2.11
#: lacks: there the patch is off (``test_s1_is_off_where_torch_lacks_its_target`` runs everywhere).
needs_s1 = pytest.mark.skipif(
    not compat.cpu_fsdp2_available(),
    reason=f"S1 is off on torch {torch.__version__}: UntypedStorage._swap_data_ptr_ is missing",
)


def _vm_data_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmData:"))


def _in_heap(address: int) -> bool:
    """Whether ``address`` is in glibc's main heap (``[heap]`` in ``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith("[heap]"):
                start, end = (int(part, 16) for part in line.split()[0].split("-"))
                return start <= address < end
    return False


def _resize_like_fsdp2(tensor: torch.Tensor, size: int) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != size:
        storage.resize_(size)


@needs_s1
def test_alloc_and_free_swap_an_own_mapping_under_every_view() -> None:
    tensor = torch.empty(1 << 22)  # 16 MiB
    view = torch.as_strided(tensor, (1 << 11, 1 << 11), (1 << 11, 1), storage_offset=0)
    tensor.untyped_storage().resize_(0)
    torch.ones(1 << 22).sum()  # torch's compute threads (their stacks count in VmData) started first
    before = _vm_data_kib()
    for value in (1.0, 2.0):
        gathered_memory.alloc_storage(tensor, lambda t: _resize_like_fsdp2(t, t.numel() * t.itemsize))
        assert gathered_memory.in_own_mapping(tensor) and not _in_heap(tensor.data_ptr())
        assert _vm_data_kib() >= before + (16 << 10)
        view.fill_(value)
        assert tensor.sum().item() == value * tensor.numel()  # the view and the tensor share it
        gathered_memory.free_storage(tensor, lambda t: _resize_like_fsdp2(t, 0))
        storage = tensor.untyped_storage()
        assert storage.size() == 0 and storage.resizable() and not gathered_memory.in_own_mapping(tensor)
        assert _vm_data_kib() < before + (4 << 10)  # unmapped with the last reference


@needs_s1
def test_small_tensors_keep_torchs_allocation() -> None:
    calls: List[str] = []
    small = torch.empty(16)
    small.untyped_storage().resize_(0)
    gathered_memory.alloc_storage(small, lambda t: calls.append("alloc") or _resize_like_fsdp2(t, 64))
    assert calls == ["alloc"] and small.untyped_storage().resizable()
    gathered_memory.free_storage(small, lambda t: calls.append("free") or _resize_like_fsdp2(t, 0))
    assert calls == ["alloc", "free"] and small.untyped_storage().size() == 0


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(256, 256)  # a 256 KiB weight: an own mapping; its 1 KiB bias is not
        self.head = nn.Linear(256, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(x)))


@pytest.fixture(autouse=True)
def _s1_undone() -> Iterator[None]:
    """S1 as the test found it: off unless a test (or ``shard_model`` on a CPU mesh) installs it."""
    yield
    compat.disable_cpu_fsdp2()


@needs_s1
def test_a_sharded_unit_gathers_into_own_mappings_and_computes_the_same(one_worker: Any) -> None:
    torch.manual_seed(0)
    plain = _Net()
    sharded = _Net()
    sharded.load_state_dict(plain.state_dict())
    plan = WrapPlan.build(sharded, ["block"], unit_config=FSDPConfig())
    shard_model(sharded, plan, FSDPConfig(), one_worker)
    assert compat.cpu_fsdp2_enabled()
    seen: Dict[str, Any] = {}

    def inside(module: nn.Module, args: Any) -> None:
        weight = module.weight
        seen["weight"] = gathered_memory.in_own_mapping(weight) and not _in_heap(weight.data_ptr())
        seen["bias"] = gathered_memory.in_own_mapping(module.bias)

    sharded.block.register_forward_pre_hook(inside)
    (unit,) = sharded.block._get_fsdp_state()._fsdp_param_group.fsdp_params[:1]
    x = torch.randn(8, 256)
    for step in range(2):
        out, expected = sharded(x), plain(x)
        assert seen == {"weight": True, "bias": False}, step
        assert torch.equal(out, expected)
        out.sum().backward()
        expected.sum().backward()
        # Resharded after backward: the mapping released, the storage empty and resizable again.
        assert [t.untyped_storage().size() for t in unit.all_gather_outputs] == [0], step
        assert not gathered_memory.in_own_mapping(unit.all_gather_outputs[0])
    grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
    for name, p in plain.named_parameters():
        assert torch.equal(grads[name], p.grad), name


def _fsdp2s_own() -> bool:
    """Whether S1's four names are bound to FSDP2's own functions (a wrapper copies the names)."""
    return all(
        function.__module__ == module.__name__
        and function.__qualname__ == qualname
        and not hasattr(function, "__wrapped__")
        for function, module, qualname in (
            (_fsdp_param.alloc_storage, _fsdp_param, "alloc_storage"),
            (_fsdp_param.free_storage, _fsdp_param, "free_storage"),
            (_fsdp_param.FSDPParam.init_all_gather_outputs, _fsdp_param, "FSDPParam.init_all_gather_outputs"),
            (_fsdp_param_group.alloc_storage, _fsdp_param, "alloc_storage"),
        )
    )


@needs_s1
def test_disable_restores_fsdp2s_functions() -> None:
    compat.disable_cpu_fsdp2()  # whatever an earlier test in this process left
    assert _fsdp2s_own()
    originals = (_fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage)
    init = _fsdp_param.FSDPParam.init_all_gather_outputs
    compat.enable_cpu_fsdp2()
    compat.enable_cpu_fsdp2()  # idempotent
    assert _fsdp_param.alloc_storage is not originals[0]
    assert _fsdp_param_group.alloc_storage is not originals[2]
    compat.disable_cpu_fsdp2()
    assert (_fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage) == originals
    assert _fsdp_param.FSDPParam.init_all_gather_outputs is init and not compat.cpu_fsdp2_enabled()
    assert _fsdp2s_own()


def _gathers_on_two_workers(worker: Any, placement_dim: int) -> Dict[str, Any]:
    """On each of 2 workers: the plain net and its sharded copy on the same input, two steps."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from tango_fairscale.backends.torch_fsdp2.sharding import make_mesh

    worker.init_process_group()
    torch.manual_seed(0)
    plain, sharded = _Net(), _Net()
    sharded.load_state_dict(plain.state_dict())
    mesh = make_mesh(2)
    if placement_dim == 0:
        plan = WrapPlan.build(sharded, ["block"], unit_config=FSDPConfig())
        shard_model(sharded, plan, FSDPConfig(), mesh)
    else:  # FSDP2's other layout (copied out through a temporary), with gloo's own collectives
        compat.enable_cpu_fsdp2()
        # The weight on its dim 1, the 1-D bias on its only one.
        placement = lambda param: Shard(min(placement_dim, param.dim() - 1))  # noqa: E731
        fully_shard(sharded.block, mesh=mesh, shard_placement_fn=placement)
        fully_shard(sharded, mesh=mesh)
    seen: List[bool] = []
    sharded.block.register_forward_pre_hook(
        lambda module, args: seen.append(gathered_memory.in_own_mapping(module.weight))
    )
    (unit,) = sharded.block._get_fsdp_state()._fsdp_param_group.fsdp_params[:1]
    x = torch.randn(8, 256)  # the same on both workers: the average of their gradients is plain's
    outputs_equal, freed = [], []
    for _ in range(2):
        out, expected = sharded(x), plain(x)
        outputs_equal.append(torch.equal(out, expected))
        out.sum().backward()
        expected.sum().backward()
        freed.append([t.untyped_storage().size() for t in unit.all_gather_outputs] == [0])
    grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
    return {
        "seen": seen,
        "outputs_equal": outputs_equal,
        "freed": freed,
        "grads_equal": {name: torch.equal(grads[name], p.grad) for name, p in plain.named_parameters()},
    }


@needs_s1
@pytest.mark.parametrize("placement_dim", [0, 1])
def test_two_workers_gather_into_own_mappings_and_compute_alike(tmp_path: Path, placement_dim: int) -> None:
    (result,) = harness.run([harness.Call(_gathers_on_two_workers, (placement_dim,))], out=tmp_path)
    for rank, value in enumerate(result.check().values):
        assert value["seen"] == [True, True], rank
        assert value["outputs_equal"] == [True, True] and value["freed"] == [True, True], rank
        assert all(value["grads_equal"].values()), (rank, value["grads_equal"])


def test_s1_is_off_where_torch_lacks_its_target(
    one_worker: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """
    On a release without S1's target (torch 2.11), sharding on a CPU mesh says so in one line,
    leaves FSDP2's functions as they are, and computes what the plain model computes.
    """
    compat.disable_cpu_fsdp2()
    monkeypatch.setattr(compat, "cpu_fsdp2_available", lambda: False)
    monkeypatch.setattr(versions, "_told", set())
    torch.manual_seed(0)
    plain, sharded = _Net(), _Net()
    sharded.load_state_dict(plain.state_dict())
    with caplog.at_level("INFO", logger="tango_fairscale.versions"):
        shard_model(
            sharded, WrapPlan.build(sharded, ["block"], unit_config=FSDPConfig()), FSDPConfig(), one_worker
        )
        compat.enable_cpu_fsdp2()  # said once per process
    assert not compat.cpu_fsdp2_enabled()
    assert _fsdp2s_own()
    (line,) = [record.getMessage() for record in caplog.records]
    assert "off on torch" in line and "patch S1 needs torch.UntypedStorage._swap_data_ptr_" in line, line
    x = torch.randn(8, 256)
    out, expected = sharded(x), plain(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for name, p in plain.named_parameters():
        assert torch.equal(dict(sharded.named_parameters())[name].grad.full_tensor(), p.grad), name
