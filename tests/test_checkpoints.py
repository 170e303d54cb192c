"""
Sharded checkpoints: resuming after SIGKILL, a crash in the middle of a save, resuming on a
different number of workers, refusing pickles, and offline consolidation; each worker's buffers
and a checkpointed step's validation line through a kill, and a weight tied inside a unit.

The kill and rerun goes through the real CLI (Tango's ``checkpoint_state_latest`` and its
"Recovering from previous run"); everything else trains in the test's own workers
(:mod:`tests.harness`: Tango's worker loop, no ``tango run``).
"""

import json
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

from examples.toy.components import ToyRegressor
from tango_fairscale import CheckpointError, checkpointing
from tango_fairscale.backends.fairscale_fsdp import resharding
from tango_fairscale.checkpointing import consolidation
from tango_fairscale.cli import main
from tango_fairscale.telemetry.metrics import METRICS_FILE_NAME, read_metrics
from tests import harness
from tests.helpers import (
    kill_after_checkpoint,
    load_weights,
    max_abs_difference,
    readme_command_lines,
    run_tango,
    tango_env,
    train_config,
)

RESUME_TOLERANCE = 1e-6
RECORD_LOSSES: Dict[str, Any] = {"type": "test::record_losses"}
#: So that the CLI run can be killed between two checkpoints.
SLOW_DOWN: Dict[str, Any] = {"type": "test::slow_down", "seconds": 0.15}


BACKENDS = ["fairscale", "torch"]
#: The torch backend's resharding runs are extended: make test covers DCP's resharding at library
#: level (test_torch_backend.py).
RESHARDING_BACKENDS = ["fairscale", pytest.param("torch", marks=pytest.mark.extended)]


def backend_engine(backend: str, **extra: Any) -> Dict[str, Any]:
    return {"backend": backend, **extra}


def kill_config(
    backend: str = "fairscale", callbacks: Optional[List[Dict[str, Any]]] = None
) -> Dict[str, Any]:
    return train_config(
        engine="fairscale",
        wrap="nested",
        train_steps=12,
        checkpoint_every=3,
        callbacks=callbacks if callbacks is not None else [RECORD_LOSSES],
        engine_extra=backend_engine(backend),
    )


@pytest.fixture(scope="module")
def uninterrupted_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Dict[str, torch.Tensor]]:
    """The weights of an uninterrupted run of :func:`kill_config`, per backend, trained once each."""
    weights: Dict[str, Dict[str, torch.Tensor]] = {}

    def run(backend: str) -> Dict[str, torch.Tensor]:
        if backend not in weights:
            work_dir = tmp_path_factory.mktemp(f"uninterrupted_{backend}") / "work"
            harness.train(kill_config(backend), work_dir)
            weights[backend] = torch.load(work_dir / "weights.pt", weights_only=True)
        return weights[backend]

    return run


