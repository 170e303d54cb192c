"""
The torch (FSDP2) backend's library half: every FSDPConfig field mapped or refused, training equal
to plain full-batch training, DCP checkpoints that reshard and load safely, init_on_meta.

Multi-process parts run once per module (spawned gloo workers on the CPU) and leave their results
in files that the individual tests read.
"""

import io
import logging
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from tango.common.exceptions import ConfigurationError
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy
from torch.distributed.tensor import DTensor

from examples.toy.components import ToyRegressor
from tango_fairscale import FSDPConfig, WrapPlan, checkpointing
from tango_fairscale.backends.torch_fsdp2 import checkpoint as torch_fsdp_checkpoint
from tango_fairscale.backends.torch_fsdp2 import safe_reading
from tango_fairscale.backends.torch_fsdp2 import sharding as torch_fsdp
from tango_fairscale.backends.torch_fsdp2.checkpoint import (
    consolidate_dcp,
    load_sharded,
    plain_name,
    save_sharded,
)
from tango_fairscale.backends.torch_fsdp2.collectives import param_groups
from tango_fairscale.backends.torch_fsdp2.sharding import (
    OPTION_TABLE,
    check_options,
    clip_grad_norm_,
    full_state_dict,
    fully_shard_kwargs,
    make_grad_scaler,
    make_mesh,
    no_sync,
    shard_model,
)
from tango_fairscale.errors import CheckpointError
from tango_fairscale.launch.teardown import close_process_groups
from tango_fairscale.materialize import materialize_module, parameters_on_meta
from tango_fairscale.options import check_engine_options
from tango_fairscale.topology import Topology
from tests import harness
from tests.helpers import (
    REPO,
    free_port,
    one_line_error,
    run_tango,
    toy_model,
    train_config,
    train_work_dir,
)

STEPS = 4
EXTRA_STEPS = 2  # after loading the checkpoint on a 2x2 hybrid mesh
GLOBAL_BATCH = 16
MAX_NORM = 0.5
UNITS = ["blocks\\.[0-9]+"]
#: nested_in_ckpt: the blocks are units inside a checkpointed unit (all of ``blocks``), so their
#: all-gathers run in the recomputation, between a backward prefetch and its copy-out.
VARIANTS = ("root", "nested", "nested_ckpt", "nested_in_ckpt", "accumulate")


def _model(seed: int = 0) -> ToyRegressor:
    torch.manual_seed(seed)
    # width 30: shards of 15 on 2 workers, 10/10/10 on 3; the head's weight (1, 30) leaves
    # worker 1 an empty shard.
    return ToyRegressor(in_features=8, width=30, num_blocks=3)


def _plan(model: nn.Module, variant: str) -> WrapPlan:
    if variant in ("root", "accumulate"):
        return WrapPlan(selected=(), checkpointed=frozenset(), fsdp=False)
    if variant == "nested_in_ckpt":
        return WrapPlan.build(model, ["blocks", *UNITS], activation_checkpointing=True)
    return WrapPlan.build(model, UNITS, activation_checkpointing=variant == "nested_ckpt")


