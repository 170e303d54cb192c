"""
CPU workers' malloc: transparent huge pages advised for the workers ``tango run`` spawns
(:func:`tango_fairscale.cpu.memory.cpu_worker_environment`), what it does to a process, and that the
workers of a real run have it; long-lived allocations in mappings of their own
(:func:`tango_fairscale.cpu.memory.long_lived_allocations`).
"""

import json
import os
import platform
from pathlib import Path
from typing import Iterator, Tuple

import pytest

from tango_fairscale.cpu.memory import HUGE_PAGES_TUNABLE, cpu_worker_environment, malloc_advises_huge_pages
from tango_fairscale.cpu.threads import available_cores
from tango_fairscale.telemetry.metrics import read_metrics
from tests.conftest import ToyRun
from tests.helpers import ConcurrentProcesses, python_command, train_work_dir

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_huge_pages_are_added_to_the_workers_tunables() -> None:
    assert cpu_worker_environment({}, 2, 4) == {
        "GLIBC_TUNABLES": f"{HUGE_PAGES_TUNABLE}=1",
        "OPENBLAS_NUM_THREADS": "2",
    }
    # The user's other tunables are kept, and the user's BLAS threads (tests/test_threads.py).
    user = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "OMP_NUM_THREADS": "4"}
    assert cpu_worker_environment(user, None, 2) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGE_PAGES_TUNABLE}=1"
    }


