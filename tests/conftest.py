"""
The shared toy runs, the tiny pretrained Llama, a one-worker process group, the random
generators restored after every test, and no worker process outliving the session (the markers
are registered in pyproject.toml).
"""

import json
import multiprocessing
import random
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_random_generators() -> Iterator[None]:
    """
    Python's, NumPy's and torch's (CPU) global random generators as they were before the test:
    many tests seed them (``torch.manual_seed``) in this process, and a test that draws from them
    unseeded must not depend on which tests ran before it. Workers are other processes.
    """
    python_state, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)


#: ``(engine, wrap, backend, grad_accum, accumulate_locally)``, the last three optional.
ToyKey = Tuple[Any, ...]


def toy_experiment(
    engine: str,
    wrap: str,
    backend: Optional[str] = None,
    grad_accum: int = 1,
    accumulate_locally: bool = False,
) -> Dict[str, Any]:
    """:func:`tests.helpers.train_config` with those settings: what the shared toy runs train."""
    from tests.helpers import train_config

    extra: Dict[str, Any] = {}
    if backend is not None:
        extra["backend"] = backend
    if accumulate_locally:
        extra["accumulate_grads_locally"] = True
    config = train_config(engine=engine, wrap=wrap, engine_extra=extra)
    if grad_accum != 1:
        config["steps"]["train"]["grad_accum"] = grad_accum
    return config


def _key(
    engine: str,
    wrap: str,
    backend: Optional[str] = None,
    grad_accum: int = 1,
    accumulate_locally: bool = False,
) -> ToyKey:
    """The settings in full, so that one experiment is one key however it was asked for."""
    return (engine, wrap, backend, grad_accum, accumulate_locally)


def _name(key: ToyKey) -> str:
    return "_".join(str(part) for part in key)


ToyRun = Callable[..., Path]


@pytest.fixture(scope="session")
def toy_run(tmp_path_factory: pytest.TempPathFactory) -> ToyRun:
    """
    ``toy_run(engine, wrap, backend=None, grad_accum=1, accumulate_locally=False)``: the workspace
    of a finished ``tango run`` of :func:`toy_experiment` with those settings, run once per
    session and shared by the tests that compare runs through the CLI; its output is in
    ``output.txt`` beside it.
    """
    from tests.helpers import run_tango

    runs: Dict[ToyKey, Path] = {}

    def run(*args: Any, **kwargs: Any) -> Path:
        key = _key(*args, **kwargs)
        if key not in runs:
            root = tmp_path_factory.mktemp(f"run_{_name(key)}")
            result = run_tango(toy_experiment(*key), root / "ws", cwd=root / "cwd")
            # What the user saw, beside the workspace (tests/test_quiet_output.py reads it).
            (root / "output.txt").write_text(result.stdout + result.stderr)
            runs[key] = root / "ws"
        return runs[key]

    return run


class ToyTrain:
    """
    ``toy_train(engine, wrap, backend=None, grad_accum=1, accumulate_locally=False)``: the work
    directory of :func:`toy_experiment` with those settings trained in the test's own workers
    (:mod:`tests.harness`), once per session. :meth:`prepare` trains several in one start of the
    workers.
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._factory = tmp_path_factory
        self._work_dirs: Dict[ToyKey, Path] = {}

    def prepare(self, keys: Iterable[ToyKey]) -> None:
        from tests import harness

        missing = list(dict.fromkeys(_key(*key) for key in keys))
        missing = [key for key in missing if key not in self._work_dirs]
        if not missing:
            return
        root = self._factory.mktemp("toy_train")
        jobs = [harness.Train(toy_experiment(*key), root / _name(key)) for key in missing]
        for key, job, result in zip(missing, jobs, harness.run(jobs, out=root / "harness")):
            result.check()
            self._work_dirs[key] = job.work_dir

    def __call__(self, *args: Any, **kwargs: Any) -> Path:
        key = _key(*args, **kwargs)
        self.prepare([key])
        return self._work_dirs[key]


@pytest.fixture(scope="session")
def toy_train(tmp_path_factory: pytest.TempPathFactory) -> ToyTrain:
    return ToyTrain(tmp_path_factory)


class TinyPretrained:
    """
    ``tiny_pretrained(config=TINY_LLAMA, seed=3)``: the directory of a Llama of ``config`` (transformers'
    ``LlamaConfig`` fields) initialised from ``seed`` and saved as transformers saves it
    (:func:`tests.helpers.save_tiny_llama`), saved once per session for each ``config`` and ``seed``
    and shared by the tests that ask for the same: read it, never change it (a test that edits or
    removes its files takes a copy of its own, :func:`tiny_pretrained_copy`). Saving one leaves the
    caller's CPU random generator as it was.
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._factory = tmp_path_factory
        self._saved: Dict[Tuple[str, int], Path] = {}

    def __call__(self, config: Optional[Dict[str, Any]] = None, seed: int = 3) -> Path:
        from tests.helpers import TINY_LLAMA, save_tiny_llama

        config = TINY_LLAMA if config is None else config
        key = (json.dumps(config, sort_keys=True), seed)
        if key not in self._saved:
            # The model's seed is its own: the test's generators go on as if nothing had drawn
            # (a shared model is saved by whichever test asks first).
            with torch.random.fork_rng(devices=[]):
                directory = self._factory.mktemp("tiny_pretrained") / "llama"
                self._saved[key] = save_tiny_llama(directory, config, seed)
        return self._saved[key]


@pytest.fixture(scope="session")
def tiny_pretrained(tmp_path_factory: pytest.TempPathFactory) -> TinyPretrained:
    return TinyPretrained(tmp_path_factory)


#: ``tiny_pretrained_copy(config=TINY_LLAMA, seed=3, name="llama-copy")``: see :func:`tiny_pretrained_copy`.
TinyPretrainedCopy = Callable[..., Path]


@pytest.fixture
def tiny_pretrained_copy(tiny_pretrained: TinyPretrained, tmp_path: Path) -> TinyPretrainedCopy:
    """
    ``tiny_pretrained_copy(config=TINY_LLAMA, seed=3, name="llama-copy")``: a copy of
    ``tiny_pretrained(config, seed)`` in the test's ``tmp_path / name``, the test's own to edit.
    """

    def copy(config: Optional[Dict[str, Any]] = None, seed: int = 3, name: str = "llama-copy") -> Path:
        return Path(shutil.copytree(tiny_pretrained(config, seed), tmp_path / name))

    return copy


@pytest.fixture
def one_worker() -> Iterator[Any]:
    """A one-worker gloo process group in this process, for fully_shard on a (1,) CPU mesh."""
    import torch.distributed as dist

    from tango_fairscale.backends.torch_fsdp2.sharding import make_mesh
    from tango_fairscale.launch.teardown import close_process_groups

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield make_mesh(1)
    finally:
        close_process_groups()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """
    Kill, and count, the worker processes a test left running: multiprocessing joins every child
    when the test process exits, so one hung worker would hold the session until CI's deadline.
    """
    left = multiprocessing.active_children()
    for process in left:
        process.kill()
        process.join()
    if left:
        print(f"\nconftest: killed {len(left)} worker process(es) a test left running", file=sys.stderr)