def _data(steps: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global batches of the first ``steps`` steps (the same whatever ``steps``)."""
    generator = torch.Generator().manual_seed(123)
    x = torch.randn(STEPS + EXTRA_STEPS, GLOBAL_BATCH, 8, generator=generator)
    y = torch.randn(STEPS + EXTRA_STEPS, GLOBAL_BATCH, generator=generator)
    return x[:steps], y[:steps]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


def _init(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def _full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    _, state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    # A copy: scalar state (the step count) is the optimizer's own tensor, which later steps change.
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, state)


def _train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    rank: int,
    world_size: int,
    accumulate: bool = False,
) -> List[float]:
    """Data-parallel steps: each worker takes its slice of the global batch; mean loss per worker."""
    x, y = _data(max(steps) + 1)
    per_worker = GLOBAL_BATCH // world_size
    norms = []
    for step in steps:
        xs = x[step, rank * per_worker : (rank + 1) * per_worker]
        ys = y[step, rank * per_worker : (rank + 1) * per_worker]
        if accumulate:  # two micro-batches, the first without gradient reduction
            half = per_worker // 2
            with no_sync(model):
                (model(xs[:half], ys[:half])["loss"] / 2).backward()
            (model(xs[half:], ys[half:])["loss"] / 2).backward()
        else:
            model(xs, ys)["loss"].backward()
        norms.append(clip_grad_norm_(model, MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms


def _train_worker(rank: int, world_size: int, port: int, out: str) -> None:
    _init(rank, world_size, port)
    out_dir = Path(out)
    mesh = make_mesh(world_size)
    results: Dict[str, Any] = {}
    for variant in VARIANTS:
        model = _model()
        shard_model(model, _plan(model, variant), FSDPConfig(), mesh)
        optimizer = _optimizer(model)
        norms = _train_steps(
            model, optimizer, range(STEPS), rank, world_size, accumulate=variant == "accumulate"
        )
        results[variant] = {"state": full_state_dict(model), "norms": norms}
        if variant == "nested_ckpt":
            fields = save_sharded(
                out_dir / "checkpoint",
                model,
                optimizer,
                {"trainer": {"step": STEPS, "rank": rank}},
                step=STEPS,
            )
            dist.barrier()
            if rank == 0:
                checkpointing.write_marker(
                    out_dir / "checkpoint", world_size=fields["world_size"], extra=fields
                )
            dist.barrier()
            results["saved_optimizer"] = _full_optimizer_state(model, optimizer)
            results["rank0_only"] = full_state_dict(model, FSDPConfig(state_dict_on_rank_0_only=True))

    # init_on_meta: parameters built on meta, each unit allocated right before it is sharded.
    torch.manual_seed(5)
    with parameters_on_meta():
        model = ToyRegressor(in_features=8, width=30, num_blocks=3)
    shard_model(model, _plan(model, "nested"), FSDPConfig(), mesh)
    results["meta_sharded"] = {n: str(p.device) for n, p in model.named_parameters()}
    results["meta_initial"] = full_state_dict(model)
    optimizer = _optimizer(model)
    _train_steps(model, optimizer, range(2), rank, world_size)
    results["meta_trained"] = full_state_dict(model)

    # float16 loss scaling: an overflow in one worker's shard only must make every worker skip.
    model = _model()
    shard_model(model, _plan(model, "nested"), FSDPConfig(), mesh)
    optimizer = _optimizer(model)
    scaler = make_grad_scaler(torch.float16, "cpu")
    assert scaler is not None
    before = full_state_dict(model)
    x, y = _data(1)
    scaler.scale(model(x[0, :8], y[0, :8])["loss"]).backward()
    if rank == 0:
        grad = next(p.grad for p in model.parameters() if p.grad is not None)
        assert isinstance(grad, DTensor)
        grad.to_local().view(-1)[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    after = full_state_dict(model)
    results["scaler"] = {
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "scale": scaler.get_scale(),
    }
    torch.save(results, out_dir / f"train_rank{rank}.pt")
    close_process_groups()


def _load_worker(rank: int, world_size: int, port: int, out: str, hosts: int) -> None:
    _init(rank, world_size, port)
    out_dir = Path(out)
    mesh = make_mesh(world_size, hosts=hosts)
    model = _model(seed=99)  # other values than the saved ones
    shard_model(model, _plan(model, "nested_ckpt"), FSDPConfig(), mesh)
    optimizer = _optimizer(model)
    extras = load_sharded(out_dir / "checkpoint", model, optimizer)
    results: Dict[str, Any] = {
        "extras": extras,
        "model": full_state_dict(model),
        "optimizer": _full_optimizer_state(model, optimizer),
        "mesh": mesh.mesh_dim_names,
    }
    if hosts > 1:
        # Hybrid sharding trains on: the data-parallel average now spans both mesh dimensions.
        _train_steps(model, optimizer, range(STEPS, STEPS + EXTRA_STEPS), rank, world_size)
        results["continued"] = full_state_dict(model)
        results["continued_optimizer"] = _full_optimizer_state(model, optimizer)
        parameter = next(model.parameters())
        assert isinstance(parameter, DTensor)
        results["placements"] = str(parameter.placements)
        # Saved as two hosts with disks of their own: each host's directory gets its workers'
        # files only, and loads back from them alone (shards and optimizer state replicated
        # across hosts are in each host's files).
        per_host = world_size // hosts
        topology = Topology(world_size, per_host)
        part = out_dir / f"host{topology.host_of(rank)}" / "checkpoint"
        fields = save_sharded(
            part,
            model,
            optimizer,
            {"trainer": {"rank": rank}},
            step=STEPS + EXTRA_STEPS,
            topology=topology,
        )
        if rank % per_host == 0:
            workers = list(topology.ranks_of(topology.host_of(rank)))
            checkpointing.write_marker(
                part, world_size=world_size, extra={**fields, "host": {"workers": workers}}
            )
        dist.barrier()
        model = _model(seed=7)
        shard_model(model, _plan(model, "nested_ckpt"), FSDPConfig(), mesh)
        optimizer = _optimizer(model)
        results["reloaded_extras"] = load_sharded(part, model, optimizer)
        results["reloaded"] = full_state_dict(model)
        results["reloaded_optimizer"] = _full_optimizer_state(model, optimizer)
    torch.save(results, out_dir / f"load{world_size}_rank{rank}.pt")
    close_process_groups()


def _reference(
    variant_steps: int,
) -> Tuple[List[Dict[str, torch.Tensor]], List[float], torch.optim.Optimizer]:
    """Plain single-process training on the full batch: the state after each step."""
    model = _model()
    optimizer = _optimizer(model)
    x, y = _data(variant_steps)
    states, norms = [], []
    for step in range(variant_steps):
        model(x[step], y[step])["loss"].backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states, norms, optimizer


def _max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("torch_backend")
    harness.spawn(_train_worker, args=(2, free_port(), str(out)), nprocs=2)
    return out


def _results(out: Path, name: str, world_size: int) -> List[Dict[str, Any]]:
    return [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(world_size)]


# --- the option table -------------------------------------------------------------------------

REFUSED: Dict[str, Dict[str, Any]] = {
    "move_grads_to_cpu": {"move_grads_to_cpu": True},
    "compute_dtype": {"compute_dtype": "bfloat16"},
    "bucket_cap_mb": {"bucket_cap_mb": 50},
    "no_broadcast_optim_state": {"no_broadcast_optim_state": True},
    "gradient_predivide_factor": {"gradient_predivide_factor": 2.0},
    "allow_reset_parameters": {"allow_reset_parameters": True},
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_values_name_the_field_and_backend(field: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        check_options(FSDPConfig(**REFUSED[field]))
    message = str(error.value)
    assert f"FSDPConfig.{field}:" in message and "torch backend" in message, message
    assert 'backend: "fairscale"' in message


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x) * self.scale)


def _sharded(mesh: Any, unit: Dict[str, Any], root: Dict[str, Any]) -> _WithBuffers:
    model = _WithBuffers()
    check_options(FSDPConfig(**unit))
    check_options(FSDPConfig(**root))
    plan = WrapPlan.build(model, ["block"], unit_config=FSDPConfig(**unit))
    return shard_model(model, plan, FSDPConfig(**root), mesh)  # type: ignore[return-value]


def _state(module: nn.Module) -> Any:
    assert isinstance(module, FSDPModule)
    return module._get_fsdp_state()


def _resharded_after_forward(module: nn.Module) -> bool:
    return all(g.post_forward_mesh_info is not None for g in param_groups(module))


def _check_reshard(mesh: Any) -> None:
    model = _sharded(mesh, {"reshard_after_forward": False}, {})
    assert not _resharded_after_forward(model.block) and not _resharded_after_forward(model)
    model = _sharded(mesh, {}, {})
    assert _resharded_after_forward(model.block) and not _resharded_after_forward(model)


def _check_root_reshard(mesh: Any) -> None:
    model = _sharded(mesh, {}, {"disable_reshard_on_root": False})
    assert _resharded_after_forward(model)


def _check_offload(mesh: Any) -> None:
    for config in (
        FSDPConfig(move_params_to_cpu=True),
        FSDPConfig(move_params_to_cpu=True, move_grads_to_cpu=True),
    ):
        check_options(config)
        assert isinstance(
            fully_shard_kwargs(config, on_cpu=False, root=False)["offload_policy"], CPUOffloadPolicy
        )
        assert type(fully_shard_kwargs(config, on_cpu=True, root=False)["offload_policy"]) is OffloadPolicy
    model = _sharded(mesh, {"move_params_to_cpu": True}, {"move_params_to_cpu": True})
    assert type(param_groups(model.block)[0].offload_policy) is OffloadPolicy  # CPU worker


def _check_mixed_precision(mesh: Any) -> None:
    model = _sharded(mesh, {"mixed_precision": True}, {"mixed_precision": True, "fp32_reduce_scatter": True})
    unit, root = _state(model.block)._mp_policy, _state(model)._mp_policy
    assert (unit.param_dtype, unit.reduce_dtype, unit.cast_forward_inputs) == (torch.bfloat16, None, True)
    assert (root.param_dtype, root.reduce_dtype) == (torch.bfloat16, torch.float32)
    seen: List[torch.dtype] = []
    # After FSDP's own pre-forward hook, which all-gathers the unit.
    model.block.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    model(torch.randn(2, 4)).sum().backward()
    assert seen == [torch.bfloat16]
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    model = _sharded(mesh, {"mixed_precision": True, "compute_dtype": "float16"}, {})
    assert _state(model.block)._mp_policy.param_dtype == torch.float16
    model = _sharded(mesh, {"compute_dtype": "float32"}, {})
    assert _state(model.block)._mp_policy.param_dtype is None


def _check_same_as_default(**change: Any) -> Callable[[Any], None]:
    def check(mesh: Any) -> None:
        config = FSDPConfig(**change)
        check_options(config)
        for root in (False, True):
            assert fully_shard_kwargs(config, on_cpu=True, root=root).keys() == {
                "reshard_after_forward",
                "mp_policy",
                "offload_policy",
            }
            assert str(fully_shard_kwargs(config, on_cpu=True, root=root)) == str(
                fully_shard_kwargs(FSDPConfig(), on_cpu=True, root=root)
            )
        _sharded(mesh, change, change)

    return check


def _check_buffer_dtype(mesh: Any) -> None:
    model = _sharded(mesh, {}, {"buffer_dtype": "bfloat16"})
    assert model.scale.dtype == torch.bfloat16 and model.count.dtype == torch.long
    model = _sharded(mesh, {}, {"mixed_precision": True, "buffer_dtype": "float32"})
    assert model.scale.dtype == torch.float32
    model = _sharded(mesh, {}, {"mixed_precision": True})
    assert model.scale.dtype == torch.bfloat16  # unset: the compute dtype, as FairScale
    model = _sharded(mesh, {}, {})
    assert model.scale.dtype == torch.float32  # unset, full precision: as they are


def _check_state_dict_options(mesh: Any) -> None:
    model = _sharded(mesh, {}, {})
    plain = _WithBuffers().state_dict()
    for config in (FSDPConfig(state_dict_device="cpu"), FSDPConfig(state_dict_on_rank_0_only=True)):
        state = full_state_dict(model, config)
        assert state.keys() == plain.keys()
        assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in state.values())


def _check_clear_autocast_cache(mesh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: List[int] = []
    monkeypatch.setattr(torch, "clear_autocast_cache", lambda: calls.append(1))
    model = _sharded(mesh, {"clear_autocast_cache": True}, {})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(2, 4))
        assert calls == [1]  # after the unit's forward; the root did not ask for it


def _check_force_input_to_fp32(mesh: Any) -> None:
    model = _sharded(mesh, {"force_input_to_fp32": True}, {})
    policy = _state(model.block)._mp_policy
    assert (policy.param_dtype, policy.cast_forward_inputs) == (torch.float32, True)
    seen: List[torch.dtype] = []
    model.block.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    model.block(torch.randn(2, 4, dtype=torch.bfloat16))
    assert seen == [torch.float32]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def _check_verbose(mesh: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=torch_fsdp.__name__):
        _sharded(mesh, {"verbose": True}, {})
    assert any("fully_shard(block)" in record.getMessage() for record in caplog.records)


MAPPED: Dict[str, Callable[..., None]] = {
    "reshard_after_forward": _check_reshard,
    "disable_reshard_on_root": _check_root_reshard,
    "move_params_to_cpu": _check_offload,
    "move_grads_to_cpu": _check_offload,
    "mixed_precision": _check_mixed_precision,
    "compute_dtype": _check_mixed_precision,
    "fp32_reduce_scatter": _check_mixed_precision,
    "flatten_parameters": _check_same_as_default(flatten_parameters=False),
    "bucket_cap_mb": _check_same_as_default(bucket_cap_mb=0),
    "buffer_dtype": _check_buffer_dtype,
    "state_dict_device": _check_state_dict_options,
    "state_dict_on_rank_0_only": _check_state_dict_options,
    "clear_autocast_cache": _check_clear_autocast_cache,
    "force_input_to_fp32": _check_force_input_to_fp32,
    "verbose": _check_verbose,
}


def test_every_field_is_in_the_table_and_tested() -> None:
    fields = set(FSDPConfig.field_names())
    assert set(OPTION_TABLE) == fields
    assert set(MAPPED) | set(REFUSED) == fields
    refused_only = {field for field, (meaning, _) in OPTION_TABLE.items() if meaning is None}
    assert refused_only <= set(REFUSED) and not refused_only & set(MAPPED)


@pytest.mark.parametrize("field", sorted(MAPPED))
def test_mapped_field_takes_effect(
    field: str, one_worker: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    check = MAPPED[field]
    if check is _check_clear_autocast_cache:
        check(one_worker, monkeypatch)
    elif check is _check_verbose:
        check(one_worker, caplog)
    else:
        check(one_worker)


def test_docs_render_the_table() -> None:
    assert torch_fsdp.render_option_table() in (REPO / "docs" / "torch-backend.md").read_text()


# --- single process: activation checkpointing under CPU bfloat16 autocast, safe loading -------


@pytest.mark.parametrize("on_cpu", [False, True], ids=["torch-non-reentrant", "fairscale-reentrant-cpu"])
def test_checkpoint_wrapper_recomputes_under_cpu_bfloat16_autocast(on_cpu: bool) -> None:
    """Either wrapper ``checkpointed`` picks restores CPU autocast in the recompute: same gradients."""
    grads: List[Dict[str, torch.Tensor]] = []
    autocast: List[Tuple[bool, torch.dtype]] = []

    def record(module: nn.Module, args: Any) -> None:
        autocast.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

    for checkpointed in (False, True):
        model = _model()
        model.blocks[1].get_submodule("linear").register_forward_pre_hook(record)
        if checkpointed:
            model.blocks[1] = torch_fsdp.checkpointed(model.blocks[1], on_cpu)
        x, y = _data(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x[0], y[0])["loss"]
        loss.backward()
        grads.append(
            {
                n.replace("_checkpoint_wrapped_module.", ""): p.grad
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        )
    assert autocast == [(True, torch.bfloat16)] * 3  # plain forward, checkpointed forward, recompute
    assert _max_diff(grads[0], grads[1]) == 0.0


class _RunsCode:
    def __reduce__(self) -> Any:
        return (os.makedirs, (os.environ["TORCH_BACKEND_TEST_CANARY"],))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_metadata_unpickler_refuses_foreign_globals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    canary = tmp_path / "ran"
    monkeypatch.setenv("TORCH_BACKEND_TEST_CANARY", str(canary))
    dcp.save(
        {"w": torch.ones(3), "lr": 0.5}, storage_writer=dcp.FileSystemWriter(tmp_path / "ok"), no_dist=True
    )
    metadata = safe_reading.read_metadata(tmp_path / "ok" / ".metadata")
    assert "w" in metadata.state_dict_metadata
    (tmp_path / "evil").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(CheckpointError, match="os.makedirs|posix.makedirs"):
        safe_reading.read_metadata(tmp_path / "evil")
    assert not canary.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_non_tensor_values_load_with_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    canary = tmp_path / "ran"
    monkeypatch.setenv("TORCH_BACKEND_TEST_CANARY", str(canary))
    dcp.save({"evil": _RunsCode()}, storage_writer=dcp.FileSystemWriter(tmp_path / "ck"), no_dist=True)
    assert not canary.exists()
    reader = safe_reading._SafeFileSystemReader(tmp_path / "ck", {"__0_0.distcp"})
    with pytest.raises(CheckpointError, match="weights_only"):
        safe_reading._dcp_call(
            dcp.load,
            {"evil": None},
            storage_reader=reader,
            planner=safe_reading._SafeLoadPlanner(),
            no_dist=True,
        )
    assert not canary.exists()


def test_grad_scaler_only_for_float16() -> None:
    assert make_grad_scaler(torch.bfloat16, "cpu") is None and make_grad_scaler(torch.float32, "cuda") is None
    assert isinstance(make_grad_scaler(torch.float16, "cpu"), torch.amp.GradScaler)


# --- two workers: training, clipping, accumulation, checkpoints, init_on_meta ------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_equals_plain_full_batch_training(trained: Path, variant: str) -> None:
    states, norms, _ = _reference(STEPS)
    for result in _results(trained, "train", 2):
        diff = _max_diff(result[variant]["state"], states[-1])
        assert diff < 1e-5, (variant, diff)
        assert max(abs(a - b) for a, b in zip(result[variant]["norms"], norms)) < 1e-5
    assert max(norms) > MAX_NORM  # clipping took place


def test_full_state_dict_on_rank_0_only(trained: Path) -> None:
    ranks = _results(trained, "train", 2)
    assert _max_diff(ranks[0]["rank0_only"], ranks[0]["nested_ckpt"]["state"]) == 0.0
    assert ranks[1]["rank0_only"] == {}


def test_consolidated_checkpoint_loads_strictly_into_the_plain_model(trained: Path) -> None:
    weights = consolidate_dcp(trained / "checkpoint")
    plain = _model(seed=1)
    plain.load_state_dict(weights, strict=True)
    assert _max_diff(plain.state_dict(), _results(trained, "train", 2)[0]["nested_ckpt"]["state"]) == 0.0
    marker = checkpointing.read_marker(trained / "checkpoint")
    assert marker is not None and marker["backend"] == "torch" and marker["world_size"] == 2
    assert sorted(marker["digests"]) == [
        "dcp/.metadata",
        "dcp/__0_0.distcp",
        "dcp/__1_0.distcp",
        "worker0_trainer.pt",
        "worker1_trainer.pt",
    ]


def _load_on(trained: Path, world_size: int, hosts: int) -> List[Dict[str, Any]]:
    name = f"load{world_size}_rank0.pt"
    if not (trained / name).exists():
        harness.spawn(_load_worker, args=(world_size, free_port(), str(trained), hosts), nprocs=world_size)
    return _results(trained, f"load{world_size}", world_size)


def _optimizer_diff(a: Dict[str, Any], b: Dict[str, Any]) -> float:
    assert a["state"].keys() == b["state"].keys()
    diffs = [0.0]
    for key in a["state"]:
        assert a["state"][key].keys() == b["state"][key].keys()
        for name, value in a["state"][key].items():
            diffs.append((value.float() - b["state"][key][name].float()).abs().max().item())
    assert [{k: v for k, v in g.items()} for g in a["param_groups"]] == b["param_groups"]
    return max(diffs)


def test_consolidated_optimizer_state_is_the_saved_one(trained: Path) -> None:
    saved = _results(trained, "train", 2)[0]
    full = consolidate_dcp(trained / "checkpoint", with_optimizer=True)
    assert _max_diff(full["model"], saved["nested_ckpt"]["state"]) == 0.0
    # Keyed by the plain model's names, as the fairscale backend's consolidation is.
    expected = saved["saved_optimizer"]
    assert set(full["optimizer"]["state"]) == set(full["model"])
    plain = {
        "state": {plain_name(k): v for k, v in expected["state"].items()},
        "param_groups": [
            {**g, "params": [plain_name(p) for p in g["params"]]} for g in expected["param_groups"]
        ],
    }
    assert _optimizer_diff(full["optimizer"], plain) == 0.0


def test_checkpoint_of_two_workers_loads_on_three(trained: Path) -> None:
    saved = _results(trained, "train", 2)[0]
    for rank, result in enumerate(_load_on(trained, 3, hosts=1)):
        assert _max_diff(result["model"], saved["nested_ckpt"]["state"]) == 0.0
        assert _optimizer_diff(result["optimizer"], saved["saved_optimizer"]) == 0.0
        # Worker 2 did not exist in the saved run: it gets worker 0's extra state.
        assert result["extras"] == {"trainer": {"step": STEPS, "rank": rank if rank < 2 else 0}}


def test_checkpoint_loads_on_a_hybrid_mesh_of_two_hosts_trains_on_and_saves_per_host(trained: Path) -> None:
    saved = _results(trained, "train", 2)[0]
    states, _, _ = _reference(STEPS + EXTRA_STEPS)
    for result in _load_on(trained, 4, hosts=2):
        assert result["mesh"] == ("replicate", "shard")
        assert result["placements"] == "(Replicate(), Shard(dim=0))"
        assert _max_diff(result["model"], saved["nested_ckpt"]["state"]) == 0.0
        assert _optimizer_diff(result["optimizer"], saved["saved_optimizer"]) == 0.0
        assert _max_diff(result["continued"], states[-1]) < 1e-5
        assert _max_diff(result["reloaded"], result["continued"]) == 0.0
        assert _optimizer_diff(result["reloaded_optimizer"], result["continued_optimizer"]) == 0.0
    for host, ranks in ((0, [0, 1]), (1, [2, 3])):
        part = trained / f"host{host}" / "checkpoint"
        assert sorted(p.name for p in (part / "dcp").iterdir()) == [
            ".metadata",
            *(f"__{r}_0.distcp" for r in ranks),
        ]
        assert not checkpointing.is_complete(part)
        assert [r["reloaded_extras"]["trainer"]["rank"] for r in _results(trained, "load4", 4)] == [
            0,
            1,
            2,
            3,
        ]


def test_tampered_checkpoint_is_refused(trained: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "checkpoint"
    shutil.copytree(trained / "checkpoint", copy)
    data = copy / "dcp" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="SHA-256"):
        consolidate_dcp(copy)
    (copy / checkpointing.MARKER).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        consolidate_dcp(copy)


def _copies_worker(rank: int, world_size: int, port: int, out: str) -> None:
    _init(rank, world_size, port)
    model = _model()
    shard_model(model, _plan(model, "nested_ckpt"), FSDPConfig(), make_mesh(world_size))
    try:
        load_sharded(Path(out) / f"copy{rank}", model, _optimizer(model))
        outcome = "loaded"
    except CheckpointError as error:
        outcome = str(error)
    (Path(out) / f"outcome{rank}.txt").write_text(outcome)
    close_process_groups()


def test_workers_reading_their_own_copies_check_every_file_of_each(trained: Path, tmp_path: Path) -> None:
    import shutil

    # Hosts on their own disks, each with a whole copy (e.g. copied by hand): the workers of one
    # directory split its checking among themselves, not with the workers of another copy.
    for rank in range(2):
        shutil.copytree(trained / "checkpoint", tmp_path / f"copy{rank}")
    # Worker 1's data file, in worker 0's copy: split by position over both workers, worker 1
    # would have checked it, in its own (intact) copy, and worker 0's copy would have loaded.
    data = tmp_path / "copy0" / "dcp" / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    harness.spawn(_copies_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        outcome = (tmp_path / f"outcome{rank}.txt").read_text()
        assert f"{data} has SHA-256" in outcome, outcome


def test_fairscale_checkpoint_is_not_read_as_dcp(tmp_path: Path) -> None:
    checkpointing.atomic_save({"weights": {}}, checkpointing.worker_file(tmp_path, 0, "model"))
    checkpointing.write_marker(tmp_path, world_size=1, extra={"files": ["model"]})
    with pytest.raises(CheckpointError, match="fairscale backend"):
        consolidate_dcp(tmp_path)


def test_init_on_meta_trains_and_workers_agree(trained: Path) -> None:
    ranks = _results(trained, "train", 2)
    assert all(device == "cpu" for device in ranks[0]["meta_sharded"].values())
    # The same values as allocating the plain model's units in the same order from the same seed.
    torch.manual_seed(5)
    with parameters_on_meta():
        expected = ToyRegressor(in_features=8, width=30, num_blocks=3)
    for name in _plan(expected, "nested").fsdp_units:
        materialize_module(expected.get_submodule(name), torch.device("cpu"), root=expected)
    materialize_module(expected, torch.device("cpu"), root=expected)
    for result in ranks:
        assert _max_diff(result["meta_initial"], expected.state_dict()) == 0.0
        assert not any(torch.isnan(v).any() for v in result["meta_trained"].values())
    assert _max_diff(ranks[0]["meta_trained"], ranks[1]["meta_trained"]) == 0.0
    assert _max_diff(ranks[0]["meta_trained"], ranks[0]["meta_initial"]) > 0.0


def test_float16_overflow_in_one_shard_skips_the_step_everywhere(trained: Path) -> None:
    for result in _results(trained, "train", 2):
        assert result["scaler"]["unchanged"]
        assert result["scaler"]["scale"] == 65536.0 * 0.5


def test_metadata_of_a_real_checkpoint_names_only_allowed_globals(trained: Path) -> None:
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO((trained / "checkpoint" / "dcp" / ".metadata").read_bytes())).load()
    dtypes = {(m, n) for m, n in seen if m == "torch" and isinstance(getattr(torch, n, None), torch.dtype)}
    assert seen - dtypes <= safe_reading.METADATA_GLOBALS


def test_configuration_reference_shows_the_option_mapping() -> None:
    reference = (REPO / "docs" / "configuration.md").read_text()
    assert torch_fsdp.render_option_table(with_reasons=False) in reference


def test_each_backend_refuses_the_others_checkpoint(tmp_path: Path) -> None:
    from tango_fairscale.preflight import check_engine

    written = {"torch": tmp_path / "torch_written", "fairscale": tmp_path / "fairscale_written"}
    for backend, directory in written.items():
        directory.mkdir()
        fields = torch_fsdp_checkpoint.MARKER_FIELDS if backend == "torch" else {}
        checkpointing.write_marker(directory, world_size=2, extra={**fields, "files": [], "digests": {}})
    for backend, directory in written.items():
        marker = checkpointing.read_marker(directory)
        assert marker is not None
        torch_fsdp_checkpoint.check_written_by(directory, marker, backend)  # its own: accepted
        other = "fairscale" if backend == "torch" else "torch"
        expected = (
            f"written by the {backend} backend .* not the {other} backend: "
            f'resume it with training_engine.backend: "{backend}"'
        )
        with pytest.raises(CheckpointError, match=expected):
            torch_fsdp_checkpoint.check_written_by(directory, marker, other)
        # Pre-flight says so before any worker starts.
        with pytest.raises(ConfigurationError, match="training_engine.resume_from_checkpoint: .*" + expected):
            check_engine({"backend": other, "resume_from_checkpoint": str(directory)}, 2, None, True)
        check_engine({"backend": backend, "resume_from_checkpoint": str(directory)}, 2, None, True)


def test_hybrid_sharding_needs_the_torch_backend() -> None:
    common = dict(distributed=True, device_count=2, on_cpu=True, warn=False)
    check_engine_options(backend="torch", hybrid_sharding=True, hosts=2, **common)
    check_engine_options(backend="fairscale", hybrid_sharding=False, hosts=2, **common)
    with pytest.raises(
        ConfigurationError, match=r'training_engine.hybrid_sharding: true needs backend: "torch"'
    ):
        check_engine_options(backend="fairscale", hybrid_sharding=True, **common)
    with pytest.raises(
        ConfigurationError, match="training_engine.hybrid_sharding: expected true or false, got 'yes'"
    ):
        check_engine_options(backend="torch", hybrid_sharding="yes", **common)
    # Pre-flight says so from the config.
    from tango_fairscale.preflight import check_engine

    with pytest.raises(ConfigurationError, match="hybrid_sharding: true needs"):
        check_engine({"hybrid_sharding": True}, 2, None, True)


def _other_blocks_worker(rank: int, world_size: int, port: int, out: str) -> None:
    _init(rank, world_size, port)
    outcomes = {}
    for blocks in (2, 4):
        torch.manual_seed(0)
        model = ToyRegressor(in_features=8, width=30, num_blocks=blocks)
        shard_model(model, _plan(model, "nested_ckpt"), FSDPConfig(), make_mesh(world_size))
        try:
            load_sharded(Path(out) / "checkpoint", model, _optimizer(model))
            outcomes[blocks] = "loaded"
        except CheckpointError as error:
            outcomes[blocks] = str(error)
    torch.save(outcomes, Path(out) / f"blocks_rank{rank}.pt")
    close_process_groups()


def test_a_checkpoint_of_other_parameters_is_refused_naming_them(trained: Path, tmp_path: Path) -> None:
    # The checkpoint has 3 blocks: DCP loaded the common parameters of 2 silently, and failed
    # deep in its planner for 4.
    import shutil

    shutil.copytree(trained / "checkpoint", tmp_path / "checkpoint")
    harness.spawn(_other_blocks_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for outcomes in _results(tmp_path, "blocks", 2):
        fewer, more = outcomes[2], outcomes[4]
        assert "saved from a model with other parameters" in fewer and "\n" not in fewer
        assert (
            "in it are not this model's (blocks.2." in fewer and "of this model's are not in it" not in fewer
        )
        assert "of this model's are not in it (blocks.3." in more and "are not this model's" not in more


TAMPERED_CASES = ("swapped data files", "data file a pickle", "metadata a pickle")


class _Payload:
    """Pickles to a call that would leave a marker file, were it ever unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("tampering", list(TAMPERED_CASES))
def test_tampered_files_with_matching_digests_are_one_line(
    trained: Path, tmp_path: Path, tampering: str
) -> None:
    # Files replaced after the save and the marker's digests rewritten to match: DCP failed with
    # 49-196 lines of CheckpointException (EOFError, AttributeError, "metadata is None" deep inside).
    import shutil

    marker = tmp_path / "payload_ran"
    copy = tmp_path / "copy0"
    _tampered_copy(trained / "checkpoint", copy, tampering, marker)
    shutil.copytree(copy, tmp_path / "copy1")
    harness.spawn(_copies_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        outcome = (tmp_path / f"outcome{rank}.txt").read_text()
        assert "\n" not in outcome and "Nothing in it was run" in outcome, outcome
        assert TAMPERED[tampering] in outcome, outcome
    assert not marker.exists()


#: What the refusal of each tampering names.
TAMPERED = {
    "swapped data files": "swapped or replaced after the save",
    "data file a pickle": "swapped or replaced after the save",
    "metadata a pickle": "names posix.system",
}


def _tampered_copy(checkpoint: Path, copy: Path, tampering: str, marker: Path) -> None:
    """
    A copy of a 2-worker ``checkpoint`` with its DCP files swapped, or one of them replaced by a
    pickle whose payload creates ``marker``, and the marker's digests rewritten to match.
    """
    import shutil

    shutil.copytree(checkpoint, copy)
    dcp_dir = copy / "dcp"
    if tampering == "swapped data files":
        first, second = dcp_dir / "__0_0.distcp", dcp_dir / "__1_0.distcp"
        first.rename(dcp_dir / "swap")
        second.rename(first)
        (dcp_dir / "swap").rename(second)
    else:
        target = dcp_dir / ("__1_0.distcp" if tampering == "data file a pickle" else ".metadata")
        target.write_bytes(pickle.dumps(_Payload(marker)))
    fields = checkpointing.read_marker(copy)
    assert fields is not None
    for name in fields["digests"]:
        fields["digests"][name] = checkpointing.file_digest(copy / name)
    checkpointing.write_marker(copy, world_size=fields.pop("world_size"), extra=fields)


def _heap_or_mapping(worker: harness.Worker, backend: str, work_dir: Path) -> Tuple[str, str]:
    """
    Where a 5 MiB allocation lands on a CPU worker while ``backend``'s engine lives, and once it
    is closed (the threshold restored: glibc's dynamic threshold's ceiling, 32 MiB).
    """
    from tests.helpers import train_config

    def where() -> str:
        tensor = torch.empty(5 << 20, dtype=torch.uint8)  # held while the maps are read
        address = tensor.data_ptr()
        for line in Path("/proc/self/maps").read_text().splitlines():
            start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
            if start <= address < end:
                return "heap" if line.endswith("[heap]") else "mapping"
        raise AssertionError(f"{address:#x} is in no mapping of /proc/self/maps")

    experiment = train_config(engine="fairscale", wrap="nested", engine_extra={"backend": backend})
    engine = worker.engine(experiment, work_dir / backend)
    living = where()
    engine.close()
    return living, where()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_each_backend_sets_the_cpu_mmap_threshold_its_buffers_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # FSDP2 gathers one tensor per parameter (MiBs each) rather than FairScale's flat units: a
    # 5 MiB tensor gets its own mapping under the torch backend's 4 MiB threshold, comes from the
    # heap under the fairscale backend's 16 MiB; the engine closed, the heap under both. Fresh
    # workers for each.
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    for backend, expected in (("fairscale", "heap"), ("torch", "mapping")):
        (result,) = harness.run([harness.Call(_heap_or_mapping, (backend, tmp_path))], out=tmp_path / backend)
        assert result.check().values == [(expected, "heap")] * 2, (backend, result.describe())


# --- Through `tango run`: a checkpoint of other parameters, tampered files -------------------------------


def _cli_config(num_blocks: int, resume_from: Optional[Path] = None) -> Dict[str, Any]:
    """The toy regressor with ``num_blocks`` blocks, each a unit, on the torch backend."""
    engine: Dict[str, Any] = {"backend": "torch"}
    if resume_from is not None:
        engine["resume_from_checkpoint"] = str(resume_from)
    return train_config(
        engine="fairscale",
        wrap="nested",
        model=toy_model(num_blocks=num_blocks),
        callbacks=[],
        engine_extra=engine,
    )


@pytest.fixture(scope="module")
def three_blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete torch-backend checkpoint of the 3-block model on 2 workers (tests.harness)."""
    work_dir = tmp_path_factory.mktemp("three_blocks") / "work"
    harness.train(_cli_config(3), work_dir)
    return work_dir / "checkpoint_state_step12"


@pytest.mark.extended
@pytest.mark.parametrize("blocks", [2, 4])
def test_a_checkpoint_of_fewer_or_more_blocks_is_one_line_through_tango_run(
    three_blocks: Path, tmp_path: Path, blocks: int
) -> None:
    # Into 2 blocks DCP loaded the common parameters and trained on (exit 0); into 4, 174 lines of
    # DCP's CheckpointException.
    result = run_tango(_cli_config(blocks, three_blocks), tmp_path / "ws", cwd=tmp_path / "cwd", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    error = one_line_error(output)
    print(f"3 blocks resumed into {blocks}, exit {result.returncode}: {error}")
    assert error.startswith(f"CheckpointError: {three_blocks} was saved from a model with other parameters: ")
    if blocks == 2:
        assert "2 in it are not this model's (blocks.2.linear.bias, blocks.2.linear.weight)" in error
        assert "of this model's are not in it" not in error
    else:
        assert "2 of this model's are not in it (blocks.3.linear.bias, blocks.3.linear.weight)" in error
        assert "are not this model's" not in error
    assert (
        "CheckpointException" not in output and not (train_work_dir(tmp_path / "ws") / "weights.pt").exists()
    )


@pytest.mark.extended
@pytest.mark.parametrize("tampering", list(TAMPERED_CASES))
def test_tampered_files_with_matching_digests_are_one_line_through_tango_run(
    three_blocks: Path, tmp_path: Path, tampering: str
) -> None:
    marker = tmp_path / "payload_ran"
    copy = tmp_path / "tampered"
    _tampered_copy(three_blocks, copy, tampering, marker)
    result = run_tango(_cli_config(3, copy), tmp_path / "ws", cwd=tmp_path / "cwd", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    error = one_line_error(output)
    print(f"{tampering}, exit {result.returncode}: {error}")
    assert error.startswith("CheckpointError: ") and "Nothing in it was run" in error, error
    assert TAMPERED[tampering] in error, error
    assert "CheckpointException" not in output and "metadata is None" not in output
    # The payload never ran.
    assert not marker.exists()


def test_both_backends_write_worker_0s_buffers(tmp_path: Path) -> None:
    # The torch backend's weights.pt held worker 1's BatchNorm statistics where the fairscale
    # backend's holds worker 0's: DCP kept another worker's copy of the buffer.
    from tests.helpers import train_config

    def config(engine: str, backend: Optional[str]) -> Dict[str, Any]:
        extra = {"backend": backend} if backend else None
        return train_config(
            engine=engine, model={"type": "test::batchnorm_regressor"}, callbacks=[], engine_extra=extra
        )

    runs = {
        "ddp": config("torch", None),
        "fairscale": config("fairscale", "fairscale"),
        "torch": config("fairscale", "torch"),
    }
    results = harness.run([harness.Train(c, tmp_path / name) for name, c in runs.items()], out=tmp_path / "h")
    for result in results:
        result.check()
    weights = {name: torch.load(tmp_path / name / "weights.pt", weights_only=True) for name in runs}
    for buffer in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
        assert torch.equal(weights["torch"][buffer], weights["fairscale"][buffer]), buffer
        print(
            buffer,
            "torch - ddp:",
            (weights["torch"][buffer].float() - weights["ddp"][buffer].float()).abs().max(),
        )
