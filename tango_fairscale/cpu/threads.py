"""
How many threads a CPU worker's torch computes with (its intra-op threads).

torch starts with one intra-op thread per core it may run on, in every process. A ``tango run``
on CPU workers starts several workers per host, so without a limit each one runs as many threads
as the host has cores, and the workers' threads compete for the same cores: measured on the
GPT-2 example (2 workers, 2 cores), 1.09 steps/s with torch's default against 5.84 with one
thread each. So a CPU worker computes with its share of the cores unless told otherwise:

1. the engine's ``cpu_threads_per_worker``, when set;
2. else ``OMP_NUM_THREADS``, when set (torch reads it at start-up; set again here so that a
   worker forked from a process that started torch earlier follows it too);
3. else the cores this process may run on (``os.sched_getaffinity``, which a scheduler's CPU
   binding or ``taskset`` narrows; the core count where that is unavailable) divided by the
   workers on this host, rounded down, at least 1.

GPU workers are left alone: their compute is on the GPU, and the thread count is torch's.

numpy's BLAS follows the same share. torch and Tango import numpy in every worker, and numpy's
OpenBLAS starts its thread pool when it is loaded: one thread per core, each with its own buffer
and stack, untouched until numpy multiplies matrices, but reserved. Measured after ``import
numpy`` on the 2-core machine: VmData 90.6 MiB with OpenBLAS's default of 2 threads, 49.7 MiB
with 1, i.e. about 41 MiB and one idle thread per core in each worker, which ``RLIMIT_DATA`` (and
the kernel's commit accounting under strict overcommit) counts: by that measure, not measured
there, about 2.6 GiB per worker on a host of 64 cores. So Tango's main process gives the CPU workers it spawns
``OPENBLAS_NUM_THREADS`` of their thread count (:func:`blas_environment`), read only when the
library is loaded, unless the user set one of the variables OpenBLAS reads
(:data:`BLAS_VARIABLES`; ``torchrun`` sets ``OMP_NUM_THREADS=1``). torch's own threads are the
ones above (``torch.set_num_threads``); numpy's BLAS in a worker is the data pipeline's.

Inter-op threads are left alone too: torch creates that pool only for ``torch.jit.fork`` and
other asynchronous ops, which eager training does not run (measured: a forward and backward
pass leaves the process without the pool), and its size can be set only once per process,
before the pool exists.
"""

import os
import re
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import torch

#: The variable OpenMP (and torch, at start-up) reads for the number of threads.
OMP_VARIABLE = "OMP_NUM_THREADS"

#: Where a worker's thread count came from (the run line's ``threads.source``).
SOURCE_OPTION = "cpu_threads_per_worker"
SOURCE_ENVIRONMENT = OMP_VARIABLE
SOURCE_SHARE = "share of cores"
SOURCE_TORCH = "torch default"

#: The variables OpenBLAS reads for its number of threads when it is loaded, in its order: the
#: first whose value is a number above 0 wins (:func:`blas_threads`).
BLAS_VARIABLES: Tuple[str, ...] = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", OMP_VARIABLE)


class ThreadChoice(NamedTuple):
    """The intra-op threads of one worker, and where the number came from."""

    #: Threads for torch's intra-op parallelism (``torch.set_num_threads``).
    threads: int
    #: One of :data:`SOURCE_OPTION`, :data:`SOURCE_ENVIRONMENT`, :data:`SOURCE_SHARE`.
    source: str


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one, else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _positive_int(text: Optional[str]) -> Optional[int]:
    """``text`` as a whole number of 1 or more, else ``None`` (unset, empty, or OpenMP's list form)."""
    try:
        value = int((text or "").strip())
    except ValueError:
        return None
    return value if value >= 1 else None


def choose_threads(
    option: Optional[int], env: Mapping[str, str], workers_on_host: int, cores: Optional[int] = None
) -> ThreadChoice:
    """A CPU worker's intra-op threads, by the rules of the module's docstring."""
    if option is not None:
        return ThreadChoice(int(option), SOURCE_OPTION)
    if env.get(OMP_VARIABLE, "").strip():
        # A value torch takes as is; another form (OpenMP's "4,2") is torch's to interpret.
        return ThreadChoice(_positive_int(env[OMP_VARIABLE]) or torch.get_num_threads(), SOURCE_ENVIRONMENT)
    cores = available_cores() if cores is None else cores
    return ThreadChoice(max(1, cores // max(1, workers_on_host)), SOURCE_SHARE)


#: What :func:`apply_threads` set in this process, for the metrics log's run line.
_applied: Optional[ThreadChoice] = None


def apply_threads(choice: ThreadChoice) -> None:
    """Set this process's intra-op threads to ``choice`` (before the model is built)."""
    global _applied
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    _applied = choice


def blas_environment(env: Mapping[str, str], threads: int) -> Dict[str, str]:
    """
    What a spawned CPU worker's environment gets so that numpy's OpenBLAS starts ``threads``
    threads: ``OPENBLAS_NUM_THREADS``, unless ``env`` sets a variable OpenBLAS reads already.
    """
    if any(env.get(name, "").strip() for name in BLAS_VARIABLES):
        return {}
    return {BLAS_VARIABLES[0]: str(threads)}


def blas_threads(env: Mapping[str, str] = os.environ) -> Optional[int]:
    """
    The threads OpenBLAS was told to start with in ``env``, read as OpenBLAS reads it: each of
    :data:`BLAS_VARIABLES` with C's ``atoi`` (its leading digits: ``"4,2"`` is 4), the first above
    0 winning; ``None`` where none is (OpenBLAS's default: one per core).
    """
    for name in BLAS_VARIABLES:
        digits = re.match(r"\s*\+?(\d+)", env.get(name, ""))
        if digits is not None and int(digits.group(1)) > 0:
            return int(digits.group(1))
    return None


def describe_threads() -> Dict[str, Any]:
    """
    This process's intra-op threads and where the number came from, and the threads OpenBLAS was
    told to start with (the run line's ``threads``).
    """
    source = _applied.source if _applied is not None else SOURCE_TORCH
    return {"intra_op": torch.get_num_threads(), "source": source, "blas": blas_threads()}
