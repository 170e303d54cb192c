"""
Watching a run, end to end on 2 CPU workers: the throughput figures of the metrics log (FLOPs per
step against FlopCounterMode's own count, MFU, tokens/s), ``fairscale::wandb`` in W&B's offline
mode, ``fairscale::tensorboard`` and ``fairscale::profile``, through a kill and a rerun. The same
W&B callback across two hosts is in ``test_multihost.py``.
"""

import glob
import json
import signal
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from tango_fairscale.telemetry.metrics import METRICS_FILE_NAME
from tests import harness
from tests.helpers import kill_after_checkpoint, run_tango, train_config

pytest.importorskip("wandb", reason="the loggers extra: pip install 'tango-fairscale[loggers]'")
pytest.importorskip("tensorboard", reason="the loggers extra: pip install 'tango-fairscale[loggers]'")

GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16}
BATCH = 8  # per worker
TRAIN_STEPS = 12


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's offline mode, its settings and caches in the test's directory (it never goes online)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


def wandb_history(path: Path) -> Tuple[str, List[Tuple[int, Dict[str, Any]]]]:
    """
    The run id and the history rows (step, values) of an offline run's ``.wandb`` file, read
    with wandb's own reader, as ``wandb sync`` reads the file.
    """
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    store = datastore.DataStore()
    store.open_for_scan(str(path))
    run_id, rows = "", []
    try:
        while True:
            data = store.scan_data()
            if data is None:
                break
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                values = {
                    "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                    for item in record.history.item
                }
                rows.append((int(record.history.step.num), values))
    except AssertionError:
        pass  # a killed run's file may end in a torn record: what came before it stands
    finally:
        if store._fp is not None:
            store._fp.close()
    return run_id, rows


def counted_flops() -> int:
    """FlopCounterMode's count of a forward and backward pass of one worker's batch, in this process."""
    from torch.utils.flop_counter import FlopCounterMode

    from tests.components import HFGPT2

    model = HFGPT2(**GPT2)
    tokens = torch.randint(GPT2["vocab_size"], (BATCH, GPT2["n_positions"]))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=tokens, labels=tokens)["loss"].backward()
    return counter.get_total_flops()


def logged_config(*extra_callbacks: Dict[str, Any]) -> Dict[str, Any]:
    """GPT-2 on 2 workers, nested units, every logger on, checkpoints after steps 6 and 12."""
    config = train_config(
        engine="fairscale",
        train_steps=TRAIN_STEPS,
        checkpoint_every=6,
        model={"type": "test::hf_gpt2", **GPT2},
        callbacks=[
            *extra_callbacks,
            {"type": "fairscale::memory"},
            {"type": "fairscale::wandb", "project": "tango-fairscale-tests", "every": 1},
            {"type": "fairscale::tensorboard", "every": 1},
            {"type": "fairscale::profile", "steps": [2, 3]},
        ],
    )
    train = config["steps"]["train"]
    train["model"] = {
        "type": "fairscale::with_wrapped_modules",
        "model": train["model"],
        "modules_to_wrap": ["gpt2\\.transformer\\.h\\.[0-9]+"],
        "fsdp_config": {},
    }
    train["train_dataloader"]["batch_size"] = BATCH
    config["steps"]["data"] = {
        "type": "test::lm_data",
        "vocab_size": GPT2["vocab_size"],
        "length": GPT2["n_positions"],
    }
    return config


def test_two_workers_through_a_kill_and_a_rerun(tmp_path: Path, wandb_offline: None) -> None:
    # Every worker SIGKILLed right after the checkpoint of step 6 (before step index 6), in the
    # in-process workers; the rerun resumes from it.
    config = logged_config({"type": "test::kill_once", "step": 6})
    work_dir = tmp_path / "work"
    (first,) = harness.run([harness.Train(config, work_dir)], out=tmp_path / "first")
    assert first.exitcodes == [-signal.SIGKILL] * 2, first.describe()
    result = harness.train(config, work_dir)
    assert "Recovering from previous run at " + str(work_dir / "checkpoint_state_step6") in result.logs
    check_logs(work_dir)


@pytest.mark.extended
def test_two_workers_through_a_kill_and_a_rerun_of_tango_run(tmp_path: Path, wandb_offline: None) -> None:
    # The same through the CLI: the main process and every worker killed together.
    config = logged_config()
    workspace, cwd = tmp_path / "ws", tmp_path / "cwd"
    work_dir = kill_after_checkpoint(config, workspace, cwd)
    result = run_tango(config, workspace, cwd=cwd)
    assert "Recovering from previous run" in result.stdout + result.stderr
    check_logs(work_dir)


