"""
SIGINT (Ctrl-C, which the terminal sends to the whole process group) and SIGTERM (to the main
``tango`` process only, as a script or a scheduler sends it) stop every worker within seconds, and
the run ends with one line saying what stopped it and how to resume, exit status 130 or 143, and
nothing else: no traceback, no ``Aborted!``, no leaked-semaphore warning. (That a worker dies with
its main process however that dies is tests/test_launch.py's ``test_a_worker_dies_with_its_parent``.)
"""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from tango_fairscale.checkpointing import is_complete, newest_complete_checkpoint
from tango_fairscale.launch.signals import TrainingStopped
from tango_fairscale.telemetry.metrics import read_metrics
from tests.helpers import (
    REPO,
    descendants,
    dump_stacks,
    error_lines,
    one_line_error,
    tango_command,
    tango_env,
    train_config,
    train_work_dir,
)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs: exists and is no zombie (which has stopped, unreaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _complete_checkpoints(workspace: Path) -> List[Path]:
    """The complete checkpoints of the training step in ``workspace`` (none while it writes its first)."""
    return [
        path
        for path in workspace.glob("cache/TorchTrainStep-*/work/checkpoint_state_step*")
        if is_complete(path)
    ]


@pytest.mark.parametrize(
    "signum, to_group, exit_code",
    # SIGINT to the group in the extended suite: make test sends it in
    # test_sigint_to_the_main_process_alone_or_to_its_group_is_the_same_one_line.
    [pytest.param(signal.SIGINT, True, 130, marks=pytest.mark.extended), (signal.SIGTERM, False, 143)],
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
        # Past the first checkpoint (step 4), complete (its every file and its marker written), so
        # that the line names one to resume from.
        while not _complete_checkpoints(tmp_path / "ws"):
            assert main.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "training did not reach its first checkpoint"
            time.sleep(0.2)
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


def _start(experiment: Dict[str, Any], root: Path) -> Tuple[subprocess.Popen, Path]:
    """``tango run`` of ``experiment`` in its own session and process group, its output to a file."""
    log = root / "tango.log"
    root.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        tango_command(experiment, root / "ws", root / "cwd"),
        cwd=root / "cwd",
        env={**tango_env(), "OMP_NUM_THREADS": "1"},
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return process, log


def _finish(process: subprocess.Popen, log: Path) -> str:
    """Wait for the run to end (kill it and what it left after 60 s); its output."""
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        dump_stacks(process.pid)
        output = log.read_text()[-12000:]
        pytest.fail(f"the run did not end within 60 s; its output, each process's stacks last:\n{output}")
    finally:
        if process.poll() is None:
            process.kill()
        for pid in descendants(process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return log.read_text()


def _stop_line(output: str) -> str:
    """The one ERROR line of a stopped run, without its time and source location."""
    (line,) = error_lines(output)
    return line


@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_sigint_to_the_main_process_alone_or_to_its_group_is_the_same_one_line(
    backend: str, tmp_path: Path
) -> None:
    """
    A scheduler's or ``timeout``'s SIGINT reaches the ``tango`` process alone; a terminal's Ctrl-C,
    its whole process group. Either, as soon as the training step starts (pre-flight), ends the run
    with the same one line and exit status 130 (before: SIGINT to the main process during
    pre-flight printed click's "Aborted!" and exited 1).
    """
    experiment = train_config(
        device_count=2,
        train_steps=500,
        checkpoint_every=4,
        engine_extra={"backend": backend},
        callbacks=[{"type": "test::slow_down", "seconds": 0.2}],
    )
    runs = {
        to_group: _start(experiment, tmp_path / ("group" if to_group else "main"))
        for to_group in (False, True)
    }
    outputs, lines = {}, {}
    for to_group, (process, log) in runs.items():
        deadline = time.monotonic() + 240
        while 'Starting step "train"' not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.02)
        if to_group:
            os.killpg(process.pid, signal.SIGINT)
        else:
            os.kill(process.pid, signal.SIGINT)
    for to_group, (process, log) in runs.items():
        outputs[to_group] = _finish(process, log)
        assert process.returncode == 130, outputs[to_group][-4000:]
        for noise in ("Traceback", "Aborted!", "KeyboardInterrupt", "Uncaught exception", "leaked semaphore"):
            assert noise not in outputs[to_group], f"{noise!r} in the output:\n{outputs[to_group][-4000:]}"
        lines[to_group] = _stop_line(outputs[to_group])
    print(lines)
    # The same one line, whichever got the signal: the training step's, or the run's where the
    # step had not yet taken over (the moment the signal lands differs between runs). The workers
    # start one after the other: a signal between the two stops the one that runs.
    for line in lines.values():
        assert re.fullmatch(
            r"Stopped by SIGINT \(Ctrl-C\): (no worker running( yet)?|[12] worker\(s\) stopped), no "
            r"checkpoint written for the interruption; rerun the same tango run command to (start the step "
            r"again \(it had no complete checkpoint yet\)|go on from the steps it finished \(they are in the "
            r"workspace\)) \(exit status 130\)\.",
            line,
        ), lines


def test_a_worker_killed_by_sigkill_is_one_line_naming_it_the_signal_and_the_oom_killer(
    tmp_path: Path,
) -> None:
    """
    The OOM killer's SIGKILL to one worker: the run ends with one line naming that worker (rank and
    pid), the signal, the likely cause and the checkpoint to resume from (before: Tango's 34-line
    traceback of mp.spawn's ``ProcessExitedException: process 1 terminated with signal SIGKILL``).
    """
    experiment = train_config(
        device_count=2,
        train_steps=500,
        checkpoint_every=4,
        callbacks=[{"type": "test::record_process"}, {"type": "test::slow_down", "seconds": 0.2}],
    )
    process, log = _start(experiment, tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not list(
            (tmp_path / "ws").glob("cache/TorchTrainStep-*/work/checkpoint_state_step4/COMPLETE.json")
        ):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        work_dir = train_work_dir(tmp_path / "ws")
        rank0 = json.loads((work_dir / "process.json").read_text())["pid"]
        workers = [
            pid
            for pid in descendants(process.pid)
            if pid != rank0 and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(workers) == 1, workers  # worker 1 (the resource tracker is no spawn_main)
        os.kill(workers[0], signal.SIGKILL)
    finally:
        output = _finish(process, log)
    assert process.returncode == 1, output[-4000:]
    line = one_line_error(output)
    assert line == (
        f"Worker 1 (pid {workers[0]}) was killed by SIGKILL: out of memory? The kernel's OOM killer "
        f"sends SIGKILL: see `dmesg` or `journalctl -k` for 'Killed process {workers[0]}'; lower the "
        "batch size, or the workers' memory (docs/capacity.md). Rerun the same tango run command to "
        f"resume from its latest checkpoint, {_newest(work_dir)}."
    ), line


def _newest(work_dir: Path) -> str:
    newest = newest_complete_checkpoint(work_dir)
    assert newest is not None
    return newest.name


#: ``consolidate`` whose first tensor written sends the process ``sys.argv[1]`` (a signal's name):
#: a Ctrl-C (or a scheduler's SIGTERM) in the middle of the write.
_SIGNALLED_CONSOLIDATE = """
import os, signal, sys, time
from tango_fairscale import cli
from tango_fairscale.checkpointing import consolidation
original, signum = consolidation.save_model, getattr(signal, sys.argv[1])
def save_model(source, output, progress=None, **options):
    def after_a_tensor():
        progress()
        os.kill(os.getpid(), signum)
        time.sleep(5)
    return original(source, output, progress=after_a_tensor, **options)
consolidation.save_model = save_model
sys.exit(cli.main(["consolidate", *sys.argv[2:]]))
"""


@pytest.mark.parametrize(
    "backend, signum, exit_status", [(None, signal.SIGINT, 130), ("torch", signal.SIGTERM, 143)]
)
def test_a_signal_during_consolidate_is_one_line_and_leaves_nothing_at_the_target(
    backend: Any, signum: int, exit_status: int, toy_train: Any, tmp_path: Path
) -> None:
    """
    SIGINT or SIGTERM in the middle of ``consolidate``'s write: one line, exit status 130 or 143,
    and nothing at the target, neither the partial temporary nor the directories made for it
    (before: SIGINT printed a 22-line ``KeyboardInterrupt`` traceback and left the directories,
    SIGTERM killed it with a partial ``.full.pt.PID.HEX.tmp`` left); the same command again writes it.
    """
    from tango_fairscale.checkpointing import consolidation, resolve_checkpoint
    from tango_fairscale.cli import main

    work_dir = toy_train("fairscale", "nested", backend=backend)
    output = tmp_path / "target" / "new" / "full.pt"
    (tmp_path / "target").mkdir()
    name = signal.Signals(signum).name
    result = subprocess.run(
        [sys.executable, "-c", _SIGNALLED_CONSOLIDATE, name, str(work_dir), str(output)],
        cwd=REPO,
        env=tango_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == exit_status, result.stderr[-4000:]
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr
    # The progress bar, then the one line.
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Writing tensors" not in line]
    described = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else "SIGTERM"
    assert lines == [
        f"error: consolidate stopped by {described}: nothing written at {output}; run the same command again."
    ], result.stderr
    assert list((tmp_path / "target").iterdir()) == []
    assert main(["consolidate", str(work_dir), str(output)]) == 0
    written = torch.load(output, map_location="cpu", weights_only=True)
    expected = consolidation.consolidate(resolve_checkpoint(work_dir))
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


def test_a_workers_death_names_the_likely_cause_of_its_signal_or_its_exit_status() -> None:
    from torch.multiprocessing import ProcessExitedException

    from tango_fairscale.launch.failures import worker_died

    resume = "rerun the same tango run command to resume from its latest checkpoint, checkpoint_state_step4"
    crashed = ProcessExitedException(
        "process 0 terminated with signal SIGSEGV",
        error_index=0,
        error_pid=42,
        exit_code=-11,
        signal_name="SIGSEGV",
    )
    assert str(worker_died(crashed, 2, resume)) == (
        "Worker 2 (pid 42) was killed by SIGSEGV: a crash in native code (segmentation fault): a library's "
        "bug, or one built for another torch. Rerun the same tango run command to resume from its latest "
        "checkpoint, checkpoint_state_step4."
    )
    exited = ProcessExitedException(
        "process 1 terminated with exit code 3", error_index=1, error_pid=43, exit_code=3
    )
    assert str(worker_died(exited, 1, resume)).startswith(
        "Worker 1 (pid 43) exited with status 3 without raising an error (a library called exit). Rerun "
    )


def test_a_signal_that_lands_while_a_record_is_written_is_still_one_line(
    capfd: pytest.CaptureFixture,
) -> None:
    """
    The signal can land while Tango's rich console is flushing a log record: logging the stop
    line from the handler then re-entered the console and printed "--- Logging error ---" with a
    traceback (seen once in make test). Inside a logging call the line goes to standard error
    directly, in the log's shape; elsewhere it is logged.
    """
    import logging
    import sys

    from tango_fairscale.launch import signals

    frames = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            frames.append(sys._getframe())

    probe = logging.getLogger("tango_fairscale.test.reentry")
    probe.addHandler(Capture())
    probe.propagate = False
    probe.error("a record")
    assert signals._in_logging(frames[0]) and not signals._in_logging(sys._getframe())
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    signals.logger.addHandler(handler)
    try:
        stopped = signals._log_stopped(signal.SIGINT, "no worker running", "rerun it", frames[0])
    finally:
        signals.logger.removeHandler(handler)
    err = capfd.readouterr().err
    assert stopped.code == 130 and records == [], records
    (line,) = [line for line in err.splitlines() if " ERROR " in line]
    assert line.split(" ERROR ", 1)[1].strip() == (
        "Stopped by SIGINT (Ctrl-C): no worker running, no checkpoint written for the interruption; "
        "rerun it (exit status 130)."
    ), err


_STARTING_WORKER_SCRIPT = """
import multiprocessing, sys
from tango_fairscale.launch.signals import TrainingStopped, stop_workers_on_signals


class SlowToUnpickle:
    # Unpickled in the new process before the payload behind it is read: the parent's write of
    # the payload blocks meanwhile, as it does while a spawned worker imports torch.
    def __reduce__(self):
        return (eval, ("__import__('time').sleep(20) or 0",))


if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(
        target=dict, kwargs={"slow": SlowToUnpickle(), "payload": b"x" * (8 << 20)}
    )
    try:
        with stop_workers_on_signals(grace=2.0, resume_hint=lambda: "rerun it"):
            process.start()
            print("started", flush=True)
    except TrainingStopped as stopped:
        print("stopped", stopped.code, flush=True)
"""


def test_a_signal_while_a_worker_is_being_started_stops_that_worker_too(tmp_path: Path) -> None:
    """
    ``multiprocessing`` lists a worker among the running ones only once ``Process.start`` returns,
    after writing the worker's pickled arguments into a pipe, which takes as long as the new
    process takes to import what they need. A signal landing then counted "no worker running
    yet", left that worker running, and once the main process exited the worker printed an
    ``EOFError`` traceback (seen in an interrupted ``tango run``). Now the worker being started is
    stopped and counted like the others.
    """
    script = tmp_path / "start_one_worker.py"
    script.write_text(_STARTING_WORKER_SCRIPT)
    main = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (starting := [pid for pid in descendants(main.pid) if _is_spawned_worker(pid)]):
            assert main.poll() is None and time.monotonic() < deadline, main.communicate()
            time.sleep(0.01)
        (worker,) = starting
        # The worker is in its 20-second unpickling; the main process writes the payload.
        time.sleep(1.0)
        main.send_signal(signal.SIGINT)
        out, err = main.communicate(timeout=30)
    finally:
        for pid in [main.pid, *descendants(main.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert out.split() == ["stopped", "130"], (out, err)
    assert not _running(worker), f"worker {worker} is still running"
    assert "Traceback" not in err and "EOFError" not in err, err
    (line,) = [line for line in err.splitlines() if "Stopped by" in line]
    assert "Stopped by SIGINT (Ctrl-C): 1 worker(s) stopped," in line, err


def _is_spawned_worker(pid: int) -> bool:
    try:
        return "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def _run_script(tmp_path: Path, text: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``text`` run as a script of its own in a fresh Python, with the repository importable."""
    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


_INJECTED_STOPS_SCRIPT = """
import faulthandler, json, os, queue, signal, sys, threading, time
from sqlitedict import SqliteDict
from tango_fairscale.launch import signals
from tango_fairscale.launch.signals import TrainingStopped, stop_workers_on_signals

faulthandler.dump_traceback_later(120, exit=True)
signals.REDELIVER_AFTER_S = 0.002  # the sweep's many stops, sooner
RECORDS = sys.argv[1]
# Where the stop lands: each line of the code a step record's write runs in the main thread.
FILES = {threading.__file__, queue.__file__, sys.modules["sqlitedict"].__file__}


def write_record(value):
    # What Tango's LocalWorkspace.step_starting does as a step starts.
    with SqliteDict(RECORDS) as records:
        records["step"] = value
        records.commit()


def records_still_work():
    # In a thread of its own: a hang shows as False after 5 s, not as a hung test.
    done = []

    def read():
        with SqliteDict(RECORDS) as records:
            done.append(records["step"])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    return bool(done)


def stop_at_line(n, seen):
    def tracer(frame, event, arg):
        if event == "line" and frame.f_code.co_filename in FILES:
            seen[0] += 1
            if seen[0] == n:
                os.kill(os.getpid(), signal.SIGINT)
        return tracer

    return tracer


write_record(0)
results = []
n = 1
while True:
    seen, stopped = [0], False
    try:
        with stop_workers_on_signals(grace=1.0, resume_hint=lambda: "rerun it"):
            sys.settrace(stop_at_line(n, seen))
            try:
                write_record(n)
            finally:
                sys.settrace(None)
            time.sleep(3)  # a stop put off until the record was written lands here
    except TrainingStopped:
        stopped = True
    if seen[0] < n:
        break
    results.append([n, stopped, records_still_work()])
    n += 1
print(json.dumps(results))
"""


def test_a_stop_landing_anywhere_in_a_step_records_write_stops_the_run_and_leaves_it_working(
    tmp_path: Path,
) -> None:
    """
    A stop signal is handled between two bytecodes, wherever the main thread is. Raised inside
    ``threading``'s, ``queue``'s or ``sqlitedict``'s code, it can leave a lock held or a request
    unanswered: CI saw a ``tango run`` print the stop's line after SIGINT and then stay in Tango's
    ``step_starting`` (writing the step's record with ``SqliteDict``) until the test killed it 60 s
    later. Here the stop is sent at each line of that code in turn; each time the run must be
    stopped, and the records must still be written and read afterwards (before: the sweep hung, or
    failed with "release unlocked lock", at its first injections into ``Thread.start``).
    """
    run = _run_script(tmp_path, _INJECTED_STOPS_SCRIPT, str(tmp_path / "records.sqlite"), timeout=300)
    assert run.returncode == 0, run.stderr[-6000:]
    results = json.loads(run.stdout)
    assert len(results) > 100, results  # a line of each of the three modules, and more
    assert [n for n, stopped, _ in results if not stopped] == [], run.stderr[-3000:]
    assert [n for n, _, works in results if not works] == [], run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr[-3000:]


_FINALIZER_SCRIPT = """
import os, signal, sys, time
from tango_fairscale.launch.signals import (
    StopSignal, stop_run_on_signals, stop_signals_raise, stop_workers_on_signals,
)


class SignalledWhileFinalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100000):  # the handler runs in here, inside __del__
            pass


def work():
    SignalledWhileFinalized()  # dropped at once: its __del__ runs
    time.sleep(5)
    print("not stopped", flush=True)


if sys.argv[1] == "tango run":
    stop_run_on_signals()
    work()
elif sys.argv[1] == "training step":
    with stop_workers_on_signals(grace=1.0, resume_hint=lambda: "rerun it"):
        work()
else:
    try:
        with stop_signals_raise():
            work()
    except StopSignal as stop:
        print(f"stopped by {stop.describe()}", file=sys.stderr)
        sys.exit(stop.exit_status)
"""


@pytest.mark.parametrize("where", ["tango run", "training step", "command"])
def test_a_stop_landing_inside_a_finalizer_still_stops_the_run(where: str, tmp_path: Path) -> None:
    """
    An exception raised inside ``__del__`` is printed as "Exception ignored" and lost. A SIGINT
    that landed while the garbage collector closed one of Tango's ``SqliteDict`` (make test, torch
    2.11) was lost that way: the handler logged the stop's line, put Python's default handlers
    back, and its exception vanished; the step trained on. The stop now waits until the finalizer
    has returned.
    """
    run = _run_script(tmp_path, _FINALIZER_SCRIPT, where, timeout=60)
    assert run.returncode == 130, (run.stdout, run.stderr)
    assert "not stopped" not in run.stdout and "Exception ignored" not in run.stderr, run.stderr
    (line,) = [
        line for line in run.stderr.splitlines() if "Stopped by SIGINT" in line or "stopped by" in line
    ]
    assert "SIGINT" in line, run.stderr
