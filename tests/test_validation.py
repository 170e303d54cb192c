"""
Every bad config fails fast with a ConfigurationError naming the field (or warns): before workers
are spawned where the config alone tells (tested on :func:`tango_fairscale.preflight.preflight`
directly, and through the real CLI for one case), otherwise from the worker (through the CLI).
"""

import time
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
import torch

from tests.helpers import run_tango, train_config

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
        "mixed precision in the engine only, without amp",
        engine(fsdp_config={"mixed_precision": True}),
        "ConfigurationError",
        "differ in ['mixed_precision'] and training_engine.amp is false: the wrapped units and the root",
        True,
    ),
    (
        "max_grad_norm not positive",
        engine(max_grad_norm=0),
        "ConfigurationError",
        "training_engine.max_grad_norm: must be a positive number, got 0",
        True,
    ),
    (
        "modules_to_wrap given as a string",
        wrapper(modules_to_wrap="blocks\\.[0-9]+"),
        "ConfigurationError",
        "modules_to_wrap: expected a list of regex strings, got str",
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

#: Each warning and the config that gets it. One run gets both (each costs a run of its own
#: otherwise): mixed precision in both configs, without amp, and the engine's differing.
WARNINGS = [
    (
        "mixed_precision without amp",
        wrapper(fsdp_config={"mixed_precision": True}),
        "fsdp_config.mixed_precision is true but training_engine.amp is false",
    ),
    (
        "fsdp_config differs between wrapper and engine",
        engine(fsdp_config={"mixed_precision": True, "reshard_after_forward": False}),
        "model.fsdp_config and training_engine.fsdp_config differ in ['reshard_after_forward']",
    ),
]


def draw_warnings(config: Config) -> None:
    """Change ``config`` so that it draws every warning of :data:`WARNINGS`."""
    for _, each, _ in WARNINGS:
        each(config)


def bad_config(change: Callable[[Config], None]) -> Config:
    config = train_config(engine="fairscale", wrap="nested", train_steps=4, checkpoint_every=2, callbacks=[])
    change(config)
    return config


def bad_run(change: Callable[[Config], None], tmp_path: Path) -> Any:
    return run_tango(bad_config(change), tmp_path / "ws", cwd=tmp_path / "cwd", check=False, timeout=120)


def run_preflight(config: Config) -> None:
    """What the step patch does in Tango's main process, on the config's own objects."""
    from tango import Step
    from tango.common import Lazy, Params
    from tango.integrations.torch import DataLoader, Model, TrainCallback, TrainingEngine

    import examples.toy.components  # noqa: F401 - registers the toy data and model
    import tests.components  # noqa: F401 - registers the test components
    from tango_fairscale.preflight import preflight

    step = train(config)
    data = config["steps"]["data"]
    dataset = Step.by_name(data["type"])().run(**{k: v for k, v in data.items() if k != "type"})
    options = {
        key: value
        for key, value in step.items()
        if key
        in (
            "train_steps",
            "train_epochs",
            "checkpoint_every",
            "validate_every",
            "grad_accum",
            "train_split",
            "validation_split",
        )
    }
    preflight(
        model=Lazy(Model, Params(step["model"])),
        training_engine=Lazy(TrainingEngine, Params(step["training_engine"])),
        dataset_dict=dataset,
        train_dataloader=Lazy(DataLoader, Params(step["train_dataloader"])),
        devices=[-1] * step["device_count"],
        callbacks=[Lazy(TrainCallback, Params(dict(callback))) for callback in step.get("callbacks", [])],
        **options,
    )


def data(**changes: Any) -> Callable[[Config], None]:
    return lambda config: config["steps"]["data"].update(changes)


def loader(**changes: Any) -> Callable[[Config], None]:
    return lambda config: train(config)["train_dataloader"].update(changes)


CASES += [
    (
        "negative train_steps",
        set_train(train_steps=-5),
        "ConfigurationError",
        "train_steps: must be a positive",
        True,
    ),
    (
        "checkpoint_every 0",
        set_train(checkpoint_every=0),
        "ConfigurationError",
        "checkpoint_every: must be a positive whole number, got 0",
        True,
    ),
    (
        "one example for two workers",
        data(train_size=1),
        "ConfigurationError",
        "split 'train' has 1 example(s); split over world size 2",
        True,
    ),
    (
        "twenty examples, batches of 16, drop_last",
        lambda config: (data(train_size=20)(config), loader(batch_size=16, drop_last=True)(config)),
        "ConfigurationError",
        "each worker gets 10, fewer than batch_size 16 (with drop_last)",
        True,
    ),
    (
        "twenty examples, batches of 16, without drop_last: each batch would hold 10",
        lambda config: (data(train_size=20)(config), loader(batch_size=16)(config)),
        "ConfigurationError",
        "each worker gets 10, fewer than batch_size 16, so every batch would hold 10 examples, not 16",
        True,
    ),
]


CASES += [
    (
        "a misspelt option of the wrapped model",
        lambda config: train(config)["model"]["model"].update(num_block=2),
        "ConfigurationError",
        "model.model.num_block: not an option of 'toy::regressor': did you mean 'num_blocks'?",
        True,
    ),
    (
        "every parameter frozen",
        lambda config: train(config)["model"]["model"].update(
            type="test::partly_frozen_regressor", frozen=[""]
        ),
        "ConfigurationError",
        "model: none of its 12 parameters trains (every one has requires_grad=False): there is nothing "
        "to train",
        True,
    ),
    (
        "a misspelt option of fairscale::with_wrapped_modules",
        lambda config: train(config)["model"].update(wrap_module_class=["Block"]),
        "ConfigurationError",
        "model.wrap_module_class: not an option of 'fairscale::with_wrapped_modules': did you mean "
        "'wrap_module_classes'?",
        True,
    ),
]


def callback(**options: Any) -> Callable[[Config], None]:
    return lambda config: train(config).update(callbacks=[options])


def rename_engine_key(old: str, new: str) -> Callable[[Config], None]:
    def change(config: Config) -> None:
        options = train(config)["training_engine"]
        options[new] = options.pop(old)

    return change


def drop_engine_key(name: str) -> Callable[[Config], None]:
    return lambda config: train(config)["training_engine"].pop(name)


#: A file, where a callback's directory is expected.
A_FILE = str(Path(__file__).resolve())

# Found by Tango only inside every worker, each with its traceback (75-412 lines), or not at all.
CASES += [
    (
        "optimizer misspelt",
        rename_engine_key("optimizer", "optimiser"),
        "ConfigurationError",
        "training_engine.optimiser: not an option of the 'fairscale' engine: did you mean 'optimizer'?",
        True,
    ),
    (
        "unknown engine option",
        engine(colour="blue"),
        "ConfigurationError",
        "training_engine.colour: not an option of the 'fairscale' engine: its options are "
        "['accumulate_grads_locally', 'amp', 'amp_use_bfloat16', 'backend',",
        True,
    ),
    (
        "no optimizer",
        drop_engine_key("optimizer"),
        "ConfigurationError",
        "training_engine.optimizer: missing; the 'fairscale' engine needs it (e.g. \"optimizer\": {",
        True,
    ),
    (
        "validation split the dataset lacks",
        set_train(validation_split="valid"),
        "ConfigurationError",
        "validation_split: the dataset has no split 'valid'; its splits are ['train', 'validation'].",
        True,
    ),
    (
        "W&B mode that is not one",
        callback(type="fairscale::wandb", mode="offlin"),
        "ConfigurationError",
        "callbacks[0]: fairscale::wandb: mode must be 'online', 'offline', 'disabled', got 'offlin'",
        True,
    ),
    (
        "W&B dir that is a file",
        callback(type="fairscale::wandb", mode="offline", dir=A_FILE),
        "ConfigurationError",
        f"callbacks[0]: fairscale::wandb: dir {A_FILE!r} is a file: give a directory",
        True,
    ),
    (
        "W&B dir under a file",
        callback(type="fairscale::wandb", mode="offline", dir=f"{A_FILE}/wandb"),
        "ConfigurationError",
        f"callbacks[0]: fairscale::wandb: dir '{A_FILE}/wandb' lies under {A_FILE}, which is a file",
        True,
    ),
    (
        "TensorBoard log_dir nobody can create",
        # Not even root may create anything in another process's /proc directory.
        callback(type="fairscale::tensorboard", log_dir="/proc/1/tensorboard"),
        "ConfigurationError",
        "callbacks[0]: fairscale::tensorboard: log_dir '/proc/1/tensorboard' cannot be created: /proc/1 is "
        "not writable by this user",
        True,
    ),
    (
        "TensorBoard option misspelt",
        callback(type="fairscale::tensorboard", logdir="runs"),
        "ConfigurationError",
        "callbacks[0].logdir: not an option of 'fairscale::tensorboard': did you mean 'log_dir'?",
        True,
    ),
    (
        "metrics peak_tflops 0",
        callback(type="fairscale::metrics", peak_tflops=0),
        "ConfigurationError",
        "callbacks[0]: fairscale::metrics: peak_tflops must be one worker's peak in TFLOP/s, above 0 and at ",
        True,
    ),
    (
        "metrics peak_tflops 1e308",
        callback(type="fairscale::metrics", peak_tflops=1e308),
        "ConfigurationError",
        "callbacks[0]: fairscale::metrics: peak_tflops must be one worker's peak in TFLOP/s, above 0 and at ",
        True,
    ),
    (
        "TensorBoard every 0",
        callback(type="fairscale::tensorboard", every=0),
        "ConfigurationError",
        "callbacks[0]: fairscale::tensorboard: every must be a whole number, 1 or more, got 0.",
        True,
    ),
    (
        "profile step 0",
        callback(type="fairscale::profile", steps=[0, 1]),
        "ConfigurationError",
        "callbacks[0]: fairscale::profile: steps must be a list of 1-based step numbers, got [0, 1]",
        True,
    ),
    (
        "profile negative step",
        callback(type="fairscale::profile", steps=[-2]),
        "ConfigurationError",
        "callbacks[0]: fairscale::profile: steps must be a list of 1-based step numbers, got [-2]",
        True,
    ),
    (
        "profile steps after the last step",
        callback(type="fairscale::profile", steps=[5, 6]),
        "ConfigurationError",
        "callbacks[0]: fairscale::profile: steps [5, 6] go past the run's last step (train_steps 4), so no "
        "trace would be written: choose steps from 1 to 4.",
        True,
    ),
    (
        "profile steps after the last step of train_epochs",
        # 256 examples, 2 workers, batches of 8 (the sampler drops nothing here): 16 steps an epoch.
        lambda config: (
            set_train(train_steps=None, train_epochs=1)(config),
            callback(type="fairscale::profile", steps=[16, 17])(config),
        ),
        "ConfigurationError",
        "steps [16, 17] go past the run's last step (train_steps 16), so the trace would lack them",
        True,
    ),
    (
        "memory callback peak_tflops 0",
        callback(type="fairscale::memory", peak_tflops=0),
        "ConfigurationError",
        "callbacks[0]: fairscale::memory: peak_tflops must be one worker's peak in TFLOP/s, above 0 and at "
        "most 1e+06, got 0.",
        True,
    ),
    (
        "memory callback peak_tflops 1e308",
        callback(type="fairscale::memory", peak_tflops=1e308),
        "ConfigurationError",
        "callbacks[0]: fairscale::memory: peak_tflops must be one worker's peak in TFLOP/s, above 0 and at "
        "most 1e+06, got 1e+308.",
        True,
    ),
    (
        "export_hf of a model that is not a transformers model",
        engine(export_hf="hf"),
        "ConfigurationError",
        "training_engine.export_hf: the step's model holds no transformers model to export",
        True,
    ),
]

MAIN_PROCESS_CASES = [case for case in CASES if case[4]]


@pytest.mark.parametrize(
    "case, change, error, fragment, before_spawn", MAIN_PROCESS_CASES, ids=[c[0] for c in MAIN_PROCESS_CASES]
)
def test_preflight_refuses(case: str, change: Any, error: str, fragment: str, before_spawn: bool) -> None:
    from tango.common.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError) as raised:
        run_preflight(bad_config(change))
    # The original error's type leads the one-line message Tango prints.
    assert str(raised.value).split(":")[0] in (error, "WrapConfigurationError")
    assert fragment in str(raised.value)


