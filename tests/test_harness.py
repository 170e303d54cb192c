"""The harness's own guarantees: a run that does not end in time shows where it waits; nothing outlives it."""

import logging
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest

from tests import harness


def _worker_1_waits_forever(worker: harness.Worker) -> int:
    logging.getLogger("tests.test_harness").info("worker %d before the wait", worker.rank)
    if worker.rank == 1:
        while True:
            time.sleep(0.1)
    return worker.rank


def test_a_run_that_does_not_end_in_time_shows_each_workers_stack_and_log_and_is_killed(
    tmp_path: Path,
) -> None:
    with pytest.raises(AssertionError) as failure:
        harness.run([harness.Call(_worker_1_waits_forever)], out=tmp_path, timeout=4)
    report = str(failure.value)
    assert "1 worker(s) still running after 4 s: killed" in report, report
    # Worker 1's stack, down to the frame it waits in, and its log line; worker 0 ended normally.
    stacks = report.split("=== worker 1: stacks ===")[1]
    assert " in _worker_1_waits_forever" in stacks, report
    assert "=== worker 1 (running): last log lines ===" in report, report
    assert "[rank 1] INFO tests.test_harness: worker 1 before the wait" in report, report
    assert "=== worker 0 (exit code 0): last log lines ===" in report, report
    assert multiprocessing.active_children() == []


def _port(worker: harness.Worker) -> Any:
    return worker._port()


def test_every_worker_of_a_job_gets_the_port_worker_0_chose_as_the_job_started(tmp_path: Path) -> None:
    first, second = harness.run([harness.Call(_port), harness.Call(_port)], out=tmp_path)
    assert first.values[0] == first.values[1], first.describe()
    assert second.values[0] == second.values[1], second.describe()
    assert first.values[0] != second.values[0]
