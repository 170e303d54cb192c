"""
Training in the test process's own workers instead of a ``tango run``: 2 (or more) gloo workers,
each running jobs one after another and leaving what they found in files that the test reads. A
``tango run`` spends 10 to 13 s starting the CLI, the step graph and workers that import torch;
these workers are forked, in milliseconds, from a server process (:mod:`multiprocessing`'s
forkserver) that imported torch, Tango, FairScale and the package once per test session.

Two kinds of job:

- :class:`Train`: Tango's own ``torch::train`` worker loop (``tango.integrations.torch.train._train``,
  as a ``tango run`` worker runs it) on the training step of an experiment from
  :func:`tests.helpers.train_config`, in a work directory of the test's choosing: the engine is
  constructed from the config, resumes from ``checkpoint_state_latest`` as Tango does, and writes
  checkpoints, ``weights.pt`` and whatever the config's callbacks write, where a ``tango run``
  would. The loop is Tango's worker function as the package's patch T2 leaves it, with the
  callbacks the package's step adds on its engine (by the step's own
  :func:`~tango_fairscale.train_step.with_engine_callbacks`). What the ``tango run`` adds and these
  jobs leave out: the CLI, Tango's step cache and workspace, and the main process's part of the
  step (pre-flight, the port's rendezvous store, the step's result): what
  ``tests/test_equivalence.py``, ``tests/test_readme.py`` and the other end-to-end tests keep
  running.
- :class:`Call`: a function of the test's, ``function(worker, *args)``, on every worker, which
  builds :class:`~tango_fairscale.FairScaleTrainingEngine` directly
  (:meth:`Worker.engine`), trains it (:meth:`Worker.train`), saves and loads checkpoints, and
  returns what the test should see (state dicts, numbers; picklable).

A job's exception does not end its worker: it is recorded (type, message and traceback), with the
worker's log lines, and the worker goes on to its next job with a new process group. A worker that
dies (a test's SIGKILL) ends its part there; :func:`run` reports each worker's exit code.

Each job's port is chosen by worker 0 when the job starts, not when the run starts: a port chosen
minutes ahead can be taken by then by a socket of an earlier job. Each job's collectives wait at
most :data:`COLLECTIVE_TIMEOUT` unless its config says otherwise. Workers that do not end in time
are killed (also when the test itself is stopped, e.g. by pytest-timeout), after each printed its
threads' stacks; the failure shows those stacks and the tail of each worker's log.

:func:`spawn` is ``torch.multiprocessing.spawn`` on these workers, for the multi-process unit tests.
"""

import faulthandler
import gc
import itertools
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union
from unittest import mock

import torch
import torch._dynamo  # noqa: F401 - imported by the first optimizer otherwise: 2 s in every worker
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401 - the torch backend's checkpoints
import torch.distributed.fsdp  # noqa: F401 - the torch backend
import torch.multiprocessing as mp
from more_itertools import chunked
from tango.common import Lazy, Params
from tango.integrations.torch import DataLoader, Model, TrainCallback, TrainConfig, TrainingEngine
from tango.integrations.torch.util import set_seed_all
from torch.utils.data.distributed import DistributedSampler

import examples.toy.components  # noqa: F401 - registers the toy model and data step
import tests.components  # noqa: F401 - registers the test components
from tango_fairscale import FairScaleTrainingEngine
from tango_fairscale.preflight import uses_fairscale_engine
from tango_fairscale.train_step import with_engine_callbacks
from tests.helpers import REPO, dump_stacks, free_port

# The workers' server imports this module by name with the test process's sys.path, whose
# relative entries resolve against the server's working directory: make the repository's absolute.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

Experiment = Dict[str, Any]

#: Seconds a run of jobs may take before its workers are killed and the test fails.
DEFAULT_TIMEOUT = 300.0
#: What a job's collectives may wait for the other workers: a job that leaves one worker waiting
#: fails within this, not after the engine's default of 300 s.
COLLECTIVE_TIMEOUT = 60


@dataclass(frozen=True)
class Train:
    """Tango's ``torch::train`` worker loop on ``experiment``'s training step, in ``work_dir``."""

    experiment: Experiment
    work_dir: Path
    #: The training step's name in the experiment.
    step: str = "train"


@dataclass(frozen=True)
class Call:
    """``function(worker, *args)`` on every worker; what it returns is that worker's value."""

    function: Callable[..., Any]
    args: Tuple[Any, ...] = ()


Job = Union[Train, Call]


