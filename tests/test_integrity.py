"""
Checkpoint integrity and failures that must end a run, on 2 CPU workers: random state restored
on resume (dropout) after a kill that left no ``latest`` link, a checkpoint of another model size,
files of another step, a changed byte (in the test's own workers, :mod:`tests.harness`), and a
frozen worker (through the real CLI, whose main process must end the run).
"""

import os
import signal
import time
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from tango_fairscale import checkpointing
from tango_fairscale.backends.fairscale_fsdp import resharding
from tests import harness
from tests.helpers import max_abs_difference, run_tango, toy_model, train_config, train_work_dir


def dropout_config() -> Dict[str, Any]:
    # Killed (SIGKILL, every worker) before step index 7, once: after the checkpoint of step 6.
    config = train_config(
        engine="fairscale",
        wrap="root",
        train_steps=12,
        checkpoint_every=3,
        model={"type": "test::dropout_regressor", "in_features": 8, "width": 32},
        callbacks=[{"type": "test::kill_once", "step": 7}],
    )
    return config


def weights(work_dir: Path) -> Dict[str, torch.Tensor]:
    return torch.load(work_dir / "weights.pt", weights_only=True)


def test_dropout_resume_after_kill_without_latest_link_matches(tmp_path: Path) -> None:
    plain = dropout_config()
    plain["steps"]["train"]["callbacks"] = []
    killed = tmp_path / "killed"
    uninterrupted_run, killed_run = harness.run(
        [harness.Train(plain, tmp_path / "plain"), harness.Train(dropout_config(), killed)],
        out=tmp_path / "first",
    )
    uninterrupted_run.check(exited=False)
    uninterrupted = weights(tmp_path / "plain")
    assert killed_run.exitcodes == [-signal.SIGKILL] * 2, killed_run.describe()
    assert (killed / "killed_once").exists() and not (killed / "weights.pt").exists()
    assert checkpointing.is_complete(killed / "checkpoint_state_step6")
    # What a kill between Tango's unlink and symlink leaves: no latest link at all.
    (killed / "checkpoint_state_latest").unlink()

    result = harness.train(dropout_config(), killed)
    assert "is missing or dangling: resuming from checkpoint_state_step6" in result.logs, result.logs[-3000:]
    difference = max_abs_difference(weights(killed), uninterrupted)
    print(f"dropout model, max |killed, link removed, resumed - uninterrupted| = {difference:.3e}")
    assert difference <= 1e-6


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-worker run of the toy model (width 32) keeping its step-4 and step-8 checkpoints."""
    work_dir = tmp_path_factory.mktemp("saved") / "work"
    config = train_config(engine="fairscale", wrap="nested", train_steps=8, checkpoint_every=4, callbacks=[])
    config["steps"]["train"]["remove_stale_checkpoints"] = False
    harness.train(config, work_dir)
    return work_dir


def resume_from(source: Path, tmp_path: Path, width: int = 32, **engine: Any) -> harness.JobResult:
    """A run resuming from ``source``, which must fail on every worker; ``elapsed`` is its time."""
    config = train_config(
        engine="fairscale",
        wrap="nested",
        train_steps=12,
        checkpoint_every=12,
        callbacks=[],
        model=toy_model(width=width),
        engine_extra={"resume_from_checkpoint": str(source), "collective_timeout": 60, **engine},
    )
    start = time.monotonic()
    (result,) = harness.run([harness.Train(config, tmp_path / "work")], out=tmp_path / "harness", timeout=180)
    result.elapsed = time.monotonic() - start  # type: ignore[attr-defined]
    assert all(error is not None for error in result.errors), result.describe()
    return result


def test_checkpoint_of_another_model_size_is_refused(saved_run: Path, tmp_path: Path) -> None:
    result = resume_from(saved_run / "checkpoint_state_step8", tmp_path, width=16)
    for error in result.errors:
        assert "holds parameters of other shapes than this model's" in error, error  # type: ignore[operator]
        assert "saved [32, 32], this model [16, 16]" in error, error  # type: ignore[operator]


def test_checkpoint_of_another_optimizer_is_refused(saved_run: Path, tmp_path: Path) -> None:
    # AdamW's state resumed into SGD failed deep in PyTorch with a KeyError.
    result = resume_from(
        saved_run / "checkpoint_state_step8", tmp_path, optimizer={"type": "torch::SGD", "lr": 0.01}
    )
    for error in result.errors:
        assert "holds the state of another optimizer: 1 parameter group(s) with options" in error, error  # type: ignore[operator]
        assert "where this run's SGD has 1 with" in error and "\n" not in error, error  # type: ignore[operator]
    print(result.errors[0])


@pytest.fixture(scope="module")
def saved_torch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``saved_run`` on the torch backend (DCP files)."""
    work_dir = tmp_path_factory.mktemp("saved_torch") / "work"
    config = train_config(
        engine="fairscale",
        wrap="nested",
        train_steps=4,
        checkpoint_every=4,
        callbacks=[],
        engine_extra={"backend": "torch"},
    )
    harness.train(config, work_dir)
    return work_dir


