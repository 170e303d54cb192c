"""
GPU paths (NCCL, world size 1): AMP float16 with the sharded grad scaler, FSDP mixed
precision, and CPU offload. Skipped without CUDA.
"""

from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist
from tango.common import Lazy
from tango.integrations.torch import Model, Optimizer, TrainConfig

from examples.toy.components import ToyRegressor
from tango_fairscale import FairScaleTrainingEngine, FSDPConfig
from tango_fairscale.backends.fairscale_fsdp import resharding
from tango_fairscale.teardown import close_process_groups
from tests.helpers import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def train_config(tmp_path: Path) -> Iterator[TrainConfig]:
    config = TrainConfig(
        "gpu-test",
        tmp_path,
        is_distributed=True,
        devices=[0],
        world_size=1,
        distributed_port=free_port(),
    )
    yield config
    if dist.is_initialized():
        close_process_groups()


def batches(count: int) -> List[Dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {"x": torch.randn(16, 8, generator=generator), "y": torch.randn(16, generator=generator)}
        for _ in range(count)
    ]


def make_engine(config: TrainConfig, **kwargs: Any) -> FairScaleTrainingEngine:
    torch.manual_seed(0)
    return FairScaleTrainingEngine(
        config,
        Lazy(lambda: ToyRegressor(in_features=8, width=64, num_blocks=4), constructor_extras={}),  # type: ignore
        Lazy(Optimizer.by_name("torch::Adam"), params={"lr": 1e-3}),  # type: ignore[arg-type]
        **kwargs,
    )


def train(engine: FairScaleTrainingEngine, data: List[Dict[str, torch.Tensor]]) -> List[float]:
    losses = []
    for batch in data:
        loss, _ = engine.forward_train(batch, 0, 1)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def reference_losses(data: List[Dict[str, torch.Tensor]]) -> List[float]:
    torch.manual_seed(0)
    model: Model = ToyRegressor(in_features=8, width=64, num_blocks=4).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for batch in data:
        optimizer.zero_grad()
        loss = model(**{k: v.cuda() for k, v in batch.items()})["loss"]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_fp32_matches_plain_training(train_config: TrainConfig) -> None:
    data = batches(8)
    engine = make_engine(train_config, max_grad_norm=10.0)
    assert engine.model.compute_device.type == "cuda"  # type: ignore[union-attr]
    assert dist.get_backend() == "nccl"
    losses = train(engine, data)
    assert losses == pytest.approx(reference_losses(data), abs=1e-5)


#: float16 compute against float32 training of the same model on the same batches: each loss
#: within this fraction of the float32 run's (the toy's losses are of order 1, and float16 keeps
#: about 3 significant digits per operation).
HALF_PRECISION_RELATIVE_TOLERANCE = 0.05


def test_amp_fp16_uses_sharded_grad_scaler(train_config: TrainConfig) -> None:
    from fairscale.optim.grad_scaler import ShardedGradScaler

    data = batches(20)
    engine = make_engine(train_config, amp=True, fsdp_config=FSDPConfig(mixed_precision=True))
    assert isinstance(engine.grad_scaler, ShardedGradScaler)
    losses = train(engine, data)
    assert engine.grad_scaler.get_scale() > 0
    assert losses == pytest.approx(reference_losses(data), rel=HALF_PRECISION_RELATIVE_TOLERANCE)


def test_cpu_offload_checkpoint_and_consolidate(train_config: TrainConfig) -> None:
    data = batches(10)
    engine = make_engine(train_config, fsdp_config=FSDPConfig(move_params_to_cpu=True))
    losses = train(engine, data)
    # Offloading moves where the float32 shards live, not what is computed.
    assert losses == pytest.approx(reference_losses(data), abs=1e-5)
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    engine.save_checkpoint(train_config.work_dir / "ckpt", {"training_steps": 10})
    full = resharding.consolidate_model_state(resharding.load_model_shards(train_config.work_dir / "ckpt"))
    ToyRegressor(in_features=8, width=64, num_blocks=4).load_state_dict(full, strict=True)
