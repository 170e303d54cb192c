"""
The heart of the plugin: FSDP on 2 CPU workers trains to the same weights as Tango's own DDP
engine on 2 CPU workers, with either backend (FairScale's FSDP, PyTorch's FSDP2).

Through the real ``tango`` CLI once per backend (nested units with activation checkpointing,
against a DDP run through the CLI); the other wrappings, gradient accumulation and the state each
worker holds in the test's own workers (:mod:`tests.harness`, Tango's worker loop), against a DDP
run there.
"""

import json
from pathlib import Path
from typing import Dict

import pytest
from tango.integrations.torch.util import set_seed_all
from tango.workspaces import LocalWorkspace

from examples.toy.components import ToyRegressor
from tests.conftest import ToyRun, ToyTrain
from tests.helpers import load_weights, max_abs_difference

TOLERANCE = 1e-5
SEED = 7  # train_config()'s default seed


BACKENDS = ["fairscale", "torch"]
#: Through the CLI: the wrapping with the most machinery (units, activation checkpointing).
CLI_WRAP = "nested_ckpt"
#: In the test's own workers.
WRAPS = ["root", "nested"]
DDP = ("torch", "none")
#: Every run the in-process tests of make test read, trained in one start of the workers.
IN_PROCESS = [
    DDP,
    *(("fairscale", wrap, backend) for wrap in WRAPS for backend in BACKENDS),
    ("fairscale", CLI_WRAP, "fairscale"),
    ("fairscale", "nested", "fairscale", 4),
    ("fairscale", "nested", "fairscale", 4, True),
]


@pytest.fixture(scope="module")
def trained(toy_train: ToyTrain) -> ToyTrain:
    toy_train.prepare(IN_PROCESS)
    return toy_train


def weights(work_dir: Path) -> Dict:
    import torch

    return torch.load(work_dir / "weights.pt", map_location="cpu", weights_only=True)


