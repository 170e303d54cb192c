"""
Automatic mixed precision on CPU workers: activation checkpointing recomputes under the same
bfloat16 autocast as the forward pass (with this engine and with Tango's DDP engine), and FSDP
mixed precision computes in bfloat16 alongside it. Trained in the test's own workers
(:mod:`tests.harness`, Tango's worker loop).
"""

import json
from pathlib import Path
from typing import Any, Dict

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
