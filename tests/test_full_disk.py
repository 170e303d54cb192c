"""
A full disk: every write of the package fails with one line naming the file and ``ENOSPC``, and
leaves no partial file behind; through ``tango run`` (either backend, during a checkpoint and
during ``weights.pt``) the run ends with that one line, the last complete checkpoint intact, and a
rerun with more space resumes to the uninterrupted run's weights. The disk is a small tmpfs in a
private mount namespace (root only).
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, Optional

import pytest
import torch

from tango_fairscale import checkpointing
from tests import harness
from tests.helpers import (
    REPO,
    max_abs_difference,
    one_line_error,
    tango_command,
    tango_env,
    toy_model,
    train_config,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare for a private tmpfs"
)

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from tango_fairscale import checkpointing
    from tango_fairscale.backends.torch_fsdp2.checkpoint import save_sharded
    from tango_fairscale.checkpointing.streaming import TensorEntry, stream_save

    disk = Path(sys.argv[1])
    big = torch.zeros(256 * 1024)  # 1 MiB, on a disk of 256 KiB
    # The torch backend's DCP save, on one gloo worker: a model and AdamW moments of 3 MiB.
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
    model = torch.nn.Linear(512, 512)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 512)).sum().backward()
    optimizer.step()
    for name, write in (
        ("atomic_save", lambda path: checkpointing.atomic_save({"x": big}, path)),
        (
            "stream_save",
            lambda path: stream_save(
                [TensorEntry("x", tuple(big.shape), big.dtype)], lambda entry: big, path
            ),
        ),
        ("save_sharded", lambda path: save_sharded(path, model, optimizer, {"trainer": {"step": 1}}, step=1)),
    ):
        try:
            write(disk / f"{name}.pt")
            print(name, "wrote")
        except checkpointing.CheckpointError as error:
            print(name, "|", error)
    print("left:", sorted(path.name for path in disk.iterdir()))
    dist.destroy_process_group()
    """
)


