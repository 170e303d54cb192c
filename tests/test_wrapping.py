import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn as nn
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from tango.common import Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import Model

from examples.toy.components import ToyRegressor
from tango_fairscale import FSDPConfig, WrapPlan, compat, plan_wrapping, with_wrapped_modules
from tests import harness
from tests.helpers import (
    load_weights,
    max_abs_difference,
    one_line_error,
    run_tango,
    train_config,
    train_work_dir,
)


def toy() -> ToyRegressor:
    torch.manual_seed(0)
    return ToyRegressor(in_features=4, width=8, num_blocks=3)


def batch() -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"x": torch.randn(5, 4, generator=generator), "y": torch.randn(5, generator=generator)}


def test_from_config_without_process_group_applies_checkpointing_only() -> None:
    model = Model.from_params(
        Params(
            {
                "type": "fairscale::with_wrapped_modules",
                "model": {"type": "toy::regressor", "in_features": 4, "width": 8, "num_blocks": 3},
                "modules_to_wrap": ["blocks\\.[0-9]+", "head"],
                "fsdp_config": {"reshard_after_forward": True},
                "activation_checkpointing": True,
            }
        )
    )
    assert not any(isinstance(m, FSDP) for m in model.modules())
    # Keys stay those of the plain model.
    assert set(model.state_dict()) == set(toy().state_dict())


def test_checkpointing_keeps_outputs_and_gradients() -> None:
    plain, wrapped = toy(), with_wrapped_modules(toy(), {"blocks\\.[0-9]+"}, activation_checkpointing=True)
    losses = []
    for model in (plain, wrapped):
        loss = model(**batch())["loss"]
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert a.grad is not None and b.grad is not None, name
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("silenced", [False, True])
def test_no_false_gradients_warning(silenced: bool) -> None:
    # The checkpointed module's input (the raw features) does not require grad: torch's
    # check warns although the module's parameters do get gradients.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if silenced:
            compat.silence_internal_warnings()
        model = with_wrapped_modules(toy(), {"input"}, activation_checkpointing=True)
        model(**batch())["loss"].backward()
    false_warnings = [w for w in caught if "Gradients will be None" in str(w.message)]
    assert len(false_warnings) == (0 if silenced else 1)
    assert model.input.weight.grad is not None and model.input.weight.grad.abs().sum() > 0


def test_selection_by_class_and_size() -> None:
    model = toy()
    assert plan_wrapping(model, wrap_module_classes=["FeedForward"]) == ["blocks.0", "blocks.1", "blocks.2"]
    # Each block has 8*8+8 = 72 parameters; the smallest modules holding >= 60 are the blocks' linears.
    assert plan_wrapping(model, min_num_params=60) == [
        "blocks.0.linear",
        "blocks.1.linear",
        "blocks.2.linear",
    ]


