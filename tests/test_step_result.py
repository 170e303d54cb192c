"""
The end of a run: the step's result (built in Tango's main process on ``meta``, the weights
assigned, :mod:`tango_fairscale.step_result`) and ``weights.pt`` (streamed from the shards,
:mod:`tango_fairscale.consolidation`), on a model whose output head is tied to its embedding.
"""

from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import torch.nn as nn
from tango.common import Params
from tango.workspaces import LocalWorkspace

from tango_fairscale import checkpointing, consolidation
from tango_fairscale.step_result import FinalModelOnMeta, assign_state_dict
from tests import harness
from tests.components import TiedLM
from tests.helpers import REPO, run_tango, train_work_dir

BACKENDS = ["fairscale", "torch"]


def _tied_config(backend: str) -> Dict[str, Any]:
    """The run scripts/repeat_run.py repeats: a tied LM, each block a unit, init_on_meta."""
    return Params.from_file(
        REPO / "scripts" / "configs" / "tied_lm.jsonnet", ext_vars={"backend": backend}
    ).as_dict()


def _check_weights(work: Path) -> Dict[str, torch.Tensor]:
    """``weights.pt`` of a tied model's run: the head still the embedding, and equal to the
    in-memory consolidation of the same checkpoint."""
    weights = torch.load(work / "weights.pt", weights_only=True)
    assert torch.equal(weights["head.weight"], weights["embed.weight"])
    whole = consolidation.consolidate(checkpointing.resolve_checkpoint(work))
    assert list(whole) == list(weights)
    assert max((whole[k] - weights[k]).abs().max().item() for k in weights) == 0.0
    return weights


@pytest.fixture(scope="module")
def in_process_runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """The tied run of each backend, in the test's own workers (tests.harness, Tango's worker loop)."""
    root = tmp_path_factory.mktemp("tied")
    jobs = {backend: harness.Train(_tied_config(backend), root / backend) for backend in BACKENDS}
    for result in harness.run(list(jobs.values()), out=root / "harness"):
        result.check()
    return {backend: job.work_dir for backend, job in jobs.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_model_weights(in_process_runs: Dict[str, Path], backend: str) -> None:
    weights = _check_weights(in_process_runs[backend])
    TiedLM().load_state_dict(weights, strict=True)


#: Through the CLI, where the main process builds the step's result: extended. make test builds a
#: step's result through the CLI in tests/test_equivalence.py::test_step_result_is_the_trained_model
#: and keeps ties at library level (test_assign_state_dict_adopts_the_tensors_and_keeps_ties below);
#: the tied model's weights.pt is test_tied_model_weights's.
@pytest.mark.extended
@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_tied_model_result_and_weights(tmp_path: Path, backend: str) -> None:
    run_tango(_tied_config(backend), tmp_path / "ws", cwd=tmp_path / "cwd")
    work = train_work_dir(tmp_path / "ws")
    weights = _check_weights(work)
    workspace = LocalWorkspace(tmp_path / "ws")
    (run_name,) = workspace.registered_runs().keys()
    model = workspace.step_result_for_run(run_name, "train")
    # The result is the trained model: weights.pt's values, its head still tied to its embedding.
    assert isinstance(model, TiedLM)
    assert model.head.weight is model.embed.weight
    assert not any(p.is_meta for p in model.parameters())
    state = model.state_dict()
    assert state.keys() == weights.keys()
    assert max((state[k] - weights[k]).abs().max().item() for k in weights) == 0.0


def test_assign_state_dict_adopts_the_tensors_and_keeps_ties() -> None:
    trained = TiedLM()
    state = {name: tensor.clone() for name, tensor in trained.state_dict().items()}
    state["head.weight"] = state["embed.weight"]  # as torch.load gives a tied pair: one storage
    from tango_fairscale.materialize import parameters_on_meta

    with parameters_on_meta():
        model = TiedLM()
    assert all(p.is_meta for p in model.parameters())
    assign_state_dict(model, state)
    assert model.head.weight is model.embed.weight
    # Adopted, not copied: the parameter's memory is the loaded tensor's.
    assert model.embed.weight.data_ptr() == state["embed.weight"].data_ptr()
    assert model.blocks[0][1].weight.data_ptr() == state["blocks.0.1.weight"].data_ptr()
    assert all(p.requires_grad for p in model.parameters())


def test_a_parameter_missing_from_the_weights_is_initialised_not_left_on_meta(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tango_fairscale.materialize import parameters_on_meta

    state = {k: v for k, v in TiedLM().state_dict().items() if k != "blocks.2.1.bias"}
    with parameters_on_meta():
        model = TiedLM()
    assign_state_dict(model, state)
    assert not any(p.is_meta for p in model.parameters())
    assert "blocks.2.1.bias" in caplog.text


def test_final_model_on_meta_pickles_as_the_lazy_it_wraps() -> None:
    import pickle

    from tango.common import Lazy

    lazy = Lazy(nn.Linear, in_features=3, out_features=2)
    wrapped = FinalModelOnMeta(lazy)
    again = pickle.loads(pickle.dumps(wrapped))
    assert type(again) is Lazy and again.construct().weight.shape == (2, 3)
    built = wrapped.construct()
    assert built.weight.is_meta
    built.load_state_dict({"weight": torch.ones(2, 3), "bias": torch.zeros(2)})
    assert torch.equal(built.weight, torch.ones(2, 3)) and "load_state_dict" not in vars(built)
