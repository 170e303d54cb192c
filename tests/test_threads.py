"""
CPU workers compute with their share of the host's cores (torch's intra-op threads), unless
``OMP_NUM_THREADS`` or the engine's ``cpu_threads_per_worker`` says otherwise; the metrics log's
run line records the number and where it came from; a bad option is refused in one line. Spawned
CPU workers start numpy's OpenBLAS with the same number of threads unless the user chose one.
"""

import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import pytest
import torch
from tango.common.exceptions import ConfigurationError

from tango_fairscale.cpu.threads import (
    BLAS_VARIABLES,
    SOURCE_ENVIRONMENT,
    SOURCE_OPTION,
    SOURCE_SHARE,
    available_cores,
    blas_environment,
    blas_threads,
    choose_threads,
)
from tango_fairscale.options import EngineOptions
from tango_fairscale.preflight import check_engine
from tango_fairscale.telemetry.metrics import read_metrics
from tests import harness
from tests.helpers import ConcurrentProcesses, python_command, train_config

#: What a worker of 2 on this machine computes with by default.
SHARE_OF_TWO = max(1, available_cores() // 2)


def test_the_rules_in_order() -> None:
    # The share: the cores divided by the host's workers, rounded down, at least 1.
    assert choose_threads(None, {}, workers_on_host=2, cores=8) == (4, SOURCE_SHARE)
    assert choose_threads(None, {}, workers_on_host=3, cores=8) == (2, SOURCE_SHARE)
    assert choose_threads(None, {}, workers_on_host=4, cores=2) == (1, SOURCE_SHARE)
    assert choose_threads(None, {"OMP_NUM_THREADS": ""}, workers_on_host=2, cores=8) == (4, SOURCE_SHARE)
    # OMP_NUM_THREADS over the share; torch's reading of a form it is not a number of.
    assert choose_threads(None, {"OMP_NUM_THREADS": "3"}, workers_on_host=2, cores=8) == (
        3,
        SOURCE_ENVIRONMENT,
    )
    nested = choose_threads(None, {"OMP_NUM_THREADS": "4,2"}, workers_on_host=2, cores=8)
    assert nested == (torch.get_num_threads(), SOURCE_ENVIRONMENT)
    # The engine's option over both.
    assert choose_threads(6, {"OMP_NUM_THREADS": "3"}, workers_on_host=2, cores=8) == (6, SOURCE_OPTION)


def test_the_cores_are_the_process_affinity() -> None:
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this OS")
    assert available_cores() == len(os.sched_getaffinity(0))


def test_more_threads_than_cores_is_refused_in_one_line() -> None:
    cores = available_cores()
    message = (
        f"training_engine.cpu_threads_per_worker: {cores + 1} is more than the {cores} cores this process "
        f"may run on: give at most {cores} (or remove it for each worker's share of the cores)."
    )
    engine = train_config(engine_extra={"cpu_threads_per_worker": cores + 1})["steps"]["train"][
        "training_engine"
    ]
    with pytest.raises(ConfigurationError) as raised:
        check_engine(engine, device_count=2, on_cpu=True)
    assert str(raised.value) == message
    check_engine({**engine, "cpu_threads_per_worker": cores}, device_count=2, on_cpu=True)
    check_engine({**engine, "cpu_threads_per_worker": 10000}, device_count=1, on_cpu=False)  # GPUs: ignored


@pytest.mark.parametrize("value", [0, -2, True, "2", 1.5])
def test_a_bad_option_is_refused_in_one_line(value: Any) -> None:
    message = (
        "training_engine.cpu_threads_per_worker: must be a whole number of threads, 1 or more, "
        f"got {value!r} (remove it for each worker's share of the cores)."
    )
    options = EngineOptions.from_config({"type": "fairscale", "cpu_threads_per_worker": value})
    with pytest.raises(ConfigurationError) as raised:
        options.check(distributed=True, device_count=2, on_cpu=True, warn=False)
    assert str(raised.value) == message
    # Pre-flight, in Tango's main process before any worker starts, with the same message.
    engine = train_config(engine_extra={"cpu_threads_per_worker": value})["steps"]["train"]["training_engine"]
    with pytest.raises(ConfigurationError) as raised:
        check_engine(engine, device_count=2, on_cpu=True)
    assert str(raised.value) == message


def _threads_of_an_engine(
    worker: harness.Worker, omp: Optional[str], option: Optional[int], work_dir: Path
) -> Tuple[int, Dict[str, Any]]:
    """torch's intra-op threads in this worker once the engine is built (the model with it)."""
    from tango_fairscale.cpu.threads import describe_threads

    extra = {} if option is None else {"cpu_threads_per_worker": option}
    previous = os.environ.pop("OMP_NUM_THREADS", None)
    if omp is not None:
        os.environ["OMP_NUM_THREADS"] = omp
    try:
        torch.set_num_threads(7)  # what a fresh worker has on a 7-core host: the engine must change it
        worker.engine(train_config(engine_extra=extra), work_dir / f"rank{worker.rank}")
        return torch.get_num_threads(), describe_threads()
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if previous is not None:
            os.environ["OMP_NUM_THREADS"] = previous


def test_workers_compute_with_the_threads_chosen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cases = {
        "default": (None, None, SHARE_OF_TWO, SOURCE_SHARE),
        "OMP_NUM_THREADS": ("3", None, 3, SOURCE_ENVIRONMENT),
        "option": (None, 2, 2, SOURCE_OPTION),
        # At most the cores (more is refused): 2 of this machine's 2, against OMP_NUM_THREADS' 3.
        "option over OMP_NUM_THREADS": ("3", 2, 2, SOURCE_OPTION),
    }
    jobs = [
        harness.Call(_threads_of_an_engine, (omp, option, tmp_path)) for omp, option, _, _ in cases.values()
    ]
    # And a whole run: the run line of its metrics log says what its workers computed with.
    trained = harness.Train(train_config(train_steps=2, checkpoint_every=2), tmp_path / "trained")
    results = harness.run([*jobs, trained], out=tmp_path / "harness")
    for (name, (omp, _, threads, source)), result in zip(cases.items(), results):
        result.check()
        # OpenBLAS reads OMP_NUM_THREADS too, after its own variables (unset in these workers,
        # which the test forks: only spawned workers get OPENBLAS_NUM_THREADS).
        blas = blas_threads({**os.environ, **({"OMP_NUM_THREADS": omp} if omp else {})})
        expected = (threads, {"intra_op": threads, "source": source, "blas": blas})
        assert result.values == [expected, expected], name
    results[-1].check()
    lines, _ = read_metrics(trained.work_dir / "metrics.jsonl")
    (run_line,) = [line for line in lines if line["kind"] == "run"]
    assert run_line["threads"] == {"intra_op": SHARE_OF_TWO, "source": SOURCE_SHARE, "blas": blas_threads()}


def test_spawned_workers_start_openblas_with_their_threads_unless_the_user_chose() -> None:
    assert blas_environment({}, 3) == {"OPENBLAS_NUM_THREADS": "3"}
    assert blas_environment({"PATH": "/bin", "OPENBLAS_NUM_THREADS": ""}, 1) == {"OPENBLAS_NUM_THREADS": "1"}
    for variable in BLAS_VARIABLES:
        assert blas_environment({variable: "4"}, 1) == {}, variable
    # What OpenBLAS was told, first set variable winning; its default (one per core) is None.
    assert blas_threads({}) is None
    assert blas_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert blas_threads({"OMP_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "2"}) == 2
    assert blas_threads({"GOTO_NUM_THREADS": "5", "OMP_NUM_THREADS": "3"}) == 5
    # As OpenBLAS reads them (C's atoi): leading digits, and 0 or nothing passes to the next one.
    assert blas_threads({"OMP_NUM_THREADS": "4,2"}) == 4
    assert blas_threads({"OPENBLAS_NUM_THREADS": "0", "OMP_NUM_THREADS": "3"}) == 3
    assert blas_threads({"OPENBLAS_NUM_THREADS": "many"}) is None


# numpy's OpenBLAS threads (the process's threads after importing it) and VmData.
IMPORT_NUMPY = """
import os
import numpy
vm_data = [line for line in open("/proc/self/status") if line.startswith("VmData:")][0].split()[1]
print("NUMPY:", len(os.listdir("/proc/self/task")), int(vm_data) // 1024)
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in Linux's /proc")
@pytest.mark.skipif(available_cores() < 2, reason="OpenBLAS starts one thread on one core either way")
def test_a_worker_given_one_blas_thread_starts_no_idle_ones_and_reserves_less() -> None:
    plain = {name: value for name, value in os.environ.items() if name not in BLAS_VARIABLES}
    processes = ConcurrentProcesses(
        {
            "worker": python_command(IMPORT_NUMPY, env={**plain, **blas_environment(plain, 1)}),
            "default": python_command(IMPORT_NUMPY, env=plain),
        }
    )
    try:
        measured = {}
        for name in ("worker", "default"):
            result = processes.result(name)
            assert result.returncode == 0, result.stderr[-3000:]
            threads, vm_data_mib = result.stdout.split("NUMPY:")[1].split()
            measured[name] = (int(threads), int(vm_data_mib))
    finally:
        processes.close()
    print(f"after import numpy (threads, VmData MiB): {measured}")
    assert measured["worker"][0] == 1
    assert measured["default"][0] == min(available_cores(), 64)  # OpenBLAS's MAX_THREADS
    # Each thread OpenBLAS does not start is a buffer and a stack it does not reserve.
    assert measured["default"][1] - measured["worker"][1] >= 8 * (measured["default"][0] - 1)