@dataclass
class WorkerResult:
    """What one worker left of one job."""

    value: Any = None
    #: ``"ExceptionType: message"`` of the exception the job raised, if any.
    error: Optional[str] = None
    traceback: Optional[str] = None
    #: The job's log messages (level INFO and up), formatted.
    logs: List[str] = field(default_factory=list)


@dataclass
class JobResult:
    """Every worker's result of one job, by rank (``None`` for a worker that died before it ended)."""

    workers: List[Optional[WorkerResult]]
    #: Each worker's exit code for the whole run (negative: killed by that signal).
    exitcodes: List[Optional[int]]

    @property
    def values(self) -> List[Any]:
        return [w.value if w is not None else None for w in self.workers]

    @property
    def errors(self) -> List[Optional[str]]:
        return [w.error if w is not None else None for w in self.workers]

    @property
    def logs(self) -> str:
        """Every worker's log lines, worker by worker."""
        return "\n".join(line for w in self.workers if w is not None for line in w.logs)

    def describe(self) -> str:
        parts = [f"exit codes {self.exitcodes}"]
        for rank, worker in enumerate(self.workers):
            if worker is None:
                parts.append(f"--- worker {rank}: no result (it died before the job ended)")
            elif worker.error is not None:
                parts.append(f"--- worker {rank}: {worker.traceback}")
        parts.append("--- logs ---\n" + self.logs[-6000:])
        return "\n".join(parts)

    def check(self, exited: bool = True) -> "JobResult":
        """
        This result, after asserting that every worker finished the job without an error (and, with
        ``exited``, that every worker then exited normally: false for a job a later one killed).
        """
        assert all(w is not None and w.error is None for w in self.workers), self.describe()
        if exited:
            assert all(code == 0 for code in self.exitcodes), self.describe()
        return self


