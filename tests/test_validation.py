"""
Every bad config fails fast with a ConfigurationError naming the field (or warns), through the
real CLI: before workers are spawned where the config alone tells, otherwise from the worker.
"""

import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import pytest

from tests.helpers import run_tango, train_config

pytestmark = pytest.mark.slow

Config = Dict[str, Any]


def train(config: Config) -> Config:
    return config["steps"]["train"]


def engine(**changes: Any) -> Callable[[Config], None]:
    return lambda config: train(config)["training_engine"].update(changes)


def wrapper(**changes: Any) -> Callable[[Config], None]:
    return lambda config: train(config)["model"].update(changes)


def both(**changes: Any) -> Callable[[Config], None]:
    def change(config: Config) -> None:
        engine(**changes)(config)
        wrapper(**changes)(config)

    return change


def set_train(**changes: Any) -> Callable[[Config], None]:
    return lambda config: train(config).update(changes)


def no_sampler(config: Config) -> None:
    del train(config)["train_dataloader"]["sampler"]


def model_type(name: str) -> Callable[[Config], None]:
    return lambda config: train(config).update(model={"type": name})


# (case, change to a valid nested-FSDP config, exception or warning, message fragment, found in main process?)
CASES = [
    (
        "invalid regex",
        wrapper(modules_to_wrap=["blocks\\.[0-9"]),
        "ConfigurationError",
        "'blocks\\\\.[0-9' is not a valid regular expression",
        True,
    ),
    (
        "pattern matching nothing",
        wrapper(modules_to_wrap=["block\\.[0-9]+"]),
        "ConfigurationError",
        "'block\\\\.[0-9]+' matches no submodule of ToyRegressor",
        True,
    ),
    (
        "pattern matching the root",
        wrapper(modules_to_wrap=[".*"]),
        "ConfigurationError",
        "'.*' matches the root module",
        True,
    ),
    (
        "device_count 1",
        set_train(device_count=1),
        "ConfigurationError",
        "set 'device_count' to 2 or more in the torch::train step (it is 1)",
        True,
    ),
    (
        "move_params_to_cpu without move_grads_to_cpu",
        engine(fsdp_config={"move_params_to_cpu": True, "move_grads_to_cpu": False}),
        "ConfigurationError",
        "fairscale#918",
        True,
    ),
    (
        "unknown fsdp_config key",
        engine(fsdp_config={"reshard_after_forwards": False}),
        "ConfigurationError",
        "Unknown FSDPConfig option(s) ['reshard_after_forwards']. Valid options: reshard_after_forward,",
        True,
    ),
    (
        "wrong value type",
        engine(fsdp_config={"flatten_parameters": "yes"}),
        "ConfigurationError",
        "FSDPConfig.flatten_parameters: expected bool, got str 'yes'",
        True,
    ),
    (
        "dtype that is not a dtype",
        engine(fsdp_config={"mixed_precision": True, "compute_dtype": "float12"}, amp=True),
        "ConfigurationError",
        "FSDPConfig.compute_dtype: 'float12' is not a dtype",
        True,
    ),
    (
        "model with no parameters",
        model_type("test::no_parameters"),
        "ConfigurationError",
        "The model (NoParameters) has no parameters",
        True,
    ),
    (
        "no DistributedSampler",
        no_sampler,
        "ConfigurationError",
        "train_dataloader.sampler: distributed training needs a DistributedSampler",
        True,
    ),
    (
        "auto-wrap class that no submodule has",
        wrapper(modules_to_wrap=None, wrap_module_classes=["GPT2Block"]),
        "ConfigurationError",
        "no submodule of ToyRegressor has class 'GPT2Block'",
        True,
    ),
    (
        "mixed precision in the engine only",
        engine(fsdp_config={"mixed_precision": True}, amp=True),
        "ConfigurationError",
        "differ in ['mixed_precision']: the wrapped units and the root unit would compute",
        True,
    ),
    (
        "float16 AMP on CPU workers",
        engine(amp=True, amp_use_bfloat16=False),
        "ConfigurationError",
        "amp_use_bfloat16: false (float16 AMP) is not supported on CPU workers",
        True,
    ),
    (
        "forward returns no loss",
        model_type("test::no_loss"),
        "ConfigurationError",
        "The model's forward() returned no 'loss'",
        False,
    ),
]

WARNINGS = [
    (
        "mixed_precision without amp",
        both(fsdp_config={"mixed_precision": True}),
        "fsdp_config.mixed_precision is true but training_engine.amp is false",
    ),
    (
        "fsdp_config differs between wrapper and engine",
        engine(fsdp_config={"reshard_after_forward": False}),
        "model.fsdp_config and training_engine.fsdp_config differ in ['reshard_after_forward']",
    ),
]


def bad_run(change: Callable[[Config], None], tmp_path: Path) -> Any:
    config = train_config(engine="fairscale", wrap="nested", train_steps=4, checkpoint_every=2, callbacks=[])
    change(config)
    return run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd", check=False, timeout=120)


@pytest.mark.parametrize("case, change, error, fragment, before_spawn", CASES, ids=[c[0] for c in CASES])
def test_bad_config(
    case: str, change: Any, error: str, fragment: str, before_spawn: bool, tmp_path: Path
) -> None:
    result = bad_run(change, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert error in output and fragment in output, output[-3000:]
    # "[rank N]" prefixes the log lines of spawned workers.
    assert ("[rank " not in output) is before_spawn, output[-3000:]


@pytest.mark.parametrize("case, change, fragment", WARNINGS, ids=[c[0] for c in WARNINGS])
def test_warning(case: str, change: Any, fragment: str, tmp_path: Path) -> None:
    result = bad_run(change, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert fragment in output, output[-3000:]


def test_one_worker_failing_ends_the_run_quickly(tmp_path: Path) -> None:
    config = train_config(
        engine="fairscale",
        wrap="nested",
        train_steps=50,
        checkpoint_every=25,
        callbacks=[{"type": "test::fail_on_worker", "worker": 1, "step": 2}],
    )
    start = time.monotonic()
    result = run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd", check=False, timeout=120)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "deliberate failure on worker 1 at step 2" in output, output[-3000:]
    print(f"a 2-worker run with one failing worker ended after {elapsed:.1f}s")
    assert elapsed < 60


def test_valid_config_passes_preflight(tmp_path: Optional[Path] = None) -> None:
    from tango.common import Lazy, Params
    from tango.integrations.torch import Model

    from tango_fairscale.preflight import check_model

    model = Lazy(Model, Params(train_config(wrap="nested_ckpt")["steps"]["train"]["model"]))
    check_model(model, None)  # builds on meta without raising
