"""
SIGINT (Ctrl-C, which the terminal sends to the whole process group) and SIGTERM (to the main
``tango`` process only, as a script or a scheduler sends it) stop every worker within seconds, and
the run ends with one line saying what stopped it and how to resume, exit status 130 or 143, and
nothing else: no traceback, no ``Aborted!``, no leaked-semaphore warning. (That a worker dies with
its main process however that dies is tests/test_launch.py's ``test_a_worker_dies_with_its_parent``.)
"""

import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tango_fairscale.checkpointing import is_complete
from tango_fairscale.launch.signals import TrainingStopped
from tango_fairscale.metrics import read_metrics
from tests.helpers import descendants, tango_command, tango_env, train_config, train_work_dir


def _running(pid: int) -> bool:
    """Whether ``pid`` runs: exists and is no zombie (which has stopped, unreaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    "signum, to_group, exit_code",
    [(signal.SIGINT, True, 130), (signal.SIGTERM, False, 143)],
    ids=["SIGINT to the process group (Ctrl-C)", "SIGTERM to the main process"],
)
def test_a_signal_stops_every_worker_with_one_line(
    signum: int, to_group: bool, exit_code: int, tmp_path: Path
) -> None:
    name = signal.Signals(signum).name
    experiment = train_config(
        engine="fairscale",
        wrap="root",
        device_count=2,
        train_steps=500,
        checkpoint_every=4,
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
        # Its own session and process group: a terminal's Ctrl-C goes to the group, with the workers.
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        # Past the first checkpoint (step 4), so that the line names one to resume from.
        while not list((tmp_path / "ws").glob("cache/TorchTrainStep-*/work/checkpoint_state_step4")):
            assert main.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "training did not reach its first checkpoint"
            time.sleep(0.2)
        time.sleep(0.5)
        workers = descendants(main.pid)
        assert len(workers) >= 2, workers  # the 2 workers (and multiprocessing's resource tracker)
        sent = time.monotonic()
        if to_group:
            os.killpg(main.pid, signum)
        else:
            os.kill(main.pid, signum)
        while any(_running(pid) for pid in workers) and time.monotonic() - sent < 10:
            time.sleep(0.1)
        left = [pid for pid in workers if _running(pid)]
        print(f"{name}: workers gone {time.monotonic() - sent:.2f} s after the signal")
        assert not left, f"still running 10 s after {name}: {left}"
        main.wait(timeout=30)
        output = log.read_text()
        assert main.returncode == exit_code, output[-4000:]
    finally:
        if main.poll() is None:
            main.kill()
        for pid in descendants(main.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # One line from the package: what stopped the run, and how to resume.
    lines = [line for line in output.splitlines() if "Stopped by" in line]
    assert len(lines) == 1, output[-4000:]
    stop = re.search(r"Stopped by (\w+).*?: 2 worker\(s\) stopped.*?; (.*?) \(exit status (\d+)\)", lines[0])
    assert stop is not None, lines[0]
    assert stop.group(1) == name and int(stop.group(3)) == exit_code, lines[0]
    resume = re.fullmatch(
        r"rerun the same tango run command to resume from its latest checkpoint, (\S+)", stop[2]
    )
    assert resume is not None, lines[0]
    work_dir = train_work_dir(tmp_path / "ws")
    assert is_complete(work_dir / resume.group(1)), resume.group(1)
    # And nothing else: no traceback (Tango's, a worker's), no click "Aborted!", no second account
    # of the stop, no leaked-semaphore warning, no pkg_resources warning.
    for noise in (
        "Traceback",
        "Aborted!",
        "KeyboardInterrupt",
        "SystemExit",
        "Uncaught exception",
        'Step "train" failed',
        "leaked semaphore",
        "pkg_resources",
    ):
        assert noise not in output, f"{noise!r} in the output:\n{output[-4000:]}"
    # The workers computed with OMP_NUM_THREADS's thread, as the metrics log's run line says.
    lines_logged, _ = read_metrics(work_dir / "metrics.jsonl")
    (run_line,) = [line for line in lines_logged if line["kind"] == "run"]
    assert run_line["threads"] == {"intra_op": 1, "source": "OMP_NUM_THREADS", "blas": 1}


@pytest.mark.parametrize("level, logged", [(logging.WARNING, False), (logging.DEBUG, True)])
def test_tango_logs_a_stopped_step_again_only_at_debug_level(
    level: int, logged: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """T6: Tango's step does not log the stop again, with its traceback, unless debugging."""
    from tango import Step

    import tango_fairscale  # noqa: F401 - installs T6

    class Stopped(Step):
        def run(self) -> None:  # type: ignore[override]
            raise TrainingStopped(signal.SIGTERM)

    step = Stopped()
    try:
        step.run()
    except TrainingStopped as error:
        assert error.code == 143
        with caplog.at_level(level, logger=step.logger.name):
            step.log_failure(error)
    logged_traceback = any(
        record.getMessage() == "Uncaught exception" and record.exc_info is not None
        for record in caplog.records
    )
    assert logged_traceback is logged, caplog.text
