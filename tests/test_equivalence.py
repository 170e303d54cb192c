"""
The heart of the plugin: FSDP on 2 CPU workers trains to the same weights as Tango's own DDP
engine on 2 CPU workers, through the real ``tango`` CLI, with either backend (FairScale's FSDP,
PyTorch's FSDP2), and the two backends to the same weights as each other.
"""

import json
from pathlib import Path
from typing import Dict

import pytest
from tango.integrations.torch.util import set_seed_all
from tango.workspaces import LocalWorkspace

from examples.toy.components import ToyRegressor
from tests.conftest import ToyRun
from tests.helpers import load_weights, max_abs_difference, train_work_dir

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
SEED = 7  # train_config()'s default seed


BACKENDS = ["fairscale", "torch"]
WRAPS = ["root", "nested", "nested_ckpt"]


@pytest.fixture(scope="module")
def ddp_run(toy_run: ToyRun) -> Path:
    return toy_run("torch", "none")


def state_sizes(workspace: Path) -> Dict[int, dict]:
    work_dir = train_work_dir(workspace)
    sizes = [json.loads(p.read_text()) for p in sorted(work_dir.glob("state_sizes_worker*.json"))]
    return {entry["worker"]: entry for entry in sizes}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wrap", WRAPS)
def test_fsdp_matches_ddp(wrap: str, backend: str, ddp_run: Path, toy_run: ToyRun) -> None:
    fsdp_weights = load_weights(toy_run("fairscale", wrap, backend))
    ddp_weights = load_weights(ddp_run)

    # Same keys as the plain model, and loadable into it strictly.
    plain = ToyRegressor(in_features=8, width=32, num_blocks=4)
    plain.load_state_dict(fsdp_weights, strict=True)

    # Training moved the weights away from their initialisation (Tango seeds before building
    # the model), so the equality below is not the two runs merely sharing an init.
    set_seed_all(SEED)
    initial = ToyRegressor(in_features=8, width=32, num_blocks=4).state_dict()
    assert max_abs_difference(fsdp_weights, initial) > 1e-2

    difference = max_abs_difference(fsdp_weights, ddp_weights)
    print(f"[{backend}, {wrap}] max |FSDP - DDP| over all weights: {difference:.3e}")
    assert difference <= TOLERANCE


@pytest.mark.parametrize("wrap", WRAPS)
def test_backends_train_to_the_same_weights(wrap: str, toy_run: ToyRun) -> None:
    fairscale = load_weights(toy_run("fairscale", wrap, "fairscale"))
    torch_fsdp = load_weights(toy_run("fairscale", wrap, "torch"))
    difference = max_abs_difference(fairscale, torch_fsdp)
    print(f"[{wrap}] max |torch backend - fairscale backend|: {difference:.3e}")
    assert difference <= TOLERANCE


@pytest.mark.parametrize("backend", ["fairscale", pytest.param("torch", marks=pytest.mark.extended)])
def test_accumulating_gradients_locally_matches_reducing_each_micro_batch(
    backend: str, toy_run: ToyRun
) -> None:
    """grad_accum 4: one reduce-scatter per optimizer step (no_sync before) against one per micro-batch."""
    reduced = load_weights(toy_run("fairscale", "nested", "fairscale", grad_accum=4))
    local = load_weights(toy_run("fairscale", "nested", backend, grad_accum=4, accumulate_locally=True))
    difference = max_abs_difference(local, reduced)
    print(f"[{backend}] max |accumulated locally - reduced per micro-batch|: {difference:.3e}")
    assert difference <= TOLERANCE
    # Four micro-batches per step trained to other weights than one: the runs saw grad_accum.
    assert max_abs_difference(reduced, load_weights(toy_run("fairscale", "nested", "fairscale"))) > 1e-3


def test_step_result_is_the_trained_model(toy_run: ToyRun) -> None:
    run = toy_run("fairscale", "nested_ckpt", "fairscale")
    workspace = LocalWorkspace(run)
    (run_name,) = workspace.registered_runs().keys()
    model = workspace.step_result_for_run(run_name, "train")
    weights = load_weights(run)
    assert max_abs_difference(model.state_dict(), weights) == 0.0


def test_each_worker_holds_half_of_ddp_state(ddp_run: Path, toy_run: ToyRun) -> None:
    ddp = state_sizes(ddp_run)
    fsdp = state_sizes(toy_run("fairscale", "nested", "fairscale"))
    assert sorted(ddp) == sorted(fsdp) == [0, 1]
    full_params = sum(p.numel() for p in ToyRegressor(in_features=8, width=32, num_blocks=4).parameters())
    for worker in (0, 1):
        assert ddp[worker]["param_numel"] == full_params
        param_ratio = fsdp[worker]["param_numel"] / ddp[worker]["param_numel"]
        optimizer_ratio = fsdp[worker]["optimizer_numel"] / ddp[worker]["optimizer_numel"]
        print(f"worker {worker}: params {param_ratio:.4f} x DDP, optimizer state {optimizer_ratio:.4f} x DDP")
        # Half, plus at most one element of padding per FSDP unit's flat parameter.
        assert 0.5 <= param_ratio <= 0.5 + 6 / full_params
        assert 0.5 <= optimizer_ratio <= 0.5 + 12 / full_params
    # The two halves cover the model exactly once (up to padding).
    assert fsdp[0]["param_numel"] == fsdp[1]["param_numel"]


def test_torch_backend_workers_hold_disjoint_halves(ddp_run: Path, toy_run: ToyRun) -> None:
    ddp = state_sizes(ddp_run)
    fsdp = state_sizes(toy_run("fairscale", "nested", "torch"))
    model = ToyRegressor(in_features=8, width=32, num_blocks=4)
    full_params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    # FSDP2 shards each parameter on dim 0 without padding: the workers' parts add up to the
    # model exactly, and an odd first dimension gives worker 0 one row more.
    assert fsdp[0]["param_numel"] + fsdp[1]["param_numel"] == full_params == ddp[0]["param_numel"]
    assert fsdp[0]["optimizer_numel"] + fsdp[1]["optimizer_numel"] == ddp[0]["optimizer_numel"]
    for worker in (0, 1):
        ratio = fsdp[worker]["param_numel"] / ddp[worker]["param_numel"]
        print(f"worker {worker}: params {ratio:.4f} x DDP")
        assert abs(ratio - 0.5) <= 32 * tensors / full_params