#: The kill and rerun through the CLI, once per backend: the torch backend's in the extended suite
#: (make test's time), its kill and rerun being in make test in the test's own workers
#: (test_resume_exact.py, test_lora_checkpoints.py).
@pytest.mark.parametrize("backend", ["fairscale", pytest.param("torch", marks=pytest.mark.extended)])
def test_sigkill_after_checkpoint_then_rerun_matches(
    backend: str, uninterrupted_runs: Callable[[str], Dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    uninterrupted = uninterrupted_runs(backend)
    config = kill_config(backend, callbacks=[RECORD_LOSSES, SLOW_DOWN])
    cwd, workspace = tmp_path / "cwd", tmp_path / "ws"
    work_dir = kill_after_checkpoint(config, workspace, cwd)
    losses_before = json.loads((work_dir / "losses.json").read_text())

    result = run_tango(config, workspace, cwd=cwd)
    # The killed run had got past step 6 but not to the end; the re-run resumed from a
    # complete checkpoint instead of starting over.
    assert 5 <= max(int(step) for step in losses_before) < 11
    recovered = re.search(
        r"Recovering from previous run at \S*checkpoint_state_step(\d+)", result.stdout + result.stderr
    )
    assert recovered is not None and int(recovered.group(1)) >= 6
    difference = max_abs_difference(load_weights(workspace), uninterrupted)
    print(f"[{backend}] max |resumed - uninterrupted| = {difference:.3e}")
    assert difference <= RESUME_TOLERANCE


def test_crash_while_saving_keeps_previous_checkpoint(
    uninterrupted_runs: Callable[[str], Dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    uninterrupted = uninterrupted_runs("fairscale")
    config = kill_config()
    engine = config["steps"]["train"]["training_engine"]
    engine["type"] = "test::fairscale_crash_in_save"
    engine["crash_at_checkpoint"] = "checkpoint_state_step6"
    # Worker 0 waits for the dead worker 1's digests: the gloo connection's end fails it at once,
    # and this bounds the wait should it not.
    engine["collective_timeout"] = harness.COLLECTIVE_TIMEOUT
    work_dir = tmp_path / "work"
    (first,) = harness.run([harness.Train(config, work_dir)], out=tmp_path / "first")
    assert first.exitcodes[1] == -signal.SIGKILL, first.describe()
    assert first.errors[0] is not None, first.describe()  # the run failed
    assert (work_dir / "crashed_once").exists()
    # The interrupted save never got its marker: it does not count (worker 0 removes it when it
    # sees the failure, unless it is stopped first; the rerun removes what is left) ...
    interrupted = work_dir / "checkpoint_state_step6"
    assert not checkpointing.is_complete(interrupted)
    # ... and the last complete checkpoint is still the resume point.
    assert (work_dir / "checkpoint_state_latest").resolve().name == "checkpoint_state_step3"
    assert checkpointing.is_complete(work_dir / "checkpoint_state_step3")

    (interrupted / "worker1_model.pt").parent.mkdir(exist_ok=True)
    (interrupted / "worker1_model.pt").write_bytes(b"what a killed save left")
    second = harness.train(config, work_dir)
    assert "Recovering from previous run at" in second.logs and "checkpoint_state_step3" in second.logs
    assert "Removed checkpoint_state_step6: save(s) interrupted" in second.logs
    assert not interrupted.exists() or checkpointing.is_complete(interrupted)
    difference = max_abs_difference(torch.load(work_dir / "weights.pt", weights_only=True), uninterrupted)
    print(f"max |resumed after crash in save - uninterrupted| = {difference:.3e}")
    assert difference <= RESUME_TOLERANCE


def consolidated(checkpoint_dir: Path) -> Dict[str, Any]:
    """Model and optimizer state of a checkpoint of either backend, keyed by parameter name."""
    return consolidation.consolidate(checkpoint_dir, with_optimizer=True)


def assert_states_equal(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    assert max_abs_difference(a["model"], b["model"]) == 0.0
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys() == a["model"].keys()
    for name in state_a:
        assert state_a[name].keys() == state_b[name].keys()
        for key in state_a[name]:
            assert torch.equal(torch.as_tensor(state_a[name][key]), torch.as_tensor(state_b[name][key])), (
                name,
                key,
            )
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


@pytest.fixture(scope="module")
def two_worker_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The work directory of an 8-step run on 2 workers that kept its step-4 checkpoint, per backend."""
    work_dirs: Dict[str, Path] = {}

    def run(backend: str) -> Path:
        if backend not in work_dirs:
            config = train_config(
                engine="fairscale",
                wrap="nested",
                train_steps=8,
                checkpoint_every=4,
                callbacks=[],
                engine_extra=backend_engine(backend),
            )
            config["steps"]["train"]["remove_stale_checkpoints"] = False  # keep step 4 to resume from
            work_dirs[backend] = tmp_path_factory.mktemp(f"two_workers_{backend}") / "work"
            harness.train(config, work_dirs[backend])
        return work_dirs[backend]

    return run


@pytest.fixture(scope="module")
def two_worker_run(two_worker_runs: Callable[[str], Path]) -> Path:
    return two_worker_runs("fairscale")


def resume_on(workers: int, source: Path, tmp_path: Path, backend: str = "fairscale") -> Path:
    config = train_config(
        engine="fairscale",
        wrap="nested",
        device_count=workers,
        train_steps=20,
        checkpoint_every=10,
        callbacks=[{"type": "test::save_after_load"}, RECORD_LOSSES],
        engine_extra=backend_engine(backend, resume_from_checkpoint=str(source)),
    )
    config["steps"]["train"]["remove_stale_checkpoints"] = False
    work_dir = tmp_path / "work"
    result = harness.train(config, work_dir, world_size=workers)
    assert "Resharding checkpoint" in result.logs
    return work_dir


@pytest.mark.parametrize("backend", RESHARDING_BACKENDS)
@pytest.mark.parametrize("workers", [3, pytest.param(4, marks=pytest.mark.extended)])
def test_resume_on_another_world_size(
    workers: int, backend: str, two_worker_runs: Callable[[str], Path], tmp_path: Path
) -> None:
    saved = two_worker_runs(backend) / "checkpoint_state_step4"
    work_dir = resume_on(workers, saved, tmp_path, backend)
    assert checkpointing.read_marker(work_dir / "after_load")["world_size"] == workers  # type: ignore[index]
    # Right after loading, the new workers hold exactly what the 2-worker run saved.
    assert_states_equal(consolidated(work_dir / "after_load"), consolidated(saved))
    # Training went on from step 4 (not 0), and the loss went down.
    losses = {int(step): loss for step, loss in json.loads((work_dir / "losses.json").read_text()).items()}
    assert min(losses) == 4
    first, last = sorted(losses)[:3], sorted(losses)[-3:]
    assert sum(losses[s] for s in last) < sum(losses[s] for s in first)

    # And back: resume the resharded run's checkpoint on 2 workers.
    back = resume_on(2, work_dir / "checkpoint_state_step10", tmp_path / "back", backend)
    assert_states_equal(consolidated(back / "after_load"), consolidated(work_dir / "checkpoint_state_step10"))


def _resume_with_other_wrapping(worker: harness.Worker, backend: str, root: Path) -> Optional[str]:
    """
    On each worker, with the engine built directly: 3 steps with every block its own unit, a
    checkpoint, then an engine of the same model with FSDP on the root only loading it (and saving
    what it loaded). Returns the load's error, if it refused.
    """
    nested = train_config(engine="fairscale", wrap="nested", engine_extra=backend_engine(backend))
    root_only = train_config(engine="fairscale", wrap="root", engine_extra=backend_engine(backend))
    engine = worker.engine(nested, root / "nested")
    worker.train(engine, worker.batches(nested), 3)
    engine.save_checkpoint(root / "saved", {"training_steps": 3})
    engine = worker.engine(root_only, root / "root_only")
    try:
        engine.load_checkpoint(root / "saved")
    except CheckpointError as error:
        return str(error)
    engine.save_checkpoint(root / "loaded", {"training_steps": 3})
    return None


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_of_another_wrapping(backend: str, tmp_path: Path) -> None:
    (result,) = harness.run(
        [harness.Call(_resume_with_other_wrapping, (backend, tmp_path))], out=tmp_path / "h"
    )
    result.check()
    if backend == "fairscale":
        # FairScale's flat parameters are the units': refused on every worker, naming them and the fix.
        for error in result.values:
            assert "The checkpoint was saved from a differently wrapped model" in error, error
            assert "parameters only in the checkpoint ['blocks.0.flat_param_0'" in error, error
            assert "Use the same modules_to_wrap/fsdp_config as the run that saved it" in error, error
    else:
        # DCP keys the shards by parameter name: the other wrapping holds exactly the saved state.
        assert result.values == [None, None]
        assert_states_equal(consolidated(tmp_path / "loaded"), consolidated(tmp_path / "saved"))


class CreatesFile:
    """Unpickling this creates a file: what an attacker's checkpoint would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (str(self.path), "w"))


def test_pickle_payload_is_refused_and_not_run(
    two_worker_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    tampered = tmp_path / "tampered"
    shutil.copytree(two_worker_run / "checkpoint_state_step4", tampered)
    evidence = tmp_path / "pwned"
    torch.save({"state": CreatesFile(evidence), "param_groups": []}, tampered / "worker1_optimizer.pt")
    # The marker's digests already refuse the replaced file, before anything reads it ...
    with pytest.raises(
        CheckpointError, match="worker1_optimizer.pt has .* bytes where COMPLETE.json recorded"
    ):
        resharding.load_optimizer_shards(tampered)
    # ... so forge them too, as an attacker writing the whole directory would: what stops the
    # payload then is loading with weights_only.
    marker = checkpointing.read_marker(tampered)
    assert marker is not None
    marker["digests"]["worker1_optimizer.pt"] = checkpointing.file_digest(tampered / "worker1_optimizer.pt")
    checkpointing.write_marker(tampered, marker.pop("world_size"), extra=marker)
    assert not evidence.exists()

    with pytest.raises(CheckpointError, match="Refusing to load .*worker1_optimizer.pt"):
        checkpointing.safe_load(tampered / "worker1_optimizer.pt")
    assert not evidence.exists()

    # Through a run resuming from it: every worker stops on it.
    config = train_config(engine="fairscale", wrap="nested", train_steps=6, checkpoint_every=3, callbacks=[])
    config["steps"]["train"]["training_engine"]["resume_from_checkpoint"] = str(tampered)
    (resumed,) = harness.run([harness.Train(config, tmp_path / "work")], out=tmp_path / "harness")
    assert all(error is not None and "worker1_optimizer.pt" in error for error in resumed.errors), (
        resumed.describe()
    )
    assert not evidence.exists()

    # Through the consolidate command.
    status = main(["consolidate", str(tampered), str(tmp_path / "out.pt"), "--optimizer"])
    stderr = capsys.readouterr().err
    assert status == 2
    assert "Refusing to load" in stderr and "worker1_optimizer.pt" in stderr
    assert not evidence.exists()
    # Sanity: the payload does run under plain unpickling, so the refusals above are real.
    pickle.loads(pickle.dumps(CreatesFile(evidence)))
    assert evidence.exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_consolidate_command(backend: str, two_worker_runs: Callable[[str], Path], tmp_path: Path) -> None:
    """docs/checkpoints.md's consolidate command, as written there, on a work directory of either backend."""
    two_worker_run = two_worker_runs(backend)
    # The plain state dict's command (docs/pretrained.md's writes a from_pretrained directory).
    (line,) = readme_command_lines(
        "bash", "consolidate WORKSPACE/cache/TorchTrainStep-.../work", doc="docs/checkpoints.md"
    )
    filled = (
        line.replace("WORKSPACE/cache/TorchTrainStep-.../work", str(two_worker_run))
        .replace("[--optimizer]", "--optimizer")
        .replace(" [--force]", "")
        .replace("python", sys.executable, 1)
    )
    assert "[" not in filled, filled
    result = subprocess.run(
        shlex.split(filled), cwd=tmp_path, env=tango_env(), capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "from 2 shards" in result.stdout
    assert "Reading shards" in result.stderr  # the progress bar
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    model = ToyRegressor(in_features=8, width=32, num_blocks=4)
    model.load_state_dict(full["model"], strict=True)
    # The work dir's latest checkpoint is the final one, whose weights are the step's weights.pt.
    assert (
        max_abs_difference(full["model"], torch.load(two_worker_run / "weights.pt", weights_only=True)) == 0.0
    )
    assert set(full["optimizer"]["state"]) == set(full["model"])


@pytest.mark.parametrize(
    "marker_lists_files",
    [True, pytest.param(False, marks=pytest.mark.extended)],
    ids=["marker-lists-files", "older-marker"],
)
def test_resume_from_a_run_without_lr_scheduler_starts_the_schedule(
    marker_lists_files: bool, two_worker_run: Path, tmp_path: Path
) -> None:
    # A checkpoint of a run configured without an LR scheduler, resumed by a run with one:
    # the schedule starts fresh, with a warning, instead of failing on the missing file. Also
    # for markers written before they listed the files.
    source = tmp_path / "no_scheduler"
    shutil.copytree(two_worker_run / "checkpoint_state_step4", source)
    for worker in range(2):
        checkpointing.worker_file(source, worker, "lr_scheduler").unlink()
    marker = checkpointing.read_marker(source)
    assert marker is not None and "lr_scheduler" in marker["files"]
    # That run wrote no scheduler files, so its marker has no digests of them either.
    for worker in range(2):
        del marker["digests"][checkpointing.worker_file(source, worker, "lr_scheduler").name]
    if marker_lists_files:
        marker["files"].remove("lr_scheduler")
    else:
        del marker["files"]
    (source / checkpointing.MARKER).write_text(json.dumps(marker))
    config = train_config(
        engine="fairscale",
        wrap="nested",
        train_steps=6,
        checkpoint_every=6,
        callbacks=[],
        engine_extra={"resume_from_checkpoint": str(source)},
    )
    result = harness.train(config, tmp_path / "work")
    assert "has no lr_scheduler state: the learning-rate schedule starts from its first step" in result.logs
    assert (
        checkpointing.read_marker(tmp_path / "work" / "checkpoint_state_latest")[  # type: ignore[index]
            "training_steps"
        ]
        == 6
    )


def test_a_weight_tied_inside_a_nested_unit_trains_and_its_weights_are_written(tmp_path: Path) -> None:
    # Each block (its own FSDP unit) ties b.weight to a.weight after building both. On the
    # fairscale backend the run trained, then writing weights.pt failed with KeyError: 'a.weight'
    # (FairScale names a unit's tied parameters relative to the unit), and so did consolidate.
    from tests.components import TiedInBlock

    model = {"type": "test::tied_in_block"}
    runs = {
        "ddp": train_config(engine="torch", model=model, train_steps=4, checkpoint_every=2, callbacks=[]),
        **{
            backend: train_config(
                engine="fairscale",
                wrap="nested",
                model=model,
                train_steps=4,
                checkpoint_every=2,
                callbacks=[],
                engine_extra=backend_engine(backend),
            )
            for backend in BACKENDS
        },
    }
    results = harness.run([harness.Train(c, tmp_path / name) for name, c in runs.items()], out=tmp_path / "h")
    for result in results:
        result.check()
    reference = torch.load(tmp_path / "ddp" / "weights.pt", weights_only=True)
    for backend in BACKENDS:
        weights = torch.load(tmp_path / backend / "weights.pt", weights_only=True)
        TiedInBlock().load_state_dict(weights, strict=True)
        for block in range(2):
            assert torch.equal(weights[f"blocks.{block}.b.weight"], weights[f"blocks.{block}.a.weight"])
        difference = max_abs_difference(weights, reference)
        print(f"[{backend}] max |FSDP - DDP| {difference:.3e}")
        assert difference == 0.0
        # consolidate, whole (with the optimizer) and one tensor at a time, gives weights.pt back.
        checkpoint = tmp_path / backend / "checkpoint_state_latest"
        assert (
            max_abs_difference(consolidation.consolidate(checkpoint, with_optimizer=True)["model"], weights)
            == 0.0
        )
        consolidation.save_model(consolidation.model_source(checkpoint), tmp_path / f"{backend}.pt")
        assert max_abs_difference(torch.load(tmp_path / f"{backend}.pt", weights_only=True), weights) == 0.0


def test_a_kill_between_a_checkpoint_and_its_validation_line_loses_no_line(tmp_path: Path) -> None:
    # Tango saves a validated step's checkpoint, then calls post_val_loop, where the metrics log
    # wrote the validation line: killed in between (the kill callback's post_val_loop runs before
    # the log's), the rerun resumed after that step, and metrics.jsonl never got its line.
    def experiment(kill: bool) -> Dict[str, Any]:
        callbacks = [{"type": "test::kill_once_after_validation", "step": 1}] if kill else []
        return train_config(
            engine="fairscale",
            wrap="nested",
            train_steps=4,
            checkpoint_every=2,
            validate=True,
            callbacks=callbacks,
        )

    plain = harness.Train(experiment(kill=False), tmp_path / "plain")
    killed = harness.Train(experiment(kill=True), tmp_path / "killed")
    first = harness.run([plain, killed], out=tmp_path / "first")
    first[0].check(exited=False)
    assert first[1].exitcodes == [-signal.SIGKILL] * 2 and (killed.work_dir / "killed_once").exists()
    assert checkpointing.is_complete(killed.work_dir / "checkpoint_state_step2")
    rerun = harness.train(killed.experiment, killed.work_dir)
    assert "Recovering from previous run at " + str(killed.work_dir / "checkpoint_state_step2") in rerun.logs

    def validations(work_dir: Path) -> List[Dict[str, Any]]:
        lines, _ = read_metrics(work_dir / METRICS_FILE_NAME)
        return [
            {key: line[key] for key in ("step", "epoch", "val_loss", "best_val_loss")}
            for line in lines
            if line["kind"] == "validation"
        ]

    print("validation lines:", validations(killed.work_dir))
    assert [line["step"] for line in validations(plain.work_dir)] == [2, 4]
    assert validations(killed.work_dir) == validations(plain.work_dir)


# --- Buffers: each worker's own, through a kill --------------------------------------------------------


def batchnorm_experiment(backend: str, kill_at: Optional[int] = None) -> Dict[str, Any]:
    """The BatchNorm regressor on ``backend``, validated and checkpointed every 2 of 4 steps."""
    callbacks: List[Dict[str, Any]] = [{"type": "test::record_buffers"}]
    if kill_at is not None:
        callbacks.insert(0, {"type": "test::kill_once", "step": kill_at})
    return train_config(
        engine="fairscale",
        model={"type": "test::batchnorm_regressor"},
        train_steps=4,
        checkpoint_every=2,
        validate=True,
        callbacks=callbacks,
        engine_extra={"backend": backend},
    )


def validation_losses(work_dir: Path) -> Dict[int, float]:
    lines, _ = read_metrics(work_dir / METRICS_FILE_NAME)
    return {line["step"]: line["val_loss"] for line in lines if line["kind"] == "validation"}


def test_batchnorm_killed_after_a_checkpoint_and_rerun_keeps_every_workers_running_statistics(
    tmp_path: Path,
) -> None:
    # Workers see different batches, so their BatchNorm statistics differ. Resumed on the torch
    # backend, worker 1 took worker 0's statistics from the checkpoint: the same weights.pt, but
    # here a step-4 validation loss of 0.2398539 instead of 0.2393983.
    plain = {b: harness.Train(batchnorm_experiment(b), tmp_path / f"{b}-plain") for b in BACKENDS}
    killed = {
        b: harness.Train(batchnorm_experiment(b, kill_at=3), tmp_path / f"{b}-killed") for b in BACKENDS
    }
    reruns = harness.killed_and_rerun(plain, killed, tmp_path)
    for backend in BACKENDS:
        uninterrupted, resumed = plain[backend].work_dir, killed[backend].work_dir
        assert (
            "Recovering from previous run at " + str(resumed / "checkpoint_state_step2")
            in reruns[backend].logs
        )
        losses = {"uninterrupted": validation_losses(uninterrupted), "resumed": validation_losses(resumed)}
        print(f"[{backend}] validation losses by step: {losses}")
        expected = [
            torch.load(uninterrupted / f"buffers_worker{rank}.pt", weights_only=True) for rank in range(2)
        ]
        # The test means something only where the workers' statistics differ.
        assert not torch.equal(expected[0]["norm.running_mean"], expected[1]["norm.running_mean"])
        for rank in range(2):
            got = torch.load(resumed / f"buffers_worker{rank}.pt", weights_only=True)
            assert got.keys() == expected[rank].keys()
            for name in got:
                assert torch.equal(got[name], expected[rank][name]), (backend, rank, name)
        assert losses["resumed"] == losses["uninterrupted"]
        assert sorted(losses["resumed"]) == [2, 4]
        weights = (torch.load(d / "weights.pt", weights_only=True) for d in (uninterrupted, resumed))
        assert max_abs_difference(*weights) == 0.0


@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_a_rerun_resumes_only_its_own_steps_checkpoint(backend: str, tmp_path: Path) -> None:
    """
    Each checkpoint's marker names the step that wrote it: another run's complete checkpoint in
    the work directory (all else matching) is refused in one line on every worker, not resumed.
    """
    work = tmp_path / "work"
    config = train_config(wrap="nested", train_steps=4, checkpoint_every=2, engine_extra={"backend": backend})
    (first,) = harness.run([harness.Train(config, work)], out=tmp_path / "first")
    first.check()
    marker_path = work / "checkpoint_state_step4" / checkpointing.MARKER
    marker = json.loads(marker_path.read_text())
    assert marker["step_id"] == "harness"  # the harness's step id, as TrainConfig gives it
    marker["step_id"] = "TorchTrainStep-of-another-run"
    marker_path.write_text(json.dumps(marker))
    longer = train_config(wrap="nested", train_steps=6, checkpoint_every=2, engine_extra={"backend": backend})
    (rerun,) = harness.run([harness.Train(longer, work)], out=tmp_path / "rerun")
    for error in rerun.errors:
        assert (
            error is not None
            and "was written by step TorchTrainStep-of-another-run, not by this one" in error
        )
        assert "\n" not in error and "resume_from_checkpoint" in error
    assert not (work / "checkpoint_state_step6").exists()