@pytest.mark.parametrize("value", ["0", "1", "2"])
def test_a_huge_pages_setting_of_the_user_is_left_alone(value: str) -> None:
    env = {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGE_PAGES_TUNABLE}={value}"}
    assert cpu_worker_environment(env, 1, 2) == {"OPENBLAS_NUM_THREADS": "1"}
    # Without the option, the worker's share of the cores (tests/test_threads.py).
    share = str(max(1, available_cores() // 2))
    assert cpu_worker_environment(env, None, 2) == {"OPENBLAS_NUM_THREADS": share}
    # 2 asks glibc for hugetlbfs pages, which it does not advise as transparent huge pages.
    assert malloc_advises_huge_pages(env) is (value == "1")


def test_a_process_without_the_tunable_does_not_advise() -> None:
    assert malloc_advises_huge_pages({}) is False
    assert malloc_advises_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) is False


# Allocates and writes a 64 MiB tensor (its own mapping, past glibc's mmap threshold), then reports
# how much of the process's anonymous memory is in huge pages.
TOUCH_AND_COUNT = """
import torch
tensor = torch.ones(16 << 20)
huge = [line for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")]
print("HUGE_KIB:", int(huge[0].split()[1]), float(tensor.sum()))
"""


# Where 4 MiB tensors land under a 16 MiB mmap threshold (heap: glibc's main heap, or a mapping
# of its own): before, inside and after long_lived_allocations, nested in it, and under a
# threshold of 2 MiB or less (which it leaves alone); then the thresholds of blocks that end in
# and out of order, and what is left when the last one ended (24 MiB tensors: a mapping under
# 16 MiB, the heap under the restored 32 MiB).
WHERE_TENSORS_LAND = """
import json
from contextlib import ExitStack
import torch
from tango_fairscale.cpu.memory import (
    RESTORED_MMAP_THRESHOLD_BYTES, current_mmap_threshold, limit_cpu_heap_growth, long_lived_allocations
)

def where(tensor):
    address = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
        if start <= address < end:
            return "heap" if line.rstrip().endswith("[heap]") else "mapping"

found, kept, thresholds = {}, [], {"at start": current_mmap_threshold()}
def allocate(name, mib=4):
    kept.append(torch.ones(mib << 18))  # written
    found[name] = where(kept[-1])
with limit_cpu_heap_growth(16 << 20) as applied:
    assert applied
    allocate("before")
    with long_lived_allocations():
        allocate("inside")
    allocate("after")
    with long_lived_allocations():
        with long_lived_allocations():
            allocate("nested")
        allocate("after nested")
    allocate("after both")
    with long_lived_allocations():
        with limit_cpu_heap_growth(32 << 20):  # recorded, applied when the long-lived block ends
            allocate("threshold set inside")
            thresholds["set inside"] = current_mmap_threshold()
        allocate("inside, after it ended")
    allocate("after it")
    with limit_cpu_heap_growth(1 << 20):
        with long_lived_allocations():
            kept.append(torch.ones(1 << 18))  # 1 MiB: a mapping under the 1 MiB threshold, left alone
            found["1 MiB threshold"] = where(kept[-1])
    allocate("1 MiB block ended")
    thresholds["1 MiB block ended"] = current_mmap_threshold()
    allocate("24 MiB under 16 MiB", 24)
# Blocks ending out of order (the engine's end when it is collected): the newest still open applies.
first, second = ExitStack(), ExitStack()
first.enter_context(limit_cpu_heap_growth(16 << 20))
second.enter_context(limit_cpu_heap_growth(1 << 20))
first.close()
thresholds["older ended first"] = current_mmap_threshold()
allocate("older ended first")
second.close()
thresholds["all ended"] = current_mmap_threshold()
allocate("24 MiB after all ended", 24)
assert RESTORED_MMAP_THRESHOLD_BYTES == 32 << 20
print("WHERE:", json.dumps({"found": found, "thresholds": thresholds}))
"""


@pytest.fixture(scope="module")
def scripts() -> Iterator[ConcurrentProcesses]:
    """
    The scripts, in fresh processes started at once: the huge-pages one started with the
    workers' tunable, and its control without (glibc reads the tunable when a process starts);
    the long-lived one without the user's mmap threshold (which would turn it off).
    """
    plain = {name: value for name, value in os.environ.items() if name != "GLIBC_TUNABLES"}
    processes = ConcurrentProcesses(
        {
            "advised": python_command(TOUCH_AND_COUNT, env={**plain, **cpu_worker_environment(plain, 1, 1)}),
            "default": python_command(TOUCH_AND_COUNT, env=plain),
            "long_lived": python_command(
                WHERE_TENSORS_LAND,
                env={name: value for name, value in plain.items() if name != "MALLOC_MMAP_THRESHOLD_"},
            ),
        }
    )
    yield processes
    processes.close()


def _glibc_version() -> Tuple[int, ...]:
    library, version = platform.libc_ver()
    return tuple(int(part) for part in version.split(".")[:2]) if library == "glibc" and version else ()


@pytest.mark.skipif(
    not THP_MODE.exists() or "[madvise]" not in THP_MODE.read_text(),
    reason="the kernel's transparent huge pages are not in madvise mode (the control needs it)",
)
@pytest.mark.skipif(_glibc_version() < (2, 35), reason="glibc.malloc.hugetlb is glibc 2.35's")
def test_a_process_started_with_it_maps_large_tensors_in_huge_pages(
    scripts: ConcurrentProcesses,
) -> None:
    kib = {}
    for name in ("advised", "default"):
        result = scripts.result(name)
        assert result.returncode == 0, result.stderr[-3000:]
        kib[name] = int(result.stdout.split("HUGE_KIB:")[1].split()[0])
    print(f"anonymous memory in huge pages after writing 64 MiB: {kib}")
    assert kib["advised"] >= 32 << 10  # most of the 64 MiB, in 2 MiB pages
    assert kib["default"] == 0


def test_the_workers_of_a_tango_run_advise_huge_pages_and_start_their_blas_threads(toy_run: ToyRun) -> None:
    run = toy_run("fairscale", "nested_ckpt", "fairscale")
    lines, skipped = read_metrics(train_work_dir(run) / "metrics.jsonl")
    (run_line,) = [line for line in lines if line["kind"] == "run"]
    assert skipped == 0
    assert run_line["malloc_huge_pages"] is True
    # And OpenBLAS was told the worker's share of the cores (tests/test_threads.py): the run's
    # environment sets none of its variables (tests.helpers.tango_env).
    share = max(1, available_cores() // 2)
    assert run_line["threads"] == {"intra_op": share, "source": "share of cores", "blas": share}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
@pytest.mark.skipif(not _glibc_version(), reason="mallopt's mmap threshold is glibc's")
def test_long_lived_allocations_get_mappings_of_their_own(scripts: ConcurrentProcesses) -> None:
    result = scripts.result("long_lived")
    assert result.returncode == 0, result.stderr[-3000:]
    reported = json.loads(result.stdout.split("WHERE:")[1])
    print(reported)
    assert reported["found"] == {
        "before": "heap",
        "inside": "mapping",
        "after": "heap",
        "nested": "mapping",
        "after nested": "mapping",  # still inside the outer one
        "after both": "heap",
        "threshold set inside": "mapping",
        "inside, after it ended": "mapping",
        "after it": "heap",
        "1 MiB threshold": "mapping",
        "1 MiB block ended": "heap",  # the enclosing block's 16 MiB again
        "24 MiB under 16 MiB": "mapping",
        "older ended first": "mapping",  # the 1 MiB block still open
        "24 MiB after all ended": "heap",  # restored: glibc's dynamic threshold's ceiling, 32 MiB
    }
    assert reported["thresholds"] == {
        "at start": None,  # glibc's own threshold, which nothing set
        "set inside": 2 << 20,  # the long-lived block's, until it ends
        "1 MiB block ended": 16 << 20,
        "older ended first": 1 << 20,
        "all ended": 32 << 20,
    }
