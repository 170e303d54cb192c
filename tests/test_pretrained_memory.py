"""
The pretrained-model memory benchmark (benchmarks/pretrained_memory.py): its model, its summary of
the workers' records, and (``extended``) its harness end to end on a tiny model. The numbers of the
real run are in docs/pretrained-memory.md; nothing here asserts a memory figure of a run.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

from benchmarks.pretrained_memory import SHAPES, conclusions, make_model, summarize, table
from tests.helpers import REPO

pytest.importorskip("transformers")

MIB = 2**20


def worker(rank: int, runtime: int, loading: int) -> Dict[str, Any]:
    """A worker's record as ``benchmark::load_memory`` writes it, in MiB."""
    figures = {
        "vm_data_bytes": runtime * MIB,
        "rss_bytes": (runtime + 100) * MIB,
        "rss_anon_bytes": (runtime - 50) * MIB,
    }
    peaks = {
        "peak_vm_data_bytes": loading * MIB,
        "peak_rss_bytes": (loading + 300) * MIB,
        "peak_rss_anon_bytes": (loading - 60) * MIB,
    }
    return {
        "worker": rank,
        "runtime": figures,
        "loaded": peaks,
        "run": {**peaks, "peak_vm_data_bytes": (loading + 400) * MIB},
        "local_parameter_bytes": 250 * MIB,
    }


def test_a_worker_is_below_when_its_loading_peak_is_under_runtime_plus_weights() -> None:
    weights = 500 * MIB
    meta = {
        "backend": "torch",
        "init_on_meta": True,
        "workers": [worker(0, 1000, 1400), worker(1, 1000, 1499)],
    }
    eager = {
        "backend": "torch",
        "init_on_meta": False,
        "workers": [worker(0, 1000, 1500), worker(1, 1000, 1900)],
    }
    rows = summarize(meta, weights) + summarize(eager, weights)
    assert [row["below_vm_data"] for row in rows] == [True, True, False, False]
    # RssAnon: 50 MiB lower runtime, 60 MiB lower peak; RSS: 100 higher runtime, 300 higher peak.
    assert [row["below_rss_anon"] for row in rows] == [True, True, True, False]
    assert [row["below_rss"] for row in rows] == [False, False, False, False]
    lines = table(rows).splitlines()
    assert len(lines) == 2 + 4
    # Worker 1 with init_on_meta: VmData 1,499 MiB, 499 above its runtime, 0.998 of the weights.
    assert lines[3] == (
        "| torch | yes | engine's | 1 | 1,000 | 1,499 (499) | 1.00 | yes | 950 | 1,439 (489) | 0.98 | yes "
        "| 1,100 | 1,799 (699) | 1.40 | **no** | 1,899 |"
    )
    (summary,) = conclusions(rows, weights)
    assert summary.startswith("- **torch**, the most a worker rose")
    assert (
        "VmData 499 MiB (1.00 x the weights; below runtime + weights on 2 of 2 workers) against 900"
        in summary
    )
    assert "RSS 699 MiB (1.40 x the weights; below runtime + weights on 0 of 2 workers)" in summary
    # A variant under another malloc setting is compared with the same eager run.
    tuned = {**meta, "mmap_threshold": 4 * MIB, "workers": [worker(0, 1000, 1300), worker(1, 1000, 1300)]}
    rows += summarize(tuned, weights)
    assert "| torch | yes | `MALLOC_MMAP_THRESHOLD_=4194304` | 0 | 1,000 | 1,300 (300) |" in table(rows)
    _, summary = conclusions(rows, weights)
    assert summary.startswith("- **torch with `MALLOC_MMAP_THRESHOLD_=4194304`**, the most a worker rose")
    assert (
        "VmData 300 MiB (0.60 x the weights; below runtime + weights on 2 of 2 workers) against 900"
        in summary
    )


def test_the_model_is_saved_once_and_sized_from_its_file(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = make_model(SHAPES["quick"], tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    # Tied: the LM head is the token embedding, counted once, as the file stores it.
    parameters = sum(p.numel() for p in loaded.parameters())
    assert model["parameters"] == parameters
    assert model["weights_bytes"] == 4 * parameters < model["file_bytes"]
    written = (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns
    assert make_model(SHAPES["quick"], tmp_path / "model") == model
    assert (tmp_path / "model" / "model.safetensors").stat().st_mtime_ns == written  # reused
    # Another shape in the same directory: saved again.
    other = make_model({**SHAPES["quick"], "n_layer": 1}, tmp_path / "model")
    assert other["parameters"] < model["parameters"]


@pytest.mark.extended
def test_quick_benchmark_records_every_worker_of_every_variant(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/pretrained_memory.py",
            "--quick",
            "--json",
            str(tmp_path / "memory.json"),
            "--markdown",
            str(tmp_path / "memory.md"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "memory.json").read_text())
    assert [(r["backend"], r["init_on_meta"], r["mmap_threshold"]) for r in data["records"]] == [
        ("fairscale", True, None),
        ("fairscale", False, None),
        ("torch", True, None),
        ("torch", False, None),
    ]
    for record in data["records"]:
        assert [w["worker"] for w in record["workers"]] == [0, 1]
        for figures in record["workers"]:
            runtime, loaded, run = figures["runtime"], figures["loaded"], figures["run"]
            # The engine started before the model was built, and the peaks are peaks.
            assert 0 < figures["engine_start"]["vm_data_bytes"] <= runtime["vm_data_bytes"]
            assert loaded["peak_vm_data_bytes"] >= max(runtime["vm_data_bytes"], loaded["vm_data_bytes"])
            assert loaded["peak_rss_bytes"] >= max(runtime["rss_bytes"], loaded["rss_bytes"])
            assert run["peak_vm_data_bytes"] >= loaded["peak_vm_data_bytes"]
            # Each worker holds its half of the parameters (one element more where a size is odd).
            assert abs(figures["local_parameter_bytes"] - data["model"]["weights_bytes"] / 2) < 4096
    page = (tmp_path / "memory.md").read_text()
    assert len(data["rows"]) == 8 and page.count("\n| fairscale |") == 4 and page.count("\n| torch |") == 4
    assert "python benchmarks/pretrained_memory.py --quick" in page
