"""
GPU paths (NCCL, world size 1), on both backends: float32 training equal to plain training, AMP
float16 with each backend's grad scaler, mixed precision, CPU offload, a checkpoint consolidated
from GPU shards, and LoRA on a pretrained Llama's units. Skipped without CUDA.
"""

from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from tango.common import Lazy
from tango.integrations.torch import Model, Optimizer, TrainConfig

from examples.toy.components import ToyRegressor
from tango_fairscale import FairScaleTrainingEngine, FSDPConfig
from tango_fairscale.backends.fairscale_fsdp import resharding
from tango_fairscale.launch.teardown import close_process_groups
from tests.conftest import TinyPretrained
from tests.helpers import free_port, pretrained_name
from tests.test_amp_cpu import ONE_WORKER_RUNS, one_worker_mixed_precision

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
    """The toy regressor (4 blocks, not wrapped: one root unit) under the engine, Adam at 1e-3."""
    torch.manual_seed(0)
    return FairScaleTrainingEngine(
        config,
        Lazy(lambda: ToyRegressor(in_features=8, width=64, num_blocks=4), constructor_extras={}),  # type: ignore
        Lazy(Optimizer.by_name("torch::Adam"), constructor_extras={"lr": 1e-3}),  # type: ignore[arg-type]
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


def train_under_scaler(
    engine: FairScaleTrainingEngine, data: List[Dict[str, torch.Tensor]]
) -> Tuple[List[float], List[bool]]:
    """:func:`train` under float16 loss scaling: the losses, and which steps the scaler skipped."""
    losses, skipped = [], []
    for batch in data:
        scale = engine.grad_scaler.get_scale()
        losses.extend(train(engine, [batch]))
        # The scaler halves its scale exactly when it skips a step (inf or NaN gradients); it would
        # grow it only after 2,000 steps without one.
        skipped.append(engine.grad_scaler.get_scale() < scale)
    return losses, skipped


def reference_losses(
    data: List[Dict[str, torch.Tensor]], skipped: Optional[List[bool]] = None
) -> List[float]:
    """Plain float32 training of the same toy; the steps in ``skipped`` computed but not taken."""
    torch.manual_seed(0)
    model: Model = ToyRegressor(in_features=8, width=64, num_blocks=4).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for index, batch in enumerate(data):
        optimizer.zero_grad()
        loss = model(**{k: v.cuda() for k, v in batch.items()})["loss"]
        loss.backward()
        if not (skipped and skipped[index]):
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


#: float16 compute against float32 training of the same model on the same batches, with the steps
#: that loss scaling skipped (its first scale, 65,536, overflows float16 gradients) skipped there
#: too: each loss within this fraction of the float32 run's (the toy's losses are of order 1, and
#: float16 keeps about 3 significant digits per operation).
HALF_PRECISION_RELATIVE_TOLERANCE = 0.05


def test_amp_fp16_uses_sharded_grad_scaler(train_config: TrainConfig) -> None:
    from fairscale.optim.grad_scaler import ShardedGradScaler

    data = batches(20)
    engine = make_engine(train_config, amp=True, fsdp_config=FSDPConfig(mixed_precision=True))
    assert isinstance(engine.grad_scaler, ShardedGradScaler)
    losses, skipped = train_under_scaler(engine, data)
    assert skipped.count(False) >= len(data) // 2, skipped
    assert losses == pytest.approx(reference_losses(data, skipped), rel=HALF_PRECISION_RELATIVE_TOLERANCE)


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


# --- the torch backend (FSDP2) ---------------------------------------------------------------------


def test_torch_backend_fp32_matches_plain_training(train_config: TrainConfig) -> None:
    data = batches(8)
    # max_grad_norm runs the sharded norm's collectives on NCCL; the toy's gradient norms stay below
    # 10 (at most 7.0 on these batches), so the unclipped reference is the same training.
    engine = make_engine(train_config, backend="torch", max_grad_norm=10.0)
    assert dist.get_backend() == "nccl"
    assert all(p.device.type == "cuda" for p in engine.model.parameters())
    losses = train(engine, data)
    assert losses == pytest.approx(reference_losses(data), abs=1e-5)


def test_torch_backend_amp_fp16_uses_the_grad_scaler(train_config: TrainConfig) -> None:
    data = batches(20)
    engine = make_engine(
        train_config, backend="torch", amp=True, fsdp_config=FSDPConfig(mixed_precision=True)
    )
    # FSDP2 reduces gradients before the step, so torch's plain GradScaler sees whole gradients.
    assert type(engine.grad_scaler) is torch.amp.GradScaler
    losses, skipped = train_under_scaler(engine, data)
    assert skipped.count(False) >= len(data) // 2, skipped
    assert losses == pytest.approx(reference_losses(data, skipped), rel=HALF_PRECISION_RELATIVE_TOLERANCE)


def test_torch_backend_bfloat16_mixed_precision(train_config: TrainConfig) -> None:
    data = batches(20)
    engine = make_engine(
        train_config,
        backend="torch",
        amp=True,
        amp_use_bfloat16=True,
        fsdp_config=FSDPConfig(mixed_precision=True, compute_dtype="bfloat16"),
    )
    assert engine.grad_scaler is None  # bfloat16 has float32's range: no loss scaling
    losses = train(engine, data)
    # bfloat16 keeps 8 bits of mantissa (float16 10): the same relative bound holds on these losses.
    assert losses == pytest.approx(reference_losses(data), rel=HALF_PRECISION_RELATIVE_TOLERANCE)
    # The float32 master shards stay float32.
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())