def assert_matches_ddp(fsdp_weights: Dict, ddp_weights: Dict, label: str) -> None:
    # Same keys as the plain model, and loadable into it strictly.
    plain = ToyRegressor(in_features=8, width=32, num_blocks=4)
    plain.load_state_dict(fsdp_weights, strict=True)

    # Training moved the weights away from their initialisation (Tango seeds before building
    # the model), so the equality below is not the two runs merely sharing an init.
    set_seed_all(SEED)
    initial = ToyRegressor(in_features=8, width=32, num_blocks=4).state_dict()
    assert max_abs_difference(fsdp_weights, initial) > 1e-2

    difference = max_abs_difference(fsdp_weights, ddp_weights)
    print(f"[{label}] max |FSDP - DDP| over all weights: {difference:.3e}")
    assert difference <= TOLERANCE


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp_matches_ddp_through_the_cli(backend: str, toy_run: ToyRun) -> None:
    assert_matches_ddp(
        load_weights(toy_run("fairscale", CLI_WRAP, backend)),
        load_weights(toy_run(*DDP)),
        f"{backend}, {CLI_WRAP}",
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wrap", WRAPS)
def test_fsdp_matches_ddp(wrap: str, backend: str, trained: ToyTrain) -> None:
    assert_matches_ddp(
        weights(trained("fairscale", wrap, backend)), weights(trained(*DDP)), f"{backend}, {wrap}, in process"
    )


@pytest.mark.parametrize("wrap", WRAPS)
def test_the_backends_train_to_the_same_weights(wrap: str, trained: ToyTrain) -> None:
    """Each backend equals DDP; here they are compared with each other directly (the same runs)."""
    difference = max_abs_difference(
        weights(trained("fairscale", wrap, "torch")), weights(trained("fairscale", wrap, "fairscale"))
    )
    print(f"[{wrap}, in process] max |torch backend - fairscale backend|: {difference:.3e}")
    assert difference <= TOLERANCE


def test_in_process_training_is_the_tango_runs(trained: ToyTrain, toy_run: ToyRun) -> None:
    """What the in-process tests rest on: the harness trains to a ``tango run``'s weights."""
    in_process = weights(trained("fairscale", CLI_WRAP, "fairscale"))
    assert max_abs_difference(in_process, load_weights(toy_run("fairscale", CLI_WRAP, "fairscale"))) == 0.0


@pytest.mark.parametrize("backend", ["fairscale", pytest.param("torch", marks=pytest.mark.extended)])
def test_accumulating_gradients_locally_matches_reducing_each_micro_batch(
    backend: str, trained: ToyTrain
) -> None:
    """grad_accum 4: one reduce-scatter per optimizer step (no_sync before) against one per micro-batch."""
    reduced = weights(trained("fairscale", "nested", "fairscale", 4))
    local = weights(trained("fairscale", "nested", backend, 4, True))
    difference = max_abs_difference(local, reduced)
    print(f"[{backend}] max |accumulated locally - reduced per micro-batch|: {difference:.3e}")
    assert difference <= TOLERANCE
    # Four micro-batches per step trained to other weights than one: the runs saw grad_accum.
    assert max_abs_difference(reduced, weights(trained("fairscale", "nested", "fairscale"))) > 1e-3


def test_step_result_is_the_trained_model(toy_run: ToyRun) -> None:
    run = toy_run("fairscale", CLI_WRAP, "fairscale")
    workspace = LocalWorkspace(run)
    (run_name,) = workspace.registered_runs().keys()
    model = workspace.step_result_for_run(run_name, "train")
    assert max_abs_difference(model.state_dict(), load_weights(run)) == 0.0


def state_sizes(work_dir: Path) -> Dict[int, dict]:
    sizes = [json.loads(p.read_text()) for p in sorted(work_dir.glob("state_sizes_worker*.json"))]
    return {entry["worker"]: entry for entry in sizes}


def test_each_worker_holds_half_of_ddp_state(trained: ToyTrain) -> None:
    ddp = state_sizes(trained(*DDP))
    fsdp = state_sizes(trained("fairscale", "nested", "fairscale"))
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


def test_torch_backend_workers_hold_disjoint_halves(trained: ToyTrain) -> None:
    ddp = state_sizes(trained(*DDP))
    fsdp = state_sizes(trained("fairscale", "nested", "torch"))
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_python_api_finds_and_reads_a_tango_runs_outputs(backend: str, toy_run: ToyRun) -> None:
    """``train_outputs`` by the step's name, ``read_weights`` and ``read_checkpoint`` of either backend."""
    from tango_fairscale import read_checkpoint, read_weights, train_outputs
    from tests.helpers import train_work_dir

    run = toy_run("fairscale", CLI_WRAP, backend)
    workspace = LocalWorkspace(run)
    (run_name,) = workspace.registered_runs().keys()
    outputs = train_outputs(workspace, "train")
    assert outputs == train_outputs(workspace, "train", run=run_name)
    assert outputs.work_dir == train_work_dir(run)
    assert outputs.metrics == outputs.work_dir / "metrics.jsonl" and outputs.export_hf is None
    assert (
        outputs.latest_checkpoint is not None and outputs.latest_checkpoint.name == "checkpoint_state_step12"
    )
    weights = read_weights(outputs.weights)  # type: ignore[arg-type]
    assert max_abs_difference(weights, load_weights(run)) == 0.0
    # The last step was checkpointed: the checkpoint, consolidated, is weights.pt (and so by work dir).
    assert max_abs_difference(read_checkpoint(outputs.latest_checkpoint), weights) == 0.0
    assert max_abs_difference(read_checkpoint(outputs.work_dir), weights) == 0.0
    with_optimizer = read_checkpoint(outputs.work_dir, with_optimizer=True)
    assert set(with_optimizer) == {"model", "optimizer"}
    with pytest.raises(KeyError, match="no step named 'nope'"):
        train_outputs(workspace, "nope")