def test_overlapping_selection_nests_deepest_first() -> None:
    assert plan_wrapping(toy(), {"blocks", "blocks\\.[0-9]+"}) == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks",
    ]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"modules_to_wrap": {"blocks\\.[0-9"}}, "'blocks\\\\.[0-9' is not a valid regular expression"),
        ({"modules_to_wrap": {"block\\.[0-9]+"}}, "'block\\\\.[0-9]+' matches no submodule of ToyRegressor"),
        ({"modules_to_wrap": {".*"}}, "matches the root module"),
        ({"wrap_module_classes": ["GPT2Block"]}, "no submodule of ToyRegressor has class 'GPT2Block'"),
        ({"wrap_module_classes": ["ToyRegressor"]}, "is only the root module's own class"),
        ({"modules_to_wrap": set()}, "nothing to wrap"),
        ({"min_num_params": 0}, "min_num_params: must be a positive integer"),
    ],
)
def test_bad_wrapping_is_a_configuration_error(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        with_wrapped_modules(toy(), **kwargs)
    assert fragment in str(error.value)


def test_unmatched_pattern_lists_near_names() -> None:
    with pytest.raises(ConfigurationError) as error:
        with_wrapped_modules(toy(), {"blocks\\.[0-9]+", "heads"})
    assert "'heads' matches no submodule" in str(error.value)
    assert "'head'" in str(error.value)


def test_model_without_parameters() -> None:
    class Empty(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.ReLU()

    with pytest.raises(ConfigurationError, match=r"\(Empty\) has no parameters"):
        with_wrapped_modules(Empty(), {"inner"})  # type: ignore[arg-type]


def test_wrap_errors_are_also_value_errors() -> None:
    # ai2-tango's bundled integration raised ValueError for a pattern matching nothing.
    with pytest.raises(ValueError, match="matches no submodule"):
        with_wrapped_modules(ToyRegressor(), modules_to_wrap=["nothing\\.here"])
    with pytest.raises(ConfigurationError, match="matches no submodule"):
        with_wrapped_modules(ToyRegressor(), modules_to_wrap=["nothing\\.here"])


def test_wrap_plan_is_the_one_selection() -> None:
    from tango_fairscale import WrapPlan

    model = ToyRegressor(in_features=8, width=16, num_blocks=3)
    plan = WrapPlan.build(model, ["blocks", "blocks\\.[0-9]+"], activation_checkpointing=True)
    # Deepest first; only the outermost selected module is checkpointed.
    assert plan.selected == ("blocks.0", "blocks.1", "blocks.2", "blocks")
    assert plan.checkpointed == frozenset({"blocks"})
    assert plan.fsdp_units == plan.selected
    assert WrapPlan.build(model, ["blocks"], fsdp=False).fsdp_units == ()


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_a_tie_split_across_units_is_refused_naming_it() -> None:
    model = _TiedLM()
    # The embedding a unit of its own, the head (tied to it) in the root: two copies.
    plan = WrapPlan.build(model, ["embed", "blocks\\.[0-9]+"])
    with pytest.raises(ConfigurationError) as error:
        plan.check_shared_parameters(model)
    message = str(error.value)
    assert "embed.weight in FSDP unit 'embed'" in message and "head.weight in the root FSDP unit" in message
    assert "\n" not in message
    # Both uses in one unit (here: the root), or a unit around both: kept tied, accepted.
    WrapPlan.build(model, ["blocks\\.[0-9]+"]).check_shared_parameters(model)
    # The refusal comes from the wrapper too, whichever the backend (it runs before deferral).
    with pytest.raises(ConfigurationError, match="would be split across FSDP units"):
        with_wrapped_modules(_TiedLM(), {"embed"}, fsdp_config=FSDPConfig())


def test_frozen_and_trainable_parameters_in_one_flat_unit_are_refused() -> None:
    model = _TiedLM()
    model.blocks[0].weight.requires_grad_(False)
    with_frozen_block = WrapPlan.build(model, ["blocks"])
    with pytest.raises(ConfigurationError) as error:
        with_frozen_block.check_uniform_requires_grad(model, units=True, root=True)
    message = str(error.value)
    assert "FSDP unit 'blocks' holds frozen parameters (blocks.0.weight)" in message
    assert "trainable ones (blocks.0.bias, blocks.1.bias, blocks.1.weight)" in message
    assert "flatten_parameters: false" in message and "\n" not in message
    # Without flat parameters, or with the frozen layer a unit of its own, it is accepted.
    with_frozen_block.check_uniform_requires_grad(model, units=False, root=True)
    model.blocks[0].bias.requires_grad_(False)
    WrapPlan.build(model, ["blocks\\.[0-9]+"]).check_uniform_requires_grad(model, units=True, root=True)


# --- Through `tango run`: a split tie and frozen parameters in a flat unit ------------------------------


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_a_tied_embedding_as_its_own_unit_is_one_line_through_tango_run(tmp_path: Path, backend: str) -> None:
    # The fairscale backend trained two copies and broke the tie silently (max diff 0.059 in weights.pt).
    config = train_config(
        engine="fairscale",
        wrap="nested",
        model={"type": "test::tied_lm"},
        callbacks=[],
        engine_extra={"backend": backend},
    )
    config["steps"]["data"] = {"type": "test::token_data"}
    config["steps"]["train"]["model"]["modules_to_wrap"] = ["embed", "blocks\\.[0-9]+"]
    result = run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    error = one_line_error(output)
    print(f"[{backend}] exit {result.returncode}: {error}")
    assert error.startswith("WrapConfigurationError: ") and "would be split across FSDP units" in error
    assert "embed.weight in FSDP unit 'embed'" in error and "head.weight in the root FSDP unit" in error
    assert "[rank " not in output  # pre-flight: no worker started


def _partly_frozen(engine: str, modules_to_wrap: Optional[List[str]]) -> Dict[str, Any]:
    """The toy regressor with its input layer and its middle block frozen, checkpoints kept."""
    model = {
        "type": "test::partly_frozen_regressor",
        "in_features": 8,
        "width": 32,
        "num_blocks": 4,
        "frozen": ["input", "blocks.1"],
    }
    config = train_config(
        engine=engine, wrap="nested" if modules_to_wrap else "none", model=model, callbacks=[]
    )
    if modules_to_wrap:
        config["steps"]["train"]["model"]["modules_to_wrap"] = modules_to_wrap
    config["steps"]["train"]["remove_stale_checkpoints"] = False
    return config


FROZEN = ("input.weight", "input.bias", "blocks.1.linear.weight", "blocks.1.linear.bias")


@pytest.mark.slow
@pytest.mark.extended
def test_frozen_input_layer_and_middle_block_under_per_block_units_through_tango_run(tmp_path: Path) -> None:
    # FairScale flattens each unit's parameters into one, which must be all frozen or all trainable:
    # every worker died in FairScale's `expects all parameters to have same requires_grad` (76 lines).
    # Per-block units: the frozen middle block is a unit of its own, the frozen input layer is in
    # the root unit with the trainable head. Refused before any worker starts, in one line.
    result = run_tango(
        _partly_frozen("fairscale", ["blocks\\.[0-9]+"]), tmp_path / "ws", cwd=tmp_path / "cwd", check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    error = one_line_error(output)
    print(f"per-block units, exit {result.returncode}: {error}")
    assert error.startswith("WrapConfigurationError: ")
    assert "root FSDP unit holds frozen parameters (input.bias, input.weight)" in error, error
    assert "trainable ones (head.bias, head.weight)" in error and "flatten_parameters: false" in error, error
    assert "[rank " not in output  # pre-flight: no worker started

    # The fix the line names first, the frozen input layer a unit of its own, trains: frozen
    # parameters bit-identical from checkpoint to checkpoint, the rest equal to DDP's.
    fixed = _partly_frozen("fairscale", ["input", "blocks\\.[0-9]+"])
    run_tango(fixed, tmp_path / "ws_fixed", cwd=tmp_path / "cwd_fixed")
    work_dir = train_work_dir(tmp_path / "ws_fixed")
    from tango_fairscale import consolidation

    step6 = consolidation.consolidate(work_dir / "checkpoint_state_step6")
    step12 = consolidation.consolidate(work_dir / "checkpoint_state_step12")
    ddp_dir = tmp_path / "ddp"
    harness.train(_partly_frozen("torch", None), ddp_dir)
    ddp = torch.load(ddp_dir / "weights.pt", weights_only=True)
    weights = load_weights(tmp_path / "ws_fixed")
    for name in FROZEN:
        assert torch.equal(step6[name], step12[name]) and torch.equal(step12[name], weights[name]), name
        assert torch.equal(weights[name], ddp[name]), name
    trained = [name for name in weights if name not in FROZEN]
    assert all(not torch.equal(step6[name], step12[name]) for name in trained)
    difference = max_abs_difference(weights, ddp)
    print(
        "input layer as its own unit: frozen parameters bit-identical; "
        f"max |weights.pt - DDP| = {difference:.3e}"
    )
    assert difference <= 1e-5
