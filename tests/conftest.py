"""Markers registered here in addition to those in pyproject.toml."""

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