def test_preflight_accepts_mixed_precision_that_differs_under_amp() -> None:
    run_preflight(bad_config(engine(fsdp_config={"mixed_precision": True}, amp=True)))


# One case found in the main process and one only a worker can find, through the real CLI.
# A worker's error through the CLI is in make test's
# test_one_worker_failing_ends_the_run_quickly_and_each_warning_is_printed_once: the second case is
# extended.
CLI_CASES = [
    case if case[0] == "pattern matching nothing" else pytest.param(*case, marks=pytest.mark.extended)
    for case in CASES
    if case[0] in ("pattern matching nothing", "forward returns no loss")
]


@pytest.mark.parametrize(
    "case, change, error, fragment, before_spawn",
    CLI_CASES,
    ids=["pattern matching nothing", "forward returns no loss"],
)
def test_bad_config(
    case: str, change: Any, error: str, fragment: str, before_spawn: bool, tmp_path: Path
) -> None:
    result = bad_run(change, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert error in output and fragment in output, output[-3000:]
    # A worker's log lines carry "[rank N]", its progress bar is "Training:"; a worker's other
    # exceptions reach the main process as torch's ProcessRaisedException (a configuration error
    # is told in one line: train_step.run_step). Any shows that workers were spawned.
    spawned = any(sign in output for sign in ("[rank ", "Training:", "ProcessRaisedException"))
    assert spawned is not before_spawn, output[-3000:]
    if before_spawn:
        # Said once, without Tango's traceback above it.
        assert output.count(fragment) == 1 and "Traceback" not in output, output[-3000:]


def test_one_worker_failing_ends_the_run_quickly_and_each_warning_is_printed_once(tmp_path: Path) -> None:
    """
    Two things the CLI's output shows, from one ``tango run`` (its start-up is most of its time): a
    worker that fails ends the whole run within seconds, naming the failure; and the config's
    warnings are each printed once (pre-flight's by the main process, the engine's by worker 0
    only), both before the failure: worker 1 fails at step 2, which it reaches only through
    collectives with worker 0's engine. That such a config trains to the end is
    :func:`test_a_config_that_draws_the_warnings_trains`.
    """
    config = train_config(
        engine="fairscale",
        wrap="nested",
        train_steps=50,
        checkpoint_every=25,
        callbacks=[{"type": "test::fail_on_worker", "worker": 1, "step": 2}],
    )
    draw_warnings(config)
    start = time.monotonic()
    result = run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd", check=False, timeout=120)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "deliberate failure on worker 1 at step 2" in output, output[-3000:]
    print(f"a 2-worker run with one failing worker ended after {elapsed:.1f}s")
    assert elapsed < 60
    for case, _, fragment in WARNINGS:
        assert output.count(fragment) == 1, (case, output[-3000:])


def test_a_config_that_draws_the_warnings_trains(tmp_path: Path) -> None:
    """Warnings, not errors: the config of both trains to its weights.pt (in the test's own workers)."""
    from tests import harness

    harness.train(bad_config(draw_warnings), tmp_path / "work")
    weights = torch.load(tmp_path / "work" / "weights.pt", weights_only=True)
    assert weights and all(torch.isfinite(tensor).all() for tensor in weights.values())


def test_valid_config_passes_preflight() -> None:
    # The same path the refusals above take, on the unchanged config: nothing is raised.
    run_preflight(bad_config(lambda config: None))


def test_a_forward_without_loss_is_refused_by_the_workers(tmp_path: Path) -> None:
    """The one case only a worker can find, in the test's own workers (its CLI run is extended)."""
    from tests import harness

    (case,) = [case for case in CASES if case[0] == "forward returns no loss"]
    _, change, error, fragment, _ = case
    (result,) = harness.run([harness.Train(bad_config(change), tmp_path / "work")], out=tmp_path / "harness")
    for worker in result.workers:
        assert worker is not None and worker.error is not None, result.describe()
        assert worker.error.startswith(f"{error}: {fragment}"), worker.error


def test_valid_callback_options_pass_preflight(tmp_path: Path) -> None:
    """The callbacks' rules refuse only what cannot work: these options, each at its edge, pass."""
    callbacks = [
        {"type": "fairscale::wandb", "mode": "offline", "dir": str(tmp_path / "new" / "wandb"), "every": 1},
        {"type": "fairscale::tensorboard", "log_dir": str(tmp_path), "every": 4, "final_wait_s": 0},
        {"type": "fairscale::profile", "steps": [3, 4]},
        {"type": "fairscale::memory", "peak_tflops": 1e6, "log_every": 0},
    ]
    run_preflight(bad_config(set_train(callbacks=callbacks)))
    assert not (tmp_path / "new").exists()  # checked, not created


def fake_checkpoint(directory: Path, step: int, world_size: int = 2) -> Path:
    """A complete checkpoint as a backend leaves it, its files empty (pre-flight reads the marker)."""
    from tango_fairscale import checkpointing

    directory.mkdir(parents=True)
    for worker in range(world_size):
        checkpointing.worker_file(directory, worker, "model").write_bytes(b"")
    checkpointing.write_marker(directory, world_size, extra={"training_steps": step, "files": ["model"]})
    return directory


def test_resuming_a_checkpoint_past_the_runs_last_step_is_refused(tmp_path: Path) -> None:
    """
    Tango resumed a step-6 checkpoint in a run of 3 steps without a word: it trained nothing, saved
    ``checkpoint_state_step3`` and wrote a ``weights.pt`` of the 6-step weights.
    """
    from tango.common.exceptions import ConfigurationError

    checkpoint = fake_checkpoint(tmp_path / "checkpoint_state_step6", step=6)
    with pytest.raises(ConfigurationError) as raised:
        run_preflight(
            bad_config(
                lambda config: (
                    engine(resume_from_checkpoint=str(checkpoint))(config),
                    set_train(train_steps=3, checkpoint_every=3)(config),
                )
            )
        )
    assert str(raised.value) == (
        f"ConfigurationError: training_engine.resume_from_checkpoint: {checkpoint} is of step 6, past this "
        "run's last step (train_steps 3): nothing would be trained, and the weights saved as step 3's would "
        "be step 6's. Raise train_steps above 6 to train on from it, or remove resume_from_checkpoint to "
        "train from the start."
    )
    # Its own last step (nothing left to train, as for any finished run), or later: it resumes.
    for steps in (6, 8):
        run_preflight(
            bad_config(
                lambda config, steps=steps: (
                    engine(resume_from_checkpoint=str(checkpoint))(config),
                    set_train(train_steps=steps)(config),
                )
            )
        )
