"""
SIGINT and SIGTERM sent to the main ``tango`` process only (as a script or a scheduler sends
them, not to its process group) stop every worker within seconds, and the main process exits
non-zero: no orphan keeps training. (That a worker dies with its main process however that dies
is tests/test_launch.py's ``test_a_worker_dies_with_its_parent``.)
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import descendants, tango_command, tango_env, train_config

pytestmark = pytest.mark.slow


def _running(pid: int) -> bool:
    """Whether ``pid`` runs: exists and is no zombie (which has stopped, unreaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    "signum, exit_code",
    # SIGINT's path differs from SIGTERM's only in the exit code: extended.
    [pytest.param(signal.SIGINT, 1, marks=pytest.mark.extended), (signal.SIGTERM, 128 + signal.SIGTERM)],
    ids=["SIGINT", "SIGTERM"],
)
def test_signal_to_the_main_process_stops_every_worker(signum: int, exit_code: int, tmp_path: Path) -> None:
    experiment = train_config(
        engine="fairscale",
        wrap="root",
        device_count=2,
        train_steps=500,
        checkpoint_every=500,
        callbacks=[{"type": "test::record_losses"}, {"type": "test::slow_down", "seconds": 0.2}],
    )
    command = tango_command(experiment, tmp_path / "ws", tmp_path / "cwd")
    log = tmp_path / "tango.log"
    main = subprocess.Popen(
        command,
        cwd=tmp_path / "cwd",
        env={**tango_env(), "OMP_NUM_THREADS": "1"},
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        # Its own session, so that nothing here signals the workers but the main process.
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not list((tmp_path / "ws").glob("cache/TorchTrainStep-*/work/losses.json")):
            assert main.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        workers = descendants(main.pid)
        assert len(workers) >= 2, workers  # the 2 workers (and multiprocessing's resource tracker)
        sent = time.monotonic()
        os.kill(main.pid, signum)
        while any(_running(pid) for pid in workers) and time.monotonic() - sent < 10:
            time.sleep(0.1)
        left = [pid for pid in workers if _running(pid)]
        print(f"{signal.Signals(signum).name}: workers gone {time.monotonic() - sent:.2f} s after the signal")
        assert not left, f"still running 10 s after {signal.Signals(signum).name}: {left}"
        main.wait(timeout=30)
        assert main.returncode == exit_code, log.read_text()[-4000:]
    finally:
        if main.poll() is None:
            main.kill()
        for pid in descendants(main.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
