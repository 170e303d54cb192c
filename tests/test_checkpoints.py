"""
Sharded checkpoints: resuming after SIGKILL, a crash in the middle of a save, resuming on a
different number of workers, refusing pickles, and offline consolidation.
"""

import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch

from examples.toy.components import ToyRegressor
from tango_fairscale import CheckpointError, checkpointing, consolidation
from tests.helpers import (
    REPO,
    kill_after_checkpoint,
    load_weights,
    max_abs_difference,
    run_tango,
    train_config,
    train_work_dir,
)

pytestmark = pytest.mark.slow

RESUME_TOLERANCE = 1e-6
CALLBACKS: List[Dict[str, Any]] = [
    {"type": "test::record_losses"},
    {"type": "test::slow_down", "seconds": 0.15},
]


BACKENDS = ["fairscale", "torch"]
#: The torch backend's end-to-end kill-and-rerun and resharding runs are extended: make test covers
#: them with its two-host run (a host killed, each host resuming its DCP part:
#: test_multihost.py) and DCP's resharding at library level (test_torch_backend.py).
BACKENDS_CI = ["fairscale", pytest.param("torch", marks=pytest.mark.extended)]


def backend_engine(backend: str, **extra: Any) -> Dict[str, Any]:
    return {"backend": backend, **extra}


def kill_config(backend: str = "fairscale", **overrides: Any) -> Dict[str, Any]:
    return train_config(
        engine="fairscale",
        wrap="nested",
        train_steps=12,
        checkpoint_every=3,
        callbacks=CALLBACKS,
        engine_extra=backend_engine(backend),
        **overrides,
    )


@pytest.fixture(scope="module")
def uninterrupted_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Dict[str, torch.Tensor]]:
    """The weights of the uninterrupted run of :func:`kill_config`, per backend, run once each."""
    weights: Dict[str, Dict[str, torch.Tensor]] = {}

    def run(backend: str) -> Dict[str, torch.Tensor]:
        if backend not in weights:
            root = tmp_path_factory.mktemp(f"uninterrupted_{backend}")
            run_tango(kill_config(backend), root / "ws", cwd=root / "cwd")
            weights[backend] = load_weights(root / "ws")
        return weights[backend]

    return run


#: Extended for both backends: make test kills and reruns a dropout model with the latest link
#: removed (test_integrity.py), and a lost host's rerun with the torch backend (test_multihost.py).
@pytest.mark.extended
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_after_checkpoint_then_rerun_matches(
    backend: str, uninterrupted_runs: Callable[[str], Dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    uninterrupted = uninterrupted_runs(backend)
    config = kill_config(backend)
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
    config["steps"]["train"]["training_engine"]["type"] = "test::fairscale_crash_in_save"
    config["steps"]["train"]["training_engine"]["crash_at_checkpoint"] = "checkpoint_state_step6"
    first = run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd", check=False)
    assert first.returncode != 0
    work_dir = train_work_dir(tmp_path / "ws")
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
    second = run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd")
    assert "checkpoint_state_step3" in second.stdout + second.stderr
    assert "Removed checkpoint_state_step6: save(s) interrupted" in second.stdout + second.stderr
    difference = max_abs_difference(load_weights(tmp_path / "ws"), uninterrupted)
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
            root = tmp_path_factory.mktemp(f"two_workers_{backend}")
            config = train_config(
                engine="fairscale",
                wrap="nested",
                train_steps=8,
                checkpoint_every=4,
                callbacks=[],
                engine_extra=backend_engine(backend),
            )
            config["steps"]["train"]["remove_stale_checkpoints"] = False  # keep step 4 to resume from
            run_tango(config, root / "ws", cwd=root / "cwd")
            work_dirs[backend] = train_work_dir(root / "ws")
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
        callbacks=[{"type": "test::save_after_load"}, {"type": "test::record_losses"}],
        engine_extra=backend_engine(backend, resume_from_checkpoint=str(source)),
    )
    config["steps"]["train"]["remove_stale_checkpoints"] = False
    result = run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd")
    assert "Resharding checkpoint" in result.stdout + result.stderr
    return train_work_dir(tmp_path / "ws")


@pytest.mark.parametrize("backend", BACKENDS_CI)
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


class CreatesFile:
    """Unpickling this creates a file: what an attacker's checkpoint would do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (str(self.path), "w"))


def test_pickle_payload_is_refused_and_not_run(two_worker_run: Path, tmp_path: Path) -> None:
    tampered = tmp_path / "tampered"
    shutil.copytree(two_worker_run / "checkpoint_state_step4", tampered)
    evidence = tmp_path / "pwned"
    torch.save({"state": CreatesFile(evidence), "param_groups": []}, tampered / "worker1_optimizer.pt")
    # The marker's digests already refuse the replaced file, before anything reads it ...
    with pytest.raises(
        CheckpointError, match="worker1_optimizer.pt has .* bytes where COMPLETE.json recorded"
    ):
        checkpointing.load_optimizer_shards(tampered)
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

    # Through a real run resuming from it.
    config = train_config(engine="fairscale", wrap="nested", train_steps=6, checkpoint_every=3, callbacks=[])
    config["steps"]["train"]["training_engine"]["resume_from_checkpoint"] = str(tampered)
    result = run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd", check=False)
    assert result.returncode != 0
    assert "worker1_optimizer.pt" in result.stdout + result.stderr
    assert not evidence.exists()

    # Through the consolidate command.
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "tango_fairscale",
            "consolidate",
            str(tampered),
            str(tmp_path / "out.pt"),
            "--optimizer",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 2
    assert "Refusing to load" in cli.stderr and "worker1_optimizer.pt" in cli.stderr
    assert not evidence.exists()
    # Sanity: the payload does run under plain unpickling, so the refusals above are real.
    pickle.loads(pickle.dumps(CreatesFile(evidence)))
    assert evidence.exists()


@pytest.mark.parametrize("backend", BACKENDS)
def test_consolidate_command(backend: str, two_worker_runs: Callable[[str], Path], tmp_path: Path) -> None:
    two_worker_run = two_worker_runs(backend)
    output = tmp_path / "full.pt"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tango_fairscale",
            "consolidate",
            str(two_worker_run),
            str(output),
            "--optimizer",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "from 2 shards" in result.stdout
    assert "Reading shards" in result.stderr  # the progress bar
    full = torch.load(output, weights_only=True)
    model = ToyRegressor(in_features=8, width=32, num_blocks=4)
    model.load_state_dict(full["model"], strict=True)
    # The work dir's latest checkpoint is the final one, whose weights are the step's weights.pt.
    assert (
        max_abs_difference(full["model"], torch.load(two_worker_run / "weights.pt", weights_only=True)) == 0.0
    )
    assert set(full["optimizer"]["state"]) == set(full["model"])


@pytest.mark.parametrize(
    "marker_lists_files",
    [pytest.param(True, marks=pytest.mark.extended), pytest.param(False, marks=pytest.mark.extended)],
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
    result = run_tango(config, tmp_path / "ws", cwd=tmp_path / "cwd")
    assert "has no lr_scheduler state: the learning-rate schedule starts from its first step" in (
        result.stdout + result.stderr
    )
    assert (
        checkpointing.read_marker(train_work_dir(tmp_path / "ws") / "checkpoint_state_latest")[  # type: ignore[index]
            "training_steps"
        ]
        == 6
    )
