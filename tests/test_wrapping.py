import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn as nn
from fairscale.nn.checkpoint import checkpoint_wrapper
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from tango.common import Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import Model

from examples.toy.components import ToyRegressor
from tango_fairscale import FSDPConfig, WrapPlan, compat, plan_wrapping, with_wrapped_modules
from tango_fairscale.backends.fairscale_fsdp.backend import FairScaleBackend, apply_wrap_plan
from tango_fairscale.backends.torch_fsdp2.backend import TorchBackend
from tango_fairscale.checkpointing import consolidation
from tango_fairscale.fsdp_options import FSDPOptions
from tango_fairscale.wrapping import recorded_plan, replace_submodule
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


def test_the_wrapper_records_its_plan_and_leaves_the_model_plain() -> None:
    model = Model.from_params(
        Params(
            {
                "type": "fairscale::with_wrapped_modules",
                "model": {"type": "toy::regressor", "in_features": 4, "width": 8, "num_blocks": 3},
                "modules_to_wrap": ["blocks\\.[0-9]+", "head"],
                "fsdp_config": {"reshard_after_forward": False},
                "activation_checkpointing": True,
            }
        )
    )
    # Nothing is wrapped where the model is built (the main process's final model keeps the plain
    # names): the plan waits on the model for the engine's backend.
    assert not any(isinstance(m, FSDP) for m in model.modules())
    assert set(model.state_dict()) == set(toy().state_dict())
    plan = recorded_plan(model)
    assert plan is not None
    assert plan.selected == ("blocks.0", "blocks.1", "blocks.2", "head")
    assert plan.checkpointed == frozenset(plan.selected)
    # The units' options as the backends read them (FSDPConfig's fields, without its wrap()).
    assert plan.unit_config == FSDPOptions(reshard_after_forward=False)
    assert recorded_plan(toy()) is None


def _checkpointed(model: ToyRegressor, modules: set) -> ToyRegressor:
    """``model`` with FairScale's checkpoint wrapper (the fairscale backend's) around ``modules``."""
    wrapped = with_wrapped_modules(model, modules, activation_checkpointing=True)
    plan = recorded_plan(wrapped)
    assert plan is not None and not plan.fsdp
    for name in plan.checkpointed:
        replace_submodule(wrapped, name, checkpoint_wrapper(wrapped.get_submodule(name)))
    return wrapped


def test_the_fairscale_backend_checkpoints_only_units_of_their_own() -> None:
    """
    FairScale frees a unit's parameters when the first reentrant checkpointed backward inside it
    ends: checkpointed modules that are not units of their own are refused, before any worker
    (pre-flight reads ``check_wrapper_options``) and where the plan is applied.
    """
    wrapped = with_wrapped_modules(toy(), {"blocks\\.[0-9]+"}, activation_checkpointing=True)
    plan = recorded_plan(wrapped)
    assert plan is not None
    with pytest.raises(
        ConfigurationError, match=r"without fsdp_config: the fairscale backend checkpoints only"
    ):
        apply_wrap_plan(wrapped, plan, torch.device("cpu"))
    options = {"modules_to_wrap": ["blocks\\.[0-9]+"], "activation_checkpointing": True}
    with pytest.raises(ConfigurationError, match=r"Add fsdp_config: \{\} to with_wrapped_modules"):
        FairScaleBackend.check_wrapper_options(options)
    FairScaleBackend.check_wrapper_options({**options, "fsdp_config": {}})
    TorchBackend.check_wrapper_options(options)  # FSDP2's hooks run once per backward: allowed


def test_checkpointing_keeps_outputs_and_gradients() -> None:
    plain, wrapped = toy(), _checkpointed(toy(), {"blocks\\.[0-9]+"})
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
        model = _checkpointed(toy(), {"input"})
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
    # The refusal comes from the wrapper too, whichever the backend (it runs before any backend does).
    with pytest.raises(ConfigurationError, match="would be split across FSDP units"):
        with_wrapped_modules(_TiedLM(), {"embed"}, fsdp_config=FSDPConfig())