def check_logs(work_dir: Path) -> None:
    """What a run of :func:`logged_config` killed after step 6 and rerun leaves in ``work_dir``."""
    # --- the metrics log: a run line per run, each step once, its throughput figures ---------------
    lines = [json.loads(line) for line in (work_dir / METRICS_FILE_NAME).read_text().splitlines()]
    runs = [line for line in lines if line["kind"] == "run"]
    training = [line for line in lines if line["kind"] == "train"]
    assert [line["step"] for line in training] == list(range(1, TRAIN_STEPS + 1))
    assert [run["step"] for run in runs] == [0, 6]
    flops = counted_flops()
    for run, counted_step in zip(runs, (1, 7)):
        assert run["world_size"] == 2 and run["tokens"] == "input_ids: every entry"
        assert run["model_flops_counted"] == {"step": counted_step, "flops": 2 * flops}
        assert run["peak"].startswith("measured: 1024x1024 float32 matmul")
        assert len(run["peak_flops_per_second_per_worker"]) == 2
        assert run["peak_flops_per_second"] == pytest.approx(sum(run["peak_flops_per_second_per_worker"]))
        assert run["collectives"].startswith("wall time in FSDP's all-gathers and reduce-scatters")
    tokens_per_step = 2 * BATCH * GPT2["n_positions"]
    for line in training:
        # The FLOPs of a step: both workers', each FlopCounterMode's count for its batch.
        assert line["model_flops_per_step"] == 2 * flops
        assert 0 < line["mfu"] <= 1
        assert line["tokens_per_step"] == tokens_per_step
        assert line["tokens_per_second"] * line["step_time_s"] == pytest.approx(tokens_per_step, rel=1e-12)
        assert line["model_flops_per_second"] * line["step_time_s"] == pytest.approx(2 * flops, rel=1e-12)
        run = runs[0] if line["step"] <= 6 else runs[1]
        assert line["mfu"] == pytest.approx(line["model_flops_per_second"] / run["peak_flops_per_second"])
        assert line["collective_time_s"] > 0
    loss = {line["step"]: line["loss"] for line in training}
    worst = max(
        abs(line["tokens_per_second"] * line["step_time_s"] / tokens_per_step - 1) for line in training
    )
    mfus = [line["mfu"] for line in training]
    logged = sorted({line["model_flops_per_step"] for line in training})
    print(
        f"metrics.jsonl: steps {[line['step'] for line in training]}, run lines at steps "
        f"{[run['step'] for run in runs]}; FlopCounterMode here {flops} x 2 workers = {2 * flops}, logged "
        f"{logged}; MFU {min(mfus):.3e}..{max(mfus):.3e}; "
        f"tokens/s x step time = {tokens_per_step} tokens per step (max relative error {worst:.1e}); "
        f"peak {runs[0]['peak_flops_per_second'] / 1e9:.1f} GFLOP/s ({runs[0]['peak']})"
    )

    # --- W&B, offline: one run id for both attempts, every step once -------------------------------
    directories = sorted(glob.glob(str(work_dir / "wandb" / "offline-run-*")))
    assert len(directories) == 2, directories
    histories = [wandb_history(next(Path(d).glob("run-*.wandb"))) for d in directories]
    # offline-run-<date>_<time>-<run id>: the rerun's directory has the killed attempt's id.
    (run_id,) = {Path(d).name.split("-", 3)[3] for d in directories}
    assert histories[1][0] == run_id
    assert histories[0][0] in (run_id, "")  # a killed attempt may not have written its run record
    rows = [row for _, history in histories for row in history]
    assert sorted(step for step, _ in rows) == list(range(1, TRAIN_STEPS + 1))
    print(
        f"W&B offline: {len(directories)} directories, run id {run_id}, history steps "
        f"{sorted(step for step, _ in rows)} (each once)"
    )
    for step, values in rows:
        assert values["train/loss"] == pytest.approx(loss[step], rel=1e-6)
        assert values["train/tokens_per_step"] == tokens_per_step
        assert values["train/model_flops_per_step"] == 2 * flops
        assert 0 < values["train/mfu"] <= 1 and values["train/tokens_per_second"] > 0
        for rank in (0, 1):
            assert values[f"worker{rank}/peak_memory_mib"] > 0
            assert 0 < values[f"worker{rank}/mfu"] <= 1 and values[f"worker{rank}/tokens_per_second"] > 0

    # --- TensorBoard: the events, read back, hold each step's loss, lr, tokens/s and MFU once ------
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work_dir / "tensorboard"))
    events.Reload()
    for tag in ("train/loss", "train/lr", "train/tokens_per_second", "train/mfu"):
        scalars = events.Scalars(tag)
        assert [event.step for event in scalars] == list(range(1, TRAIN_STEPS + 1)), tag
    for event in events.Scalars("train/loss"):
        assert event.value == pytest.approx(loss[event.step], rel=1e-6)
    for event in events.Scalars("train/lr"):
        assert event.value == pytest.approx(0.01 * 0.5 ** ((event.step - 1) // 4))  # StepLR(4, 0.5)
    assert all(0 < event.value <= 1 for event in events.Scalars("train/mfu"))
    print(
        "TensorBoard: "
        + "; ".join(
            f"{tag} steps {[e.step for e in events.Scalars(tag)]}"
            for tag in ("train/loss", "train/lr", "train/tokens_per_second", "train/mfu")
        )
    )

    # --- the profile: one trace per worker, steps 2-3 (the first attempt's), collectives in it ------
    for rank in (0, 1):
        trace = json.loads((work_dir / "profile" / f"worker{rank}.json").read_text())
        names = [event.get("name", "") for event in trace["traceEvents"]]
        assert "train step 2" in names and "train step 3" in names and "train step 4" not in names
        assert names.count("tango_fairscale::all_gather") > 0
        assert names.count("tango_fairscale::reduce_scatter") > 0
        assert any("send" in name for name in names) and any("recv" in name for name in names)
        print(
            f"profile/worker{rank}.json: {len(names)} events, "
            f"{names.count('tango_fairscale::all_gather')} all-gathers, "
            f"{names.count('tango_fairscale::reduce_scatter')} reduce-scatters"
        )

    # --- the memory callback's summary: each worker's tokens/s and MFU -------------------------------
    summary = json.loads((work_dir / "memory_summary.json").read_text())
    for worker in summary["workers"]:
        assert worker["tokens_per_second"] > 0 and 0 < worker["mfu"] <= 1
        assert worker["collective_seconds_per_step"] > 0


def test_server_unreachable_answers_within_its_timeout() -> None:
    import socket
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from tango_fairscale.telemetry.loggers.wandb_logger import server_unreachable

    # Nothing listening: refused at once.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    reason = server_unreachable(f"http://127.0.0.1:{port}", timeout=2)
    assert reason is not None and reason.startswith(f"the W&B server http://127.0.0.1:{port} did not answer")
    # Listening but silent: the timeout bounds the wait.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    started = time.monotonic()
    assert server_unreachable(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=1) is not None
    assert time.monotonic() - started < 5
    silent.close()

    # Any HTTP answer, an error status included, is a server that answers.
    class NotFound(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert server_unreachable(f"http://127.0.0.1:{server.server_address[1]}", timeout=2) is None
    finally:
        server.shutdown()


def test_online_wandb_without_a_server_logs_offline_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Online without network, the run sat at step 0 in W&B's retry loop until the collective
    # timeout (300 s). Now: one warning line, the run logs offline, every step once.
    import socket
    import time

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    config = train_config(
        engine="fairscale",
        train_steps=4,
        checkpoint_every=4,
        callbacks=[{"type": "fairscale::wandb", "project": "tango-fairscale-tests", "every": 1}],
    )
    started = time.monotonic()
    result = harness.train(config, tmp_path / "work")
    elapsed = time.monotonic() - started
    warnings = [line for line in result.logs.splitlines() if "did not answer" in line]
    print(f"{elapsed:.1f} s: {warnings}")
    assert len(warnings) == 1 and "logging offline to" in warnings[0] and "wandb sync" in warnings[0]
    assert f"the W&B server http://127.0.0.1:{port} did not answer" in warnings[0]
    (offline,) = glob.glob(str(tmp_path / "work" / "wandb" / "offline-run-*" / "*.wandb"))
    _, rows = wandb_history(Path(offline))
    assert [step for step, _ in rows] == [1, 2, 3, 4]
    assert elapsed < 120
