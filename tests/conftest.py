"""
The shared toy runs, a one-worker process group, and the random generators restored after every
test (the markers are registered in pyproject.toml).
"""

import random
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