@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_checkpoint_of_gpu_shards_consolidates_to_the_trained_model(
    train_config: TrainConfig, backend: str
) -> None:
    from tango_fairscale import checkpointing
    from tango_fairscale.checkpointing.consolidation import consolidate

    data = batches(6)
    engine = make_engine(train_config, backend=backend)
    train(engine, data)
    directory = train_config.work_dir / "ckpt"
    engine.save_checkpoint(directory, {"training_steps": 6})
    dist.barrier()
    torch.manual_seed(0)
    reference = ToyRegressor(in_features=8, width=64, num_blocks=4).cuda()
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    for batch in data:
        optimizer.zero_grad()
        reference(**{k: v.cuda() for k, v in batch.items()})["loss"].backward()
        optimizer.step()
    checkpointing.require_complete(directory)
    full = consolidate(directory)
    assert set(full) == set(reference.state_dict())
    for name, tensor in reference.state_dict().items():
        assert full[name].device.type == "cpu"
        assert torch.allclose(full[name], tensor.cpu(), atol=1e-5), name


# --- LoRA: frozen base and trainable adapters in one unit ---------------------------------------------


def _lora_model(directory: Path) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(directory, attention_dropout=0.0)
    return get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    )


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_lora_units_train_as_plain_peft_on_the_gpu(
    train_config: TrainConfig, tiny_pretrained: TinyPretrained, backend: str, precision: str
) -> None:
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from tango_fairscale import with_wrapped_modules
    from tango_fairscale.checkpointing.consolidation import consolidate
    from tests.helpers import TINY_LLAMA

    llama = tiny_pretrained(TINY_LLAMA, seed=5)
    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(4):
        tokens = torch.randint(TINY_LLAMA["vocab_size"], (4, 16), generator=generator)
        data.append({"input_ids": tokens, "labels": tokens})

    torch.manual_seed(0)
    plain = _lora_model(llama).cuda()
    optimizer = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=0.01)
    expected = []
    for batch in data:
        optimizer.zero_grad()
        loss = plain(**{k: v.cuda() for k, v in batch.items()}).loss
        loss.backward()
        optimizer.step()
        expected.append(loss.item())

    # bfloat16: the recipe's settings, FSDP mixed precision on the units and the root under
    # bfloat16 autocast, the frozen base gathered in bfloat16 beside the adapters' float32 masters.
    half = precision == "bfloat16"
    fsdp = FSDPConfig(mixed_precision=True, compute_dtype="bfloat16") if half else FSDPConfig()
    torch.manual_seed(0)
    engine = FairScaleTrainingEngine(
        train_config,
        Lazy(  # type: ignore[arg-type]
            lambda: with_wrapped_modules(
                _lora_model(llama), wrap_module_classes=["LlamaDecoderLayer"], fsdp_config=fsdp
            ),
            constructor_extras={},
        ),
        Lazy(Optimizer.by_name("torch::AdamW"), constructor_extras={"lr": 0.01}),  # type: ignore[arg-type]
        backend=backend,
        amp=half,
        amp_use_bfloat16=half,
        fsdp_config=fsdp,
    )
    losses = train(engine, data)
    if half:
        assert losses == pytest.approx(expected, rel=HALF_PRECISION_RELATIVE_TOLERANCE)
    else:
        assert losses == pytest.approx(expected, abs=1e-5)

    # The frozen base is the pretrained file's, bit for bit (no low-precision copy written back);
    # the adapters moved (lora_B starts at zero).
    engine.save_checkpoint(train_config.work_dir / "ckpt", {"training_steps": len(data)})
    dist.barrier()
    full = consolidate(train_config.work_dir / "ckpt")
    start = load_file(str(llama / "model.safetensors"))
    base = {pretrained_name(key): value for key, value in full.items()}
    assert all(torch.equal(base[name], start[name]) for name in start)
    assert all(value.abs().sum() > 0 for name, value in full.items() if "lora_B" in name)


@pytest.mark.parametrize(
    "grad_accum, locally", ONE_WORKER_RUNS, ids=["one_micro_batch", "accumulated_locally"]
)
def test_one_worker_bfloat16_mixed_precision_on_the_gpu(
    tmp_path: Path, grad_accum: int, locally: bool
) -> None:
    # The CPU test's run (test_amp_cpu.py) on the GPU: the same steps as bfloat16 copies by hand.
    losses, expected = one_worker_mixed_precision(tmp_path, grad_accum, locally, "cuda")
    assert losses == expected