def test_a_full_disk_is_one_line_naming_the_file(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "write.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f'mount -t tmpfs -o size=256k none "{disk}" && '
            f'exec "{sys.executable}" "{script}" "{disk}" "{tmp_path / "store"}"',
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in ("atomic_save", "stream_save"):
        line = next(line for line in lines if line.startswith(name))
        assert line == f"{name} | Cannot write {disk}/{name}.pt: No space left on device (ENOSPC).", line
    # DCP's writer: the error names the checkpoint's DCP directory (its files are DCP's to name).
    # DCP pickles each worker's failure, which dropped the OSError behind torch.save's RuntimeError.
    line = next(line for line in lines if line.startswith("save_sharded"))
    assert (
        line == f"save_sharded | Cannot write {disk}/save_sharded.pt/dcp: No space left on device (ENOSPC)."
    ), line
    print("\n".join(lines))
    # The temporary files the writes went through are gone: the disk is as it was.
    assert lines[-1] == "left: []"


# --- Through `tango run`: the disk fills up during a save, and a rerun with more space ----------------

#: The toy model at width 256: a checkpoint of 3.2 MB (model and AdamW moments), weights.pt of 1 MB.
WIDTH = 256
#: What the full disk leaves free: less than any checkpoint or weights.pt, enough for Tango's own
#: bookkeeping (its step database and run log on the same disk).
LEAVE_BYTES = 512 << 10
ENOSPC_LINE = re.compile(r"CheckpointError: Cannot write (\S+): No space left on device \(ENOSPC\)\.$")


def full_disk_experiment(backend: str, fill_at: Optional[int] = None, fill: bool = True) -> Dict[str, Any]:
    """12 steps, checkpoints after steps 6 and 12; the disk filled after step index ``fill_at``
    (before its checkpoint) or, with ``None``, after the training loop (before ``weights.pt``)."""
    fill_disk = {"type": "test::fill_disk_once", "step": fill_at, "leave_bytes": LEAVE_BYTES}
    callbacks = [fill_disk] if fill else []
    return train_config(
        engine="fairscale",
        wrap="nested",
        model=toy_model(width=WIDTH),
        train_steps=12,
        checkpoint_every=6,
        callbacks=callbacks,
        engine_extra={"backend": backend},
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, torch.Tensor]]:
    """``weights.pt`` of the experiment run without interruption, each backend (tests.harness)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    jobs = {b: harness.Train(full_disk_experiment(b, fill=False), root / b) for b in ("fairscale", "torch")}
    for result in harness.run(list(jobs.values()), out=root / "harness"):
        result.check()
    return {b: torch.load(job.work_dir / "weights.pt", weights_only=True) for b, job in jobs.items()}


def _work_dir(workspace: Path) -> Path:
    (work_dir,) = workspace.glob("cache/TorchTrainStep-*/work")
    return work_dir


def _intact(checkpoint_dir: Path) -> None:
    """``checkpoint_dir`` is a complete checkpoint whose every file has its recorded size and SHA-256."""
    marker = checkpointing.read_marker(checkpoint_dir)
    assert marker is not None and checkpointing.is_complete(checkpoint_dir), checkpoint_dir
    checkpointing.verify_files(checkpoint_dir, marker, marker["digests"])


@pytest.mark.extended
@pytest.mark.parametrize("backend", ["fairscale", "torch"])
@pytest.mark.parametrize("during", ["second checkpoint", "weights.pt"])
def test_a_full_disk_during_a_run_is_one_line_and_a_rerun_with_space_resumes(
    tmp_path: Path, backend: str, during: str, uninterrupted: Dict[str, Dict[str, torch.Tensor]]
) -> None:
    # Before: a 66-74-line traceback ending in `[enforce fail at inline_container.cc] unexpected
    # pos`, and the torch backend's partial DCP directory left filling the disk.
    disk, cwd, out = tmp_path / "disk", tmp_path / "cwd", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    experiment = full_disk_experiment(backend, fill_at=11 if during == "second checkpoint" else None)
    command = " ".join(shlex.quote(part) for part in tango_command(experiment, disk / "ws", cwd))
    # One private mount namespace for both runs (the tmpfs lives as long as it): the first run
    # fills the disk; a copy of the workspace as it left it; the ballast removed (more space); the
    # same command again; a copy of what the rerun left.
    script = f"""
        mount -t tmpfs -o size=64m none {shlex.quote(str(disk))} || exit 99
        {command} > {out}/first.log 2>&1; echo $? > {out}/first.rc
        cp -a {disk}/ws {out}/after_first
        rm {disk}/ws/cache/TorchTrainStep-*/work/ballast
        {command} > {out}/rerun.log 2>&1; echo $? > {out}/rerun.rc
        cp -a {disk}/ws {out}/after_rerun
    """
    started = time.monotonic()
    subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=cwd, env=tango_env(), timeout=900, check=True)
    print(f"[{backend}, {during}] both runs: {time.monotonic() - started:.1f} s")

    # --- the run that filled the disk: exit != 0, one line naming ENOSPC and the path --------------
    first = (out / "first.log").read_text()
    first_rc = int((out / "first.rc").read_text())
    assert first_rc != 0, first[-4000:]
    assert "inline_container" not in first, first[-6000:]
    # The error, then only Tango's summary of the step and the run.
    error = one_line_error(first)
    found = ENOSPC_LINE.search(error)
    assert found, error
    print(f"[{backend}, {during}] exit {first_rc}; the error: {error}")
    work_dir = _work_dir(out / "after_first")
    # The path is on the full disk: a file of the second checkpoint, or weights.pt.
    named = Path(found.group(1))
    relative = named.relative_to(disk / "ws")
    if during == "second checkpoint":
        assert relative.parts[3] == "checkpoint_state_step12", named
        # No partial checkpoint left; the previous one, and the latest link, as they were.
        assert not (work_dir / "checkpoint_state_step12").exists()
        _intact(work_dir / "checkpoint_state_step6")
        assert os.readlink(work_dir / "checkpoint_state_latest").endswith("checkpoint_state_step6")
    else:
        assert relative.parts[3:] == ("weights.pt",), named
        assert not (work_dir / "weights.pt").exists()
        _intact(work_dir / "checkpoint_state_step12")
        assert os.readlink(work_dir / "checkpoint_state_latest").endswith("checkpoint_state_step12")
    leftovers = [str(p.relative_to(work_dir)) for p in work_dir.rglob("*") if p.name.endswith(".tmp")]
    assert not leftovers, leftovers

    # --- the rerun with more space: resumes, and ends with the uninterrupted run's weights ---------
    rerun = (out / "rerun.log").read_text()
    assert int((out / "rerun.rc").read_text()) == 0, rerun[-6000:]
    resumed = "checkpoint_state_step6" if during == "second checkpoint" else "checkpoint_state_step12"
    assert f"Recovering from previous run at {disk}/ws/cache/" in rerun and resumed in rerun, rerun[-4000:]
    weights = torch.load(_work_dir(out / "after_rerun") / "weights.pt", weights_only=True)
    difference = max_abs_difference(weights, uninterrupted[backend])
    print(f"[{backend}, {during}] max |rerun weights.pt - uninterrupted| = {difference:.3e}")
    assert difference == 0.0