def test_a_mixed_group_is_split_into_trainable_and_frozen_flat_parameters() -> None:
    from tango_fairscale.compat.fairscale_flat_groups import split_by_requires_grad

    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    layers[0].requires_grad_(False)
    a_weight, a_bias, b_weight, b_bias = (p for layer in layers for p in layer.parameters())
    assert split_by_requires_grad([a_weight, b_weight, a_bias, b_bias]) == [
        [b_weight, b_bias],
        [a_weight, a_bias],
    ]
    # Groups that agree stay as they are (the same flat parameter as before, so the same checkpoints).
    assert split_by_requires_grad([[b_weight, b_bias], [a_weight]]) == [[b_weight, b_bias], [a_weight]]
    assert split_by_requires_grad([[]]) == [[]]


def _partly_frozen(
    engine: str, modules_to_wrap: Optional[List[str]], engine_extra: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """The toy regressor with its input layer and its middle block frozen, checkpoints kept."""
    model = {
        "type": "test::partly_frozen_regressor",
        "in_features": 8,
        "width": 32,
        "num_blocks": 4,
        "frozen": ["input", "blocks.1"],
    }
    config = train_config(
        engine=engine,
        wrap="nested" if modules_to_wrap else "none",
        model=model,
        callbacks=[],
        engine_extra=engine_extra,
    )
    if modules_to_wrap:
        config["steps"]["train"]["model"]["modules_to_wrap"] = modules_to_wrap
    config["steps"]["train"]["remove_stale_checkpoints"] = False
    return config


#: The partly frozen regressor's frozen parameters under :func:`_partly_frozen`'s wrappings.
FROZEN = ("input.weight", "input.bias", "blocks.1.linear.weight", "blocks.1.linear.bias")


def _frozen_state(worker: harness.Worker, experiment: Dict[str, Any], root: Path) -> Dict[str, Any]:
    """On each worker: 3 steps, then what holds a gradient and optimizer state, by parameter name."""
    engine = worker.engine(experiment, root / f"engine{worker.rank}")
    worker.train(engine, worker.batches(experiment), 3)
    named = list(engine.model.named_parameters())
    return {
        "no_grad": sorted(name for name, p in named if p.grad is None),
        "with_grad": sorted(name for name, p in named if p.grad is not None),
        "frozen": sorted(name for name, p in named if not p.requires_grad),
        "stateless_frozen": all(not engine.optimizer.state.get(p) for _, p in named if not p.requires_grad),
        "stateful_trainable": all(engine.optimizer.state.get(p) for _, p in named if p.requires_grad),
    }


@pytest.mark.parametrize("init_on_meta", [False, True])
@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_frozen_and_trainable_parameters_share_units_and_train_as_ddp(
    tmp_path: Path, backend: str, init_on_meta: bool
) -> None:
    # One unit holds all the blocks, the middle one frozen; the root holds the frozen input layer
    # beside the trainable head. FairScale refused both units ("flat parameter ... all frozen or
    # all trainable"): LoRA's layers are the same case.
    experiment = _partly_frozen("fairscale", ["blocks"], {"backend": backend, "init_on_meta": init_on_meta})
    (state, trained) = harness.run(
        [
            harness.Call(_frozen_state, (experiment, tmp_path)),
            harness.Train(experiment, tmp_path / "fsdp"),
        ],
        out=tmp_path / "h",
    )
    for worker in state.check().values:
        # Frozen parameters hold no gradient and no optimizer state on any worker.
        assert worker["frozen"] and worker["no_grad"] == worker["frozen"], worker
        assert worker["stateless_frozen"] and worker["stateful_trainable"], worker
    trained.check()
    weights = torch.load(tmp_path / "fsdp" / "weights.pt", weights_only=True)
    step6 = consolidation.consolidate(tmp_path / "fsdp" / "checkpoint_state_step6")
    for name in FROZEN:
        assert torch.equal(step6[name], weights[name]), name
    assert all(not torch.equal(step6[name], weights[name]) for name in weights if name not in FROZEN)
    ddp_dir = tmp_path / "ddp"
    harness.train(_partly_frozen("torch", None), ddp_dir)
    ddp = torch.load(ddp_dir / "weights.pt", weights_only=True)
    for name in FROZEN:
        # Bit-identical from the start (DDP's weights: same seed, same build) to the end.
        assert torch.equal(weights[name], ddp[name]), name
    difference = max_abs_difference(weights, ddp)
    print(f"[{backend}, init_on_meta={init_on_meta}] max |weights.pt - DDP| = {difference:.3e}")
    assert difference <= 1e-5


# --- Through `tango run`: a split tie and frozen parameters in a flat unit ------------------------------


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


@pytest.mark.extended
def test_frozen_input_layer_and_middle_block_under_per_block_units_through_tango_run(tmp_path: Path) -> None:
    # Per-block units: the frozen middle block is a unit of its own, the frozen input layer is in
    # the root unit with the trainable head. Refused before frozen and trainable parameters could
    # share a unit; trains now, through the CLI, as DDP does.
    run_tango(_partly_frozen("fairscale", ["blocks\\.[0-9]+"]), tmp_path / "ws", cwd=tmp_path / "cwd")
    work_dir = train_work_dir(tmp_path / "ws")
    step6 = consolidation.consolidate(work_dir / "checkpoint_state_step6")
    ddp_dir = tmp_path / "ddp"
    harness.train(_partly_frozen("torch", None), ddp_dir)
    ddp = torch.load(ddp_dir / "weights.pt", weights_only=True)
    weights = load_weights(tmp_path / "ws")
    for name in FROZEN:
        assert torch.equal(step6[name], weights[name]) and torch.equal(weights[name], ddp[name]), name
    difference = max_abs_difference(weights, ddp)
    print(f"per-block units through tango run: max |weights.pt - DDP| = {difference:.3e}")
    assert difference <= 1e-5


class _LoraLike(nn.Module):
    """A frozen linear layer with a trainable low-rank adapter beside it, as LoRA's layers are."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.down = nn.Linear(width, 2, bias=False)
        self.up = nn.Linear(2, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.base(x) + self.up(self.down(x)))


def _gathered(unit: Any) -> List[str]:
    """The frozen flat parameters of ``unit`` whose gathered copy is allocated."""
    return [
        f"{id(unit)}:{index}"
        for index, p in enumerate(unit.params)
        if not p.requires_grad and p._full_param_padded.untyped_storage().size() > 0
    ]


def _check_frozen_release(rank: int, port: int) -> None:
    import torch.distributed as dist

    from tango_fairscale.launch.teardown import close_process_groups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    compat.enable_cpu_fsdp()
    torch.manual_seed(0)
    width = 16
    model = nn.Sequential(nn.Embedding(10, width), _LoraLike(width), _LoraLike(width), _LoraLike(width))
    model[0].requires_grad_(False)  # the root unit: a frozen embedding
    units = [FSDPConfig().wrap(model[index]) for index in (1, 2, 3)]
    for index, unit in zip((1, 2, 3), units):
        model[index] = unit
    root = FSDPConfig().wrap(model)
    # When block 2's input gradient is computed, block 3's backward is over: its frozen half must be
    # released by then, one unit at a time, not at the end of backward.
    during: List[List[str]] = []

    def watch_input(module: nn.Module, args: Any) -> None:
        args[0].register_hook(lambda grad: during.append(_gathered(units[2])))

    units[1].register_forward_pre_hook(watch_input)
    tokens = torch.tensor([[1, 2, 3, 4]])
    for step in range(2):
        root(tokens).pow(2).mean().backward()
        assert during[step] == [], (step, during)
        # After backward nothing frozen stays gathered: not the root's embedding, not a unit's base;
        # frozen parameters are their FP32 shards again, without gradients.
        assert _gathered(root) == [] and all(_gathered(unit) == [] for unit in units), step
        for unit in [root, *units]:
            for p in unit.params:
                if not p.requires_grad:
                    assert p.grad is None and p.data.numel() == p._fp32_shard.numel(), step
    close_process_groups()


def test_frozen_halves_of_units_are_released_one_unit_at_a_time_in_backward() -> None:
    from tests.helpers import free_port

    harness.spawn(_check_frozen_release, args=(free_port(),), nprocs=2)
