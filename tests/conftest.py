"""Markers registered here in addition to those in pyproject.toml."""

from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "netns: two hosts as network namespaces joined by a veth pair (needs root and `ip netns`)",
    )
    config.addinivalue_line(
        "markers",
        "capacity: runs examples/capacity under a per-worker memory limit (DDP fails, FSDP trains)",
    )


ToyRun = Callable[..., Path]


@pytest.fixture(scope="session")
def toy_run(tmp_path_factory: pytest.TempPathFactory) -> ToyRun:
    """
    ``toy_run(engine, wrap, backend=None, grad_accum=1, accumulate_locally=False)``: the workspace
    of a finished ``tango run`` of :func:`tests.helpers.train_config` with those settings, run once
    per session and shared by the tests that compare runs (DDP, each FSDP backend, each wrapping).
    """
    from tests.helpers import run_tango, train_config

    runs: Dict[Tuple[Any, ...], Path] = {}

    def run(
        engine: str,
        wrap: str,
        backend: Optional[str] = None,
        grad_accum: int = 1,
        accumulate_locally: bool = False,
    ) -> Path:
        key = (engine, wrap, backend, grad_accum, accumulate_locally)
        if key not in runs:
            root = tmp_path_factory.mktemp(f"{engine}_{wrap}_{backend or 'default'}_{grad_accum}")
            extra: Dict[str, Any] = {}
            if backend is not None:
                extra["backend"] = backend
            if accumulate_locally:
                extra["accumulate_grads_locally"] = True
            config = train_config(engine=engine, wrap=wrap, engine_extra=extra)
            if grad_accum != 1:
                config["steps"]["train"]["grad_accum"] = grad_accum
            run_tango(config, root / "ws", cwd=root / "cwd")
            runs[key] = root / "ws"
        return runs[key]

    return run
