"""
A full disk: every write of the package fails with one line naming the file and ``ENOSPC``, and
leaves no partial file behind. The disk is a small tmpfs in a private mount namespace (root only).
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare for a private tmpfs"
)

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    from tango_fairscale import checkpointing
    from tango_fairscale.checkpointing.streaming import TensorEntry, stream_save

    disk = Path(sys.argv[1])
    big = torch.zeros(256 * 1024)  # 1 MiB, on a disk of 256 KiB
    for name, write in (
        ("atomic_save", lambda path: checkpointing.atomic_save({"x": big}, path)),
        (
            "stream_save",
            lambda path: stream_save(
                [TensorEntry("x", tuple(big.shape), big.dtype)], lambda entry: big, path
            ),
        ),
    ):
        try:
            write(disk / f"{name}.pt")
            print(name, "wrote")
        except checkpointing.CheckpointError as error:
            print(name, "|", error)
    print("left:", sorted(path.name for path in disk.iterdir()))
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
            f'mount -t tmpfs -o size=256k none "{disk}" && exec "{sys.executable}" "{script}" "{disk}"',
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
    # The temporary files the writes went through are gone: the disk is as it was.
    assert lines[-1] == "left: []"