def test_torch_backend_checkpoint_of_another_size_or_optimizer_is_refused_saying_so(
    saved_torch_run: Path, tmp_path: Path
) -> None:
    # DCP's size mismatch and missing key read as "swapped or replaced after the save" before.
    source = saved_torch_run / "checkpoint_state_step4"
    common: Dict[str, Any] = {
        "backend": "torch",
        "resume_from_checkpoint": str(source),
        "collective_timeout": 60,
    }
    jobs = [
        harness.Train(
            train_config(
                engine="fairscale",
                wrap="nested",
                train_steps=8,
                checkpoint_every=8,
                callbacks=[],
                model=toy_model(width=width),
                engine_extra={**common, **extra},
            ),
            tmp_path / name,
        )
        for name, width, extra in (
            ("width", 16, {}),
            ("optimizer", 32, {"optimizer": {"type": "torch::SGD", "lr": 0.01}}),
        )
    ]
    width, optimizer = harness.run(jobs, out=tmp_path / "harness", timeout=180)
    for error in width.errors:
        assert f"The checkpoint {source} holds parameters of other shapes than this model's" in error, error  # type: ignore[operator]
        assert "input.weight: saved [32, 8], this model [16, 8]" in error and "swapped" not in error, error  # type: ignore[operator]
    for error in optimizer.errors:
        assert f"{source} holds the state of another optimizer: 1 parameter group(s) with options" in error, (
            error
        )  # type: ignore[operator]
        assert "where this run's SGD has 1 with" in error and "swapped" not in error, error  # type: ignore[operator]


def forge_digest(checkpoint_dir: Path, name: str) -> None:
    """Rewrite the marker's digest of ``name`` to match the file, as a careless copy tool could not."""
    marker = checkpointing.read_marker(checkpoint_dir)
    assert marker is not None
    marker["digests"][name] = checkpointing.file_digest(checkpoint_dir / name)
    checkpointing.write_marker(checkpoint_dir, marker.pop("world_size"), extra=marker)


def test_file_of_another_step_fails_fast_without_hanging(saved_run: Path, tmp_path: Path) -> None:
    import shutil

    mixed = tmp_path / "mixed"
    shutil.copytree(saved_run / "checkpoint_state_step8", mixed)
    shutil.copy(saved_run / "checkpoint_state_step4" / "worker1_trainer.pt", mixed / "worker1_trainer.pt")
    forge_digest(mixed, "worker1_trainer.pt")
    result = resume_from(mixed, tmp_path)
    # Both workers stop on it (they agree before loading), well before any timeout.
    for error in result.errors:
        assert "worker1_trainer.pt does not belong in this checkpoint: its header has step 4 where 8" in error  # type: ignore[operator]
    assert result.elapsed < 60, result.elapsed  # type: ignore[attr-defined]


def test_changed_byte_is_refused_through_resume(saved_run: Path, tmp_path: Path) -> None:
    import shutil

    changed = tmp_path / "changed"
    shutil.copytree(saved_run / "checkpoint_state_step8", changed)
    data = bytearray((changed / "worker0_optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (changed / "worker0_optimizer.pt").write_bytes(bytes(data))
    result = resume_from(changed, tmp_path)
    assert any(
        "worker0_optimizer.pt has SHA-256" in error and "contents changed" in error  # type: ignore[operator]
        for error in result.errors
    ), result.describe()


@pytest.mark.extended
def test_frozen_worker_ends_the_run_within_the_timeout(tmp_path: Path) -> None:
    timeout = 15
    config = train_config(
        engine="fairscale",
        wrap="nested",
        train_steps=50,
        checkpoint_every=50,
        callbacks=[{"type": "test::freeze_worker", "worker": 1, "step": 2}],
        engine_extra={"collective_timeout": timeout},
    )
    result = run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd", check=False, timeout=240)
    ended = time.time()
    frozen = list(train_work_dir(tmp_path / "ws").glob("frozen_pid_*"))
    assert frozen, "the worker never froze"
    elapsed = ended - frozen[0].stat().st_mtime
    print(f"the run ended {elapsed:.1f}s after a worker froze (collective_timeout {timeout}s)")
    try:
        assert result.returncode != 0
        # The timeout, then the spawn grace (5 s to exit, 5 s after SIGTERM) and Tango's teardown.
        assert elapsed < timeout + 20, elapsed
    finally:
        # The stopped worker must not outlive the run.
        for marker in train_work_dir(tmp_path / "ws").glob("frozen_pid_*"):
            pid = int(marker.name.rsplit("_", 1)[1])
            alive = True
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = False
            if alive:
                os.kill(pid, signal.SIGKILL)
            assert not alive, f"the frozen worker {pid} outlived the run"


def test_weights_are_unchanged_by_verification(saved_run: Path) -> None:
    # The verified load path reads what was written: consolidating the final checkpoint gives weights.pt.
    full = resharding.consolidate_model_state(
        resharding.load_model_shards(saved_run / "checkpoint_state_step8")
    )
    assert max_abs_difference(full, torch.load(saved_run / "weights.pt", weights_only=True)) == 0.0


def test_workers_that_run_different_collectives_end_within_the_timeout(tmp_path: Path) -> None:
    # The fairscale backend's workers waited forever (collective_timeout 30: still at 0 % after
    # 200 s): a ring transfer's wait had no timeout. Now each worker ends within the timeout,
    # naming itself and the worker it waited for.
    import time

    config = train_config(
        engine="fairscale",
        wrap="nested",
        model={"type": "test::skips_a_block_on_worker_1"},
        callbacks=[],
        engine_extra={"collective_timeout": 3},
    )
    config["steps"]["train"]["model"]["modules_to_wrap"] = ["inner\\.blocks\\.[0-9]+"]
    started = time.monotonic()
    (result,) = harness.run([harness.Train(config, tmp_path / "work")], out=tmp_path / "h", timeout=120)
    elapsed = time.monotonic() - started
    errors = [error for error in result.errors if error is not None]
    print(f"ended in {elapsed:.1f} s: {errors}")
    assert errors and elapsed < 60, (elapsed, result.describe())
    assert any("waited 3 s (collective_timeout)" in error and "worker" in error for error in errors), errors
