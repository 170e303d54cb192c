"""The benchmark harness in its --quick mode: every configuration runs and produces numbers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run import CONFIGS
from tests.helpers import REPO

pytestmark = pytest.mark.slow


def test_quick_benchmark_runs_every_configuration(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/run.py",
            "--quick",
            "--world-sizes",
            "2",
            "--json",
            str(tmp_path / "results.json"),
            "--markdown",
            str(tmp_path / "benchmarks.md"),
            "--chart",
            str(tmp_path / "benchmarks.png"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    records = {(r["config"], r["world_size"]): r for r in data["records"]}
    assert set(records) == {("ddp", 1)} | {(name, 2) for name in CONFIGS}
    for record in records.values():
        assert record["state_bytes_per_worker"] > 0
        assert record["peak_rss_bytes_per_worker"] > 0
        assert record["step_time_s"] > 0
        assert len(record["workers"]) == record["world_size"]
    # Sharding shows up in the exact tensor accounting (no timing assertions).
    assert (
        records[("fsdp", 2)]["state_bytes_per_worker"] < 0.6 * records[("ddp", 2)]["state_bytes_per_worker"]
    )
    assert (
        records[("fsdp2", 2)]["state_bytes_per_worker"] < 0.6 * records[("ddp", 2)]["state_bytes_per_worker"]
    )
    table = (tmp_path / "benchmarks.md").read_text()
    for name in CONFIGS:
        assert f"| `{name}` | 2 |" in table
    assert (tmp_path / "benchmarks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