def run(
    jobs: Sequence[Job], world_size: int = 2, *, out: Path, timeout: float = DEFAULT_TIMEOUT
) -> List[JobResult]:
    """
    Run ``jobs`` in order on ``world_size`` new worker processes; their results go through files in
    ``out`` (a directory of its own). Fails the test when the workers do not end within ``timeout``.
    """
    out.mkdir(parents=True, exist_ok=True)
    # Forked from a server process that imported this module (and so torch, Tango, FairScale and
    # the package) once: a worker starts in milliseconds instead of seconds. Not forked from the
    # test process itself, whose OpenMP threads a forked child must not inherit.
    mp.get_context("forkserver").set_forkserver_preload([__name__])
    context = mp.start_processes(
        _worker,
        args=(world_size, list(jobs), str(out), dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    try:
        exitcodes = _wait(context.processes, timeout, out)
    except BaseException as stopped:
        if not isinstance(stopped, AssertionError):
            # Stopped from outside (pytest-timeout, ^C): what the workers were doing goes to the
            # test's captured output, which pytest shows with the failure.
            print(_report(context.processes, out), file=sys.stderr)
        raise
    finally:
        # A worker left running would be joined by multiprocessing when the test process exits:
        # the whole test session would wait for it.
        _kill(context.processes)
    results = []
    for index in range(len(jobs)):
        workers: List[Optional[WorkerResult]] = []
        for rank in range(world_size):
            path = out / f"job{index}_rank{rank}.pt"
            workers.append(torch.load(path, weights_only=False) if path.exists() else None)
        results.append(JobResult(workers, exitcodes))
    return results


def killed_and_rerun(plain: Dict[str, Train], killed: Dict[str, Train], out: Path) -> Dict[str, JobResult]:
    """
    Each backend's uninterrupted job (``plain``) and its job killed by SIGKILL after a checkpoint
    (``killed``, whose config kills its workers), then the rerun of each killed job: a killed job
    ends its workers, so each later start of the workers reruns it first. Checks that every job
    ended as it should, the killed ones by SIGKILL on both workers; returns each backend's rerun.
    """
    first = run([plain["fairscale"], plain["torch"], killed["fairscale"]], out=out / "first")
    second = run([killed["fairscale"], killed["torch"]], out=out / "second")
    (third,) = run([killed["torch"]], out=out / "third")
    for result in (*first[:2], second[0]):
        result.check(exited=False)
    third.check()
    for result in (first[2], second[1]):
        assert result.exitcodes == [-signal.SIGKILL] * 2, result.describe()
    return {"fairscale": second[0], "torch": third}


def train(experiment: Experiment, work_dir: Path, world_size: int = 2, **kwargs: Any) -> JobResult:
    """One :class:`Train` job on new workers; asserts that every worker finished it."""
    (result,) = run(
        [Train(experiment, work_dir)], world_size, out=work_dir.parent / f"{work_dir.name}.harness", **kwargs
    )
    return result.check()


def spawn(
    function: Callable[..., Any],
    args: Tuple[Any, ...] = (),
    nprocs: int = 2,
    timeout: float = DEFAULT_TIMEOUT,
) -> None:
    """
    What ``torch.multiprocessing.spawn(function, args, nprocs)`` does, ``function(rank, *args)`` in
    each of ``nprocs`` processes, in this module's workers (started in milliseconds, not seconds):
    raises when a worker raised or died.
    """
    with tempfile.TemporaryDirectory(prefix="harness-") as out:
        (result,) = run([Call(_call_spawned, (function, args))], nprocs, out=Path(out), timeout=timeout)
    assert all(w is not None and w.error is None for w in result.workers), result.describe()
    assert all(code == 0 for code in result.exitcodes), result.describe()


def _wait(processes: Sequence[Any], timeout: float, out: Path) -> List[Optional[int]]:
    deadline = _now() + timeout
    for process in processes:
        process.join(max(0.0, deadline - _now()))
    alive = [process for process in processes if process.is_alive()]
    if alive:
        raise AssertionError(
            f"{len(alive)} worker(s) still running after {timeout} s: killed\n" + _report(processes, out)
        )
    return [process.exitcode for process in processes]


def _report(processes: Sequence[Any], out: Path) -> str:
    """Each live worker's threads' stacks (printed on SIGUSR1 into its file) and each worker's log tail."""
    alive = [rank for rank, process in enumerate(processes) if process.is_alive()]
    if alive:
        dump_stacks(*(processes[rank].pid for rank in alive))
    parts = []
    for rank, process in enumerate(processes):
        state = "running" if rank in alive else f"exit code {process.exitcode}"
        parts.append(f"=== worker {rank} ({state}): last log lines ===")
        parts.extend(_tail(out / f"rank{rank}.log", 40))
        if rank in alive:
            parts.append(f"=== worker {rank}: stacks ===")
            parts.extend(_tail(out / f"rank{rank}.stacks", 200))
    return "\n".join(parts)


def _tail(path: Path, lines: int) -> List[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return [f"({path.name}: none)"]


def _kill(processes: Sequence[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def _now() -> float:
    return time.monotonic()


# --- in the workers ----------------------------------------------------------------------------------


#: This worker's rank, for its log lines.
_rank = -1


#: This worker's log file in the run's directory: every job's lines as they come, for a run that
#: does not end in time (a killed worker leaves no result).
_log: Any = None


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: List[str] = []
        self.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        record.rank = _rank
        line = self.format(record)
        self.lines.append(line)
        _log_line(line)


def _log_line(line: str) -> None:
    if _log is not None:
        _log.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        _log.flush()


class Worker:
    """One worker's view of a run, for :class:`Call` functions."""

    def __init__(self, rank: int, world_size: int, port: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._ports = iter([port])

    def train_config(self, experiment: Experiment, work_dir: Path, step: str = "train") -> TrainConfig:
        """The ``TrainConfig`` Tango's step builds for ``experiment``'s training step on this worker."""
        return _train_config(experiment["steps"][step], work_dir, self.rank, self.world_size, self._port())

    def engine(self, experiment: Experiment, work_dir: Path, step: str = "train") -> FairScaleTrainingEngine:
        """
        The experiment's engine, constructed on this worker as Tango's worker loop does (seeded, from
        the config, with a new process group; the previous one is closed).
        """
        config = self.train_config(experiment, work_dir, step)
        _close_process_group()
        set_seed_all(config.seed)
        train = experiment["steps"][step]
        engine = Lazy(TrainingEngine, Params(_engine_params(train))).construct(
            train_config=config, model=Lazy(Model, Params(dict(train["model"])))
        )
        assert isinstance(engine, FairScaleTrainingEngine), type(engine)
        return engine

    def init_process_group(self) -> None:
        """A gloo process group of this run's workers, for a function that builds no engine."""
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{self._port()}", rank=self.rank, world_size=self.world_size
        )

    def batches(self, experiment: Experiment, step: str = "train") -> Iterator[List[Dict[str, torch.Tensor]]]:
        """
        This worker's batches of the experiment's training data, as Tango's loop draws them: epoch
        after epoch without end, a ``DistributedSampler`` told each epoch (so that it shuffles
        anew), ``grad_accum`` micro-batches to a batch (the last of an epoch may have fewer). What
        Tango's private ``_cycle_through_epochs`` does, which Tango has no public form of.
        """
        train = experiment["steps"][step]
        loader = Lazy(DataLoader, Params(dict(train["train_dataloader"]))).construct(
            dataset=_dataset(experiment, train)["train"]
        )
        grad_accum = train.get("grad_accum", 1)
        for epoch in itertools.count():
            if isinstance(loader.sampler, DistributedSampler):
                loader.sampler.set_epoch(epoch)
            yield from chunked(loader, grad_accum)

    @staticmethod
    def train(
        engine: FairScaleTrainingEngine, batches: Iterator[List[Dict[str, torch.Tensor]]], steps: int
    ) -> List[float]:
        """``steps`` optimizer steps as Tango's loop makes them; each step's loss on this worker."""
        losses = []
        for _ in range(steps):
            batch = next(batches)
            loss = 0.0
            for index, micro_batch in enumerate(batch):
                micro_loss, _ = engine.forward_train(micro_batch, index, len(batch))
                loss += micro_loss.item()
                engine.backward(micro_loss)
            engine.step()
            losses.append(loss)
        return losses

    def _port(self) -> int:
        port = next(self._ports, None)
        if port is None:
            # Another engine in the same job: every worker needs the same port, so agree on one.
            chosen = [free_port() if self.rank == 0 else 0]
            dist.broadcast_object_list(chosen, src=0)
            port = int(chosen[0])
        return port


def _dataset(experiment: Experiment, train: Dict[str, Any]) -> Any:
    """The data step the training step refers to, run here (it is small and deterministic)."""
    from tango import Step

    reference = train["dataset_dict"]
    assert reference.get("type") == "ref", "the harness runs experiments whose dataset_dict is a ref"
    data = dict(experiment["steps"][reference["ref"]])
    step_class = Step.by_name(data.pop("type"))
    return step_class().run(**data)  # type: ignore[call-arg]


def _train_config(
    train: Dict[str, Any], work_dir: Path, rank: int, world_size: int, port: int
) -> TrainConfig:
    device_count = train.get("device_count", 1)
    assert device_count == world_size, (
        f"the step's device_count is {device_count}, the harness runs {world_size}"
    )
    return TrainConfig(
        "harness",
        Path(work_dir),
        step_name="train",
        worker_id=rank,
        train_split=train.get("train_split", "train"),
        validation_split=train.get("validation_split"),
        seed=train.get("seed", 42),
        train_steps=train.get("train_steps"),
        train_epochs=train.get("train_epochs"),
        grad_accum=train.get("grad_accum", 1),
        log_every=train.get("log_every", 10),
        checkpoint_every=train.get("checkpoint_every", 100),
        validate_every=train.get("validate_every"),
        validation_steps=train.get("validation_steps"),
        is_distributed=True,
        devices=[-1] * world_size,
        distributed_port=port,
        remove_stale_checkpoints=train.get("remove_stale_checkpoints", True),
        world_size=world_size,
    )


def _engine_params(train: Dict[str, Any]) -> Dict[str, Any]:
    """The step's engine, whose collectives wait :data:`COLLECTIVE_TIMEOUT` unless it says otherwise."""
    params = dict(train["training_engine"])
    if uses_fairscale_engine(params):
        params.setdefault("collective_timeout", COLLECTIVE_TIMEOUT)
    return params


def _lazy(kind: Any, params: Optional[Dict[str, Any]]) -> Any:
    return None if params is None else Lazy(kind, Params(dict(params)))


def _run_train(job: Train, rank: int, world_size: int, port: int) -> None:
    """Tango's worker loop, as a ``tango run`` worker runs it, with the arguments its step would pass."""
    from tango.integrations.torch import train as tango_train

    train = job.experiment["steps"][job.step]
    config = _train_config(train, job.work_dir, 0, world_size, port)
    engine = _lazy(TrainingEngine, _engine_params(train))
    callbacks = [_lazy(TrainCallback, c) for c in train.get("callbacks") or []]
    if uses_fairscale_engine(engine):
        # What the package's step (train_step.run_step, T1) adds on its engine, by the same function:
        # the metrics log (unless the config has one) and the restoring of the random generators.
        callbacks = with_engine_callbacks(callbacks)
    Path(job.work_dir).mkdir(parents=True, exist_ok=True)
    # Tango's worker function as T2 left it: the package's run_worker around Tango's own.
    tango_train._train(
        rank,
        None,  # the workspace: only passed on to callbacks, which these do not use
        config,
        _lazy(Model, train["model"]),
        engine,
        _dataset(job.experiment, train),
        _lazy(DataLoader, train["train_dataloader"]),
        _lazy(DataLoader, train.get("validation_dataloader")),
        callbacks,
        None,  # include_package: this process imported the components already
    )


@contextmanager
def _in_place_of_a_tango_run_worker() -> Iterator[None]:
    """
    While Tango's worker loop runs a :class:`Train` job here, the two things a ``tango run`` worker
    does that these workers cannot, replaced; both are restored when the job ends (the only
    rebindings the harness makes, and only in its workers, never in the test process):

    - ``tango.common.logging.initialize_worker_logging``, which Tango's loop calls first: it
      replaces the root logger's handlers with one that sends every record to the log server of
      the ``tango run`` main process (and raises where there is none). Here the job's records must
      stay in this process, where :class:`_Capture` collects them for the test. Tango has no setting
      that keeps them: the server's port is read when ``tango.common.logging`` is imported, and
      the records would reach the test process out of order with the jobs.
    - ``tango_fairscale.launch.teardown.end_finished_worker``, which the package's worker function (T2)
      calls when the loop has finished: it ends the process (``os._exit``), and these workers go
      on to their next job. What it does first runs as in a ``tango run``:
      ``close_process_groups`` (the group destroyed, the cycles collected).
    """
    from tango.common import logging as tango_logging

    from tango_fairscale.launch import teardown

    with ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(tango_logging, "initialize_worker_logging", lambda worker_rank=None: None)
        )
        stack.enter_context(mock.patch.object(teardown, "end_finished_worker", teardown.close_process_groups))
        yield


def _close_process_group() -> None:
    """Close this worker's process group, if any, so that the next engine can start its own."""
    from fairscale.internal import parallel

    if dist.is_initialized():
        dist.destroy_process_group()
        # The previous engine's cycles (hooks, FSDP states) hold its groups and its memory: gone
        # before the next engine is built.
        gc.collect()
    # FairScale keeps the groups its FSDP units use in a cache for the life of the process: the
    # next engine's units must make new ones.
    parallel.get_process_group_cached.__dict__.pop("_global_group_cache", None)


def _call_spawned(worker: Worker, function: Callable[..., Any], args: Tuple[Any, ...]) -> Any:
    return function(worker.rank, *args)


def _worker(rank: int, world_size: int, jobs: List[Job], out: str, environment: Dict[str, str]) -> None:
    # The server was forked with the environment of the test that started it: a worker takes the
    # environment of the test it runs for (e.g. a logger's offline mode set by a fixture).
    os.environ.clear()
    os.environ.update(environment)

    global _rank, _log
    _rank = rank
    # Both open for the life of the worker. SIGUSR1 (sent by run() to a worker that did not end in
    # time) prints every thread's stack into the second.
    _log = open(Path(out) / f"rank{rank}.log", "a")
    stacks = open(Path(out) / f"rank{rank}.stacks", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for index, job in enumerate(jobs):
        _log_line(f"--- job {index}: {type(job).__name__} ---")
        capture = _Capture()
        root.addHandler(capture)
        result = WorkerResult()
        try:
            port = _job_port(Path(out), index, rank)
            if isinstance(job, Train):
                with _in_place_of_a_tango_run_worker():
                    _run_train(job, rank, world_size, port)
            else:
                result.value = job.function(Worker(rank, world_size, port), *job.args)
        except BaseException as error:  # noqa: BLE001 - recorded for the test, which decides
            result.error = f"{type(error).__name__}: {error}"
            result.traceback = traceback.format_exc()
            _log_line(result.traceback)
        finally:
            root.removeHandler(capture)
        result.logs = capture.lines
        torch.save(result, Path(out) / f"job{index}_rank{rank}.pt")
        _close_process_group()


def _job_port(out: Path, index: int, rank: int) -> int:
    """
    Job ``index``'s port: chosen by worker 0 as the job starts and handed to the others in a file
    (they have no process group yet to receive it by).
    """
    path = out / f"job{index}.port"
    if rank == 0:
        partial = path.with_suffix(".partial")
        partial.write_text(str(free_port()))
        partial.replace(path)
    deadline = _now() + COLLECTIVE_TIMEOUT
    while not path.exists():
        if _now() > deadline:
            raise TimeoutError(f"worker 0 did not start job {index} within {COLLECTIVE_TIMEOUT} s")
        time.sleep(0.01)
    return int(path.read_text())
