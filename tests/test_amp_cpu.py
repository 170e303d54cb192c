"""
Automatic mixed precision on CPU workers: activation checkpointing recomputes under the same
bfloat16 autocast as the forward pass (with this engine and with Tango's DDP engine), and FSDP
mixed precision computes in bfloat16 alongside it. Trained in the test's own workers
(:mod:`tests.harness`, Tango's worker loop).
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from tests import harness
from tests.helpers import max_abs_difference, train_config

TOLERANCE = 1e-5


def amp_config(engine: str, checkpointing: bool) -> Dict[str, Any]:
    config = train_config(
        engine=engine,
        wrap="nested_ckpt" if checkpointing else "nested",
        train_steps=6,
        checkpoint_every=6,
        engine_extra={"amp": True, "amp_use_bfloat16": True},
        callbacks=[{"type": "test::record_losses"}],
    )
    model = config["steps"]["train"]["model"]
    if engine == "torch":
        # With DDP the wrapper only checkpoints: no FSDP units.
        model.pop("fsdp_config")
    return config


# The torch backend's variant is extended: test_torch_backend.py checks its checkpoint wrapper's
# recompute under bfloat16 autocast in make test.
@pytest.mark.parametrize("engine", ["fairscale", pytest.param("torch", marks=pytest.mark.extended)])
def test_checkpointing_under_bf16_autocast_matches_plain(engine: str, tmp_path: Path) -> None:
    jobs = [
        harness.Train(amp_config(engine, checkpointing), tmp_path / f"ckpt{checkpointing}")
        for checkpointing in (False, True)
    ]
    for result in harness.run(jobs, out=tmp_path / "harness"):
        result.check()
    weights = {
        checkpointing: torch.load(job.work_dir / "weights.pt", weights_only=True)
        for checkpointing, job in zip((False, True), jobs)
    }
    difference = max_abs_difference(weights[True], weights[False])
    print(f"{engine}: max |checkpointed - plain| under bf16 autocast = {difference:.3e}")
    assert difference <= TOLERANCE


def test_fsdp_mixed_precision_with_amp_trains_layernorm_model(tmp_path: Path) -> None:
    config = train_config(
        engine="fairscale",
        wrap="nested",
        train_steps=12,
        checkpoint_every=12,
        fsdp_config={"mixed_precision": True},
        engine_extra={"amp": True},
        model={"type": "test::norm_regressor", "in_features": 8, "width": 32},
        callbacks=[{"type": "test::record_losses"}],
    )
    harness.train(config, tmp_path / "work")
    losses = json.loads((tmp_path / "work" / "losses.json").read_text())
    values = [losses[str(step)] for step in sorted(int(s) for s in losses)]
    assert len(values) == 12
    assert sum(values[-3:]) < sum(values[:3]), values
    weights = torch.load(tmp_path / "work" / "weights.pt", weights_only=True)
    # The master weights stay float32; only the gathered copies were bfloat16.
    assert all(tensor.dtype.is_floating_point and tensor.element_size() == 4 for tensor in weights.values())


#: ``(grad_accum, accumulate_grads_locally)`` of the one-worker runs.
ONE_WORKER_RUNS = [(1, False), (2, True)]


@pytest.mark.parametrize(
    "grad_accum, locally", ONE_WORKER_RUNS, ids=["one_micro_batch", "accumulated_locally"]
)
def test_one_worker_mixed_precision_steps_float32_master_weights_on_bfloat16_gradients(
    tmp_path: Path, grad_accum: int, locally: bool
) -> None:
    losses, expected = one_worker_mixed_precision(tmp_path, grad_accum, locally, "cpu")
    assert losses == expected


def one_worker_mixed_precision(
    tmp_path: Path, grad_accum: int, locally: bool, device: str
) -> Tuple[List[float], List[float]]:
    """
    The engine's losses with one worker on ``device`` (``"cpu"``, or ``"cuda"`` in test_gpu.py)
    under bfloat16 FSDP mixed precision, and the same mixed precision's by hand.

    With one worker FairScale does not shard, and its cast of the gradients to float32 never
    reached them (F10): AdamW then failed on a bfloat16 gradient beside a float32 parameter.
    Under no_sync (accumulate_grads_locally), FairScale freed the bfloat16 parameters that the
    next micro-batch's forward still used: with one worker the engine no longer enters it.
    Reference: bfloat16 copies computing gradients (of the loss over the step's micro-batches)
    that AdamW applies to float32 master weights.
    """
    import torch.distributed as dist
    from tango.common import Lazy
    from tango.integrations.torch import Optimizer, TrainConfig

    from examples.toy.components import ToyRegressor
    from tango_fairscale import FairScaleTrainingEngine, FSDPConfig
    from tango_fairscale.launch.teardown import close_process_groups
    from tests.helpers import free_port

    generator = torch.Generator().manual_seed(0)
    data = [
        {"x": torch.randn(16, 8, generator=generator), "y": torch.randn(16, generator=generator)}
        for _ in range(4)
    ]
    steps = [data[i : i + grad_accum] for i in range(0, len(data), grad_accum)]

    def toy() -> ToyRegressor:
        torch.manual_seed(0)
        return ToyRegressor(in_features=8, width=32, num_blocks=2)

    master = toy().to(device)
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-2)
    expected = []
    for micro_batches in steps:
        copy = toy().to(device, torch.bfloat16)
        copy.load_state_dict(master.state_dict())
        sums = [torch.zeros_like(parameter) for parameter in master.parameters()]
        for batch in micro_batches:
            copy.zero_grad()
            with torch.autocast(device, dtype=torch.bfloat16):
                inputs = {name: value.to(device, torch.bfloat16) for name, value in batch.items()}
                loss = copy(**inputs)["loss"] / grad_accum
            loss.backward()
            for total, low in zip(sums, copy.parameters()):
                assert low.grad is not None
                total += low.grad.float()
            expected.append(loss.item())
        for parameter, total in zip(master.parameters(), sums):
            parameter.grad = total
        optimizer.step()

    config = TrainConfig(
        "one-worker",
        tmp_path,
        is_distributed=True,
        devices=[0 if device == "cuda" else -1],
        world_size=1,
        distributed_port=free_port(),
    )
    mixed = FSDPConfig(mixed_precision=True, compute_dtype="bfloat16")
    try:
        engine = FairScaleTrainingEngine(
            config,
            Lazy(toy, constructor_extras={}),  # type: ignore[arg-type]
            Lazy(Optimizer.by_name("torch::AdamW"), constructor_extras={"lr": 1e-2}),  # type: ignore[arg-type]
            amp=True,
            amp_use_bfloat16=True,
            fsdp_config=mixed,
            accumulate_grads_locally=locally,
        )
        losses = []
        for micro_batches in steps:
            for index, batch in enumerate(micro_batches):
                loss, _ = engine.forward_train(batch, index, grad_accum)
                engine.backward(loss)
                assert {p.grad.dtype for p in engine.model.parameters() if p.grad is not None} == {
                    torch.float32
                }
                losses.append(loss.item())
            engine.step()
    finally:
        if dist.is_initialized():
            close_process_groups()
    return losses, expected
