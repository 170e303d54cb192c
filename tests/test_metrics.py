"""
The ``fairscale::metrics`` callback (``tango_fairscale.telemetry.metrics.MetricsLog``) and the ``plot``
command: the callback driven hook by hook as Tango's training loop drives it, inside a real
in-process Tango run with Tango's ``"torch"`` engine, and in Tango's worker loop on 2 CPU workers
(:mod:`tests.harness`) with the ``"fairscale"`` engine, through a crash and a resume.
"""

import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple

import pytest
import torch
from tango.common import Lazy, Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import DataLoader, TorchTrainStep, TrainConfig, TrainingEngine
from tango.workspaces import LocalWorkspace

from tango_fairscale.cli import main
from tango_fairscale.telemetry import metrics
from tango_fairscale.telemetry.metrics import METRICS_FILE_NAME, MetricsLog
from tests import harness
from tests.components import RecordLosses, RegressorWithMetrics
from tests.helpers import tango_command, tango_env, train_config, train_work_dir
from tests.test_cli import fails


@pytest.fixture(autouse=True)
def restore_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # As in test_cli: Tango's import_extra_module puts the current directory first on sys.path.
    monkeypatch.setattr(sys, "path", list(sys.path))


def read_all(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_lines(path: Path) -> List[Dict[str, Any]]:
    """The training and validation lines (not the run lines, which describe each run)."""
    return [line for line in read_all(path) if line["kind"] != "run"]


def png_size(path: Path) -> Tuple[int, int]:
    """Width and height of a PNG file, after checking its signature and header chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


class FakeClock:
    """Stands in for time.perf_counter, so that samples/s can be checked exactly."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_callback(tmp_path: Path, train_steps: int, **kwargs: Any) -> MetricsLog:
    """A MetricsLog over a real TrainConfig and a real optimizer and LR schedule (halving every step)."""
    # devices [-1]: a CPU worker even where there is a GPU, so that peak memory is the RSS.
    config = TrainConfig(step_id="test", work_dir=tmp_path, train_steps=train_steps, devices=[-1])
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine = SimpleNamespace(optimizer=optimizer, lr_scheduler=scheduler)
    return MetricsLog(
        workspace=None,  # type: ignore[arg-type]  # not used by the callback
        train_config=config,
        training_engine=engine,  # type: ignore[arg-type]  # the callback reads only .optimizer
        dataset_dict=None,  # type: ignore[arg-type]
        train_dataloader=None,  # type: ignore[arg-type]
        **kwargs,
    )


def micro_batch(size: int) -> Dict[str, torch.Tensor]:
    return {"x": torch.zeros(size, 8), "y": torch.zeros(size)}


def train_step(
    callback: MetricsLog,
    clock: FakeClock,
    step: int,
    outputs: List[Dict[str, Any]],
    *,
    seconds: float = 1.0,
    logged_loss: Any = None,
) -> None:
    """One step as Tango's loop makes it: pre_batch, post_batch, the optimizer step, maybe log_batch."""
    callback.pre_batch(step, 0, [micro_batch(4) for _ in outputs])
    loss = sum(float(output["loss"]) for output in outputs) / len(outputs)
    callback.post_batch(step, 0, loss, outputs)
    # The engine's step, as Tango's TorchTrainingEngine.step orders it: optimizer, then schedule.
    engine: Any = callback.training_engine
    engine.optimizer.step()
    engine.lr_scheduler.step()
    clock.now += seconds
    if logged_loss is not None:
        callback.log_batch(step, 0, logged_loss, outputs)


def test_one_line_per_step_with_every_scalar_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    callback = make_callback(tmp_path, train_steps=3)
    callback.pre_train_loop()
    # Two micro-batches a step (gradient accumulation): scalars are averaged over them.
    step0 = [
        {"loss": torch.tensor(1.0), "mae": torch.tensor(0.5), "count": 3, "prediction": torch.ones(4)},
        {"loss": torch.tensor(3.0), "mae": torch.tensor([1.5]), "count": 5, "prediction": torch.ones(4)},
    ]
    # Tango's log_batch loss (averaged over workers) is the one written when Tango gives it.
    train_step(callback, clock, 0, step0, seconds=2.0, logged_loss=1.75)
    step1 = [
        {"loss": torch.tensor(2.0), "mae": 0.25, "lr": torch.tensor(9.0), "flag": True},
        {"loss": torch.tensor(2.0), "mae": float("nan"), "lr": torch.tensor(7.0), "flag": False},
    ]
    train_step(callback, clock, 1, step1, seconds=4.0)  # not a Tango log step: no log_batch
    # A validation loop: 10 s that samples/s leaves out.
    callback.pre_val_batch(1, 0, 0, micro_batch(4))
    clock.now += 10.0
    callback.post_val_batch(1, 0, 0, {"loss": torch.tensor(0.5), "mae": torch.tensor(0.25)})
    callback.pre_val_batch(1, 1, 0, micro_batch(4))
    callback.post_val_batch(1, 1, 0, {"loss": torch.tensor(1.5), "mae": torch.tensor(0.75)})
    callback.post_val_loop(1, 0, val_metric=1.0, best_val_metric=0.9)
    train_step(callback, clock, 2, [{"loss": torch.tensor(0.5)}], seconds=1.0, logged_loss=0.5)
    callback.post_train_loop(2, 0)

    run, *lines = read_all(tmp_path / METRICS_FILE_NAME)
    assert [(line["kind"], line["step"]) for line in lines] == [
        ("train", 1),
        ("train", 2),
        ("validation", 2),
        ("train", 3),
    ]
    # The run line comes first and says what the figures are: these batches (x, y) have no
    # tokens; FLOPs are counted on the first step (this test's steps compute nothing).
    assert run["kind"] == "run" and run["step"] == 0 and run["world_size"] == 1
    assert run["device"] == "cpu" and run["compute_dtype"] == "float32"
    assert run["tokens"].startswith("none:") and "samples/s only" in run["tokens"]
    assert run["flops"].startswith("FlopCounterMode: forward and backward of step 1")
    assert run["model_flops_counted"] == {"step": 1, "flops": 0.0}
    assert "not measured" in run["collectives"]
    first, second, validation, third = lines
    assert first["loss"] == 1.75 and first["mae"] == 1.0 and first["count"] == 4.0
    assert "prediction" not in first  # not a scalar
    assert first["lr"] == 0.8  # the rate this step's optimizer step used, not the next one's
    # 8 samples in 2 s, the clock started by the first pre_batch.
    assert first["samples_per_second"] == 4.0
    assert first["peak_memory_mib"] > 10  # this process's peak RSS (a CPU "device")
    assert first["step_time_s"] == 2.0 and first["tokens_per_second"] is None
    assert first["model_flops_per_step"] == 0.0 and first["collective_time_s"] is None
    # The worker's own loss where Tango gave none; a model output named like a field is renamed;
    # a NaN mean is null (JSON has no NaN); booleans are not numbers to plot.
    assert second["loss"] == 2.0 and second["output_lr"] == 8.0 and second["mae"] is None
    assert "flag" not in second and second["lr"] == 0.4
    assert second["samples_per_second"] == 2.0  # 8 samples in 4 s
    assert validation == {
        "step": 2,
        "epoch": 0,
        "kind": "validation",
        "val_loss": 1.0,  # Tango's metric
        "val_mae": 0.5,
        "best_val_loss": 0.9,
        "time": validation["time"],
    }
    # The validation's 10 s are not in the third step's time: 4 samples in 1 s.
    assert third["samples_per_second"] == 4.0 and third["lr"] == 0.2
    assert (second["step_time_s"], third["step_time_s"]) == (4.0, 1.0)
    assert first["time"] <= second["time"] <= validation["time"] <= third["time"]


def test_tokens_model_flops_and_mfu_of_real_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A small sequence model trained between the hooks as Tango's loop does it: the FLOPs the
    # log gives a step are FlopCounterMode's count of the same forward and backward passes.
    from torch.utils.flop_counter import FlopCounterMode

    clock = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    callback = make_callback(tmp_path, train_steps=2, peak_tflops=0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 32), torch.nn.Linear(32, 16))

    def forward_backward(micro_batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(micro_batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), micro_batch["input_ids"].flatten())
        loss.backward()
        return loss.detach()

    def lm_batch(size: int, length: int, padding: int) -> Dict[str, torch.Tensor]:
        mask = torch.ones(size, length, dtype=torch.long)
        mask[:, length - padding :] = 0
        return {"input_ids": torch.randint(16, (size, length)), "attention_mask": mask}

    # Step 1: two micro-batches of 4 sequences of 6 positions, 1 of them padding.
    step1 = [lm_batch(4, 6, 1), lm_batch(4, 6, 1)]
    with FlopCounterMode(display=False) as reference:
        for micro_batch in step1:
            forward_backward(micro_batch)
    counted = reference.get_total_flops()
    assert counted > 0
    model.zero_grad()

    callback.pre_train_loop()
    for step, batch in enumerate([step1, [lm_batch(4, 9, 0)]]):
        callback.pre_batch(step, 0, batch)
        losses = [forward_backward(micro_batch) for micro_batch in batch]
        callback.post_batch(step, 0, float(sum(losses)) / len(losses), [{"loss": loss} for loss in losses])
        clock.now += 2.0
    callback.post_train_loop(1, 0)

    run, first, second = read_all(tmp_path / METRICS_FILE_NAME)
    assert run["tokens"] == "attention_mask: its non-zero entries"
    assert run["peak"] == "given: 0.5 TFLOP/s" and run["peak_flops_per_second"] == 0.5e12
    assert run["model_flops_counted"] == {"step": 1, "flops": counted}
    assert first["model_flops_per_step"] == counted
    assert first["tokens_per_step"] == 2 * 4 * 5 and first["step_time_s"] == 2.0
    assert first["tokens_per_second"] == 20.0
    assert first["model_flops_per_second"] == counted / 2.0
    assert first["mfu"] == pytest.approx(counted / 2.0 / 0.5e12)
    # Step 2: 36 positions against step 1's 48: its FLOPs scaled from the counted step's.
    assert second["model_flops_per_step"] == pytest.approx(counted * 36 / 48)
    assert second["tokens_per_step"] == 36 and second["samples_per_second"] == 2.0


def test_every_writes_first_every_nth_and_last_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    callback = make_callback(tmp_path, train_steps=5, every=2)
    for step in range(5):
        train_step(callback, clock, step, [{"loss": torch.tensor(float(step))}])
    callback.post_train_loop(4, 0)
    lines = read_lines(tmp_path / METRICS_FILE_NAME)
    assert [line["step"] for line in lines] == [1, 2, 4, 5]
    assert [line["loss"] for line in lines] == [0.0, 1.0, 3.0, 4.0]
    # Samples/s covers every step since the previous line: 2 steps of 4 samples in 2 s.
    assert [line["samples_per_second"] for line in lines] == [4.0, 4.0, 4.0, 4.0]
    assert [line["step_time_s"] for line in lines] == [1.0, 1.0, 1.0, 1.0]

    with pytest.raises(
        ConfigurationError, match="fairscale::metrics: every must be a whole number, 1 or more, got 0"
    ):
        make_callback(tmp_path, train_steps=5, every=0)


def test_a_resumed_run_drops_the_lines_it_redoes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    path = tmp_path / METRICS_FILE_NAME
    before = [{"step": step, "kind": "train", "loss": 10.0 + step} for step in range(1, 7)]
    before.insert(4, {"step": 4, "kind": "validation", "val_loss": 1.0})
    # The first run's run line, and that of a run that resumed after step 4 and crashed again.
    before.insert(0, {"step": 0, "kind": "run"})
    before.insert(6, {"step": 4, "kind": "run"})
    # A crash while writing leaves half a line at the end.
    path.write_text("".join(json.dumps(line) + "\n" for line in before) + '{"step": 7, "kind": "tr')

    # Resumed from the checkpoint after 4 steps: Tango's first step is step index 4.
    callback = make_callback(tmp_path, train_steps=6)
    for step in (4, 5):
        train_step(callback, clock, step, [{"loss": torch.tensor(float(step))}])
    callback.post_train_loop(5, 0)
    lines = read_all(path)
    assert [(line["kind"], line["step"], line.get("loss")) for line in lines] == [
        ("run", 0, None),
        ("train", 1, 11.0),
        ("train", 2, 12.0),
        ("train", 3, 13.0),
        ("train", 4, 14.0),
        ("validation", 4, None),
        ("run", 4, None),  # this run's, written with its first line
        ("train", 5, 4.0),
        ("train", 6, 5.0),
    ]

    # A run starting from scratch (it crashed before its first checkpoint) starts the file over.
    fresh = make_callback(tmp_path, train_steps=1)
    train_step(fresh, clock, 0, [{"loss": torch.tensor(0.25)}])
    fresh.post_train_loop(0, 0)
    assert [(line["kind"], line["step"], line.get("loss")) for line in read_all(path)] == [
        ("run", 0, None),
        ("train", 1, 0.25),
    ]


def test_in_a_tango_run_with_the_torch_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tango's own "torch" engine, one process, in this process (Tango records the git remote of
    # a run started from a repository's root: start it elsewhere). grad_accum 2 and log_every 3:
    # a line for every step, though Tango's log_batch runs on steps 0, 2, 5 and 6 only.
    from examples.toy.components import RegressionData

    monkeypatch.chdir(tmp_path)
    data = RegressionData(step_name="data", in_features=8, train_size=64, validation_size=32)
    train = TorchTrainStep(
        step_name="train",
        model=Lazy(RegressorWithMetrics, Params({"in_features": 8, "width": 8})),
        training_engine=Lazy(
            TrainingEngine,
            Params({"type": "torch", "optimizer": {"type": "torch::SGD", "lr": 0.1}}),
        ),
        dataset_dict=data,
        train_dataloader=Lazy(DataLoader, Params({"batch_size": 4, "shuffle": True})),
        validation_split="validation",
        validation_dataloader=Lazy(DataLoader, Params({"batch_size": 16})),
        train_steps=7,
        grad_accum=2,
        log_every=3,
        validate_every=7,
        checkpoint_every=7,
        callbacks=[Lazy(MetricsLog), Lazy(RecordLosses)],
    )
    workspace = LocalWorkspace(tmp_path / "ws")
    train.result(workspace)
    work_dir = workspace.work_dir(train)
    lines = read_lines(work_dir / METRICS_FILE_NAME)
    losses = json.loads((work_dir / "losses.json").read_text())
    training = [line for line in lines if line["kind"] == "train"]
    assert [line["step"] for line in training] == list(range(1, 8))
    assert sorted(int(step) for step in losses) == [0, 2, 5, 6]
    for step, loss in losses.items():
        assert training[int(step)]["loss"] == loss
    for line in training:
        assert line["batch_size"] == 4.0 and "prediction" not in line and line["lr"] == 0.1
        assert line["mae"] ** 2 <= line["loss"]  # (mean |e|)^2 <= mean e^2, averaged alike
        assert line["samples_per_second"] > 0
    (validation,) = [line for line in lines if line["kind"] == "validation"]
    assert validation["step"] == 7 and validation["val_batch_size"] == 16.0
    assert validation["val_loss"] == validation["best_val_loss"]
    assert validation["val_mae"] ** 2 <= validation["val_loss"]


# --- the plot command --------------------------------------------------------------------------


def write_metrics(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines: List[Dict[str, Any]] = []
    for step in range(1, 11):
        lines.append({"step": step, "epoch": 0, "kind": "train", "loss": 1.0 / step, "mae": 0.5 / step})
        lines[-1].update(
            {"lr": 0.01, "samples_per_second": 100.0 + step, "peak_memory_mib": 300.0, "time": 1.0}
        )
        if step % 5 == 0:
            lines.append(
                {"step": step, "kind": "validation", "val_loss": 1.2 / step, "best_val_loss": 1.2 / step}
            )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 11, "lo')
    return path


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    work_dir = tmp_path / "work"
    write_metrics(work_dir / METRICS_FILE_NAME)
    assert main(["plot", str(work_dir)]) == 0
    out = capsys.readouterr().out
    # loss, val_loss and best_val_loss share a panel.
    assert "5 panels (loss, mae, lr, samples_per_second, peak_memory_mib)" in out
    assert "skipped 1 unreadable line" in out
    width, height = png_size(work_dir / "metrics.png")
    assert width >= 1000 and height >= 700  # two columns, three rows

    # --keys: those panels only, in that order; a step's directory (WORKSPACE/latest/<step>) works too.
    assert (
        main(["plot", str(tmp_path), "--keys", "val_loss, loss", "-o", str(tmp_path / "a" / "loss.png")]) == 0
    )
    assert "1 panels (loss)" in capsys.readouterr().out
    width, height = png_size(tmp_path / "a" / "loss.png")
    assert width == 600 and height == 340


def test_plot_of_600_metrics_draws_the_first_panels_and_says_what_it_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # 600 metrics over 300 steps took 293 s and made a 39 MB PNG of 601 panels.
    import json
    import time

    path = tmp_path / METRICS_FILE_NAME
    with open(path, "w") as handle:
        for step in range(1, 301):
            handle.write(json.dumps({"step": step, **{f"m{i}": step * 0.1 + i for i in range(600)}}) + "\n")
    started = time.monotonic()
    assert main(["plot", str(path), "-o", str(tmp_path / "many.png")]) == 0
    elapsed = time.monotonic() - started
    out = capsys.readouterr().out
    print(out, f"{elapsed:.1f} s")
    assert "24 panels (m0, m1," in out and "left out 576 panels past --max-panels 24 (m24, m25," in out
    assert "choose with --keys" in out and (tmp_path / "many.png").stat().st_size < 2_000_000
    assert main(["plot", str(path), "-o", str(tmp_path / "two.png"), "--max-panels", "2"]) == 0
    assert "2 panels (m0, m1)" in capsys.readouterr().out


def test_plot_skips_numbers_beyond_floats(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # A 400-digit integer raised OverflowError from float(); as a value it is no number to draw,
    # as a step the line is skipped like any unreadable one.
    path = write_metrics(tmp_path / METRICS_FILE_NAME)
    huge = 10**400
    path.write_text(
        path.read_text().rsplit("\n", 1)[0]
        + "\n"
        + json.dumps({"step": 11, "loss": huge})
        + "\n"
        + json.dumps({"step": huge, "loss": 0.5})
        + "\n"
    )
    assert main(["plot", str(path), "-o", str(tmp_path / "m.png")]) == 0
    assert "skipped 1 unreadable line" in capsys.readouterr().out
    assert png_size(tmp_path / "m.png")[0] > 0


def test_plot_argument_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics_file = write_metrics(tmp_path / "work" / METRICS_FILE_NAME)
    assert "does not exist" in fails(capsys, ["plot", str(tmp_path / "nothing")])
    (tmp_path / "empty_dir").mkdir()
    message = fails(capsys, ["plot", str(tmp_path / "empty_dir")])
    assert "no metrics.jsonl in" in message and "fairscale::metrics" in message
    assert "is a directory" in fails(capsys, ["plot", str(metrics_file), "-o", str(tmp_path)])
    assert "ending in .png" in fails(capsys, ["plot", str(metrics_file), "-o", str(tmp_path / "x.pdf")])
    assert "names no metric" in fails(capsys, ["plot", str(metrics_file), "--keys", " , "])
    message = fails(capsys, ["plot", str(metrics_file), "--keys", "loss,accuracy"])
    assert "no metric accuracy" in message and "it has: loss, mae, lr" in message
    (tmp_path / "junk.jsonl").write_text('not json\n{"step": 1, "kind": "train"}\n')
    assert "has no metrics lines (1 unreadable)" in fails(capsys, ["plot", str(tmp_path / "junk.jsonl")])
    assert "error: the following arguments are required" in fails(capsys, ["plot"])

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    message = fails(capsys, ["plot", str(metrics_file)])
    assert "pip install matplotlib" in message
    assert not (metrics_file.parent / "metrics.png").exists()


# --- on 2 workers ----------------------------------------------------------------------------------


def test_two_workers_crash_resume_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # 8 steps on 2 CPU workers, a checkpoint and a validation every 4. The first run fails on
    # every worker before step index 6, after the lines of steps 1-6; the re-run resumes from
    # the checkpoint after step 4 and redoes steps 5 and 6.
    config = train_config(
        engine="fairscale",
        model={"type": "test::regressor_with_metrics", "in_features": 8, "width": 16},
        train_steps=8,
        checkpoint_every=4,
        validate=True,
        callbacks=[
            {"type": "fairscale::metrics"},
            {"type": "test::record_losses"},
            {"type": "test::fail_once", "step": 6},
        ],
    )
    work_dir = tmp_path / "work"
    (first,) = harness.run([harness.Train(config, work_dir)], out=tmp_path / "first")
    assert all(error is not None and "deliberate failure before step 6" in error for error in first.errors), (
        first.describe()
    )
    path = work_dir / METRICS_FILE_NAME
    crashed = read_lines(path)
    assert [(line["kind"], line["step"]) for line in crashed] == [
        *(("train", step) for step in range(1, 5)),
        ("validation", 4),
        ("train", 5),
        ("train", 6),
    ]
    first_losses = json.loads((work_dir / "losses.json").read_text())
    for line in crashed:
        if line["kind"] == "train":
            assert line["loss"] == first_losses[str(line["step"] - 1)]

    second = harness.train(config, work_dir)
    assert re.search(r"Recovering from previous run at \S*checkpoint_state_step4", second.logs), second.logs
    lines = read_lines(path)
    # Each step once: the first run's 1-4 and validation at 4, the re-run's 5-8 and validation at 8.
    assert [(line["kind"], line["step"]) for line in lines] == [
        *(("train", step) for step in range(1, 5)),
        ("validation", 4),
        *(("train", step) for step in range(5, 9)),
        ("validation", 8),
    ]
    assert lines[:5] == crashed[:5]
    # losses.json has the re-run's losses for the steps it redid, as metrics.jsonl does.
    losses = json.loads((work_dir / "losses.json").read_text())
    training = [line for line in lines if line["kind"] == "train"]
    assert {str(line["step"] - 1): line["loss"] for line in training} == losses
    for line in training:
        # Each worker's own batch of 8; the model's metric averaged over the workers alike.
        assert line["batch_size"] == 8.0 and "prediction" not in line
        assert 0 < line["mae"] and line["mae"] ** 2 <= line["loss"]
        # train_config's StepLR: 0.01, halved after every 4 steps.
        assert line["lr"] == pytest.approx(0.01 if line["step"] <= 4 else 0.005)
        assert line["samples_per_second"] > 0 and line["peak_memory_mib"] > 50
        assert line["epoch"] == 0  # 256 samples, 16 a step: one epoch is 16 steps
        # Throughput: these batches (x, y) have no tokens; the same FLOPs every step (both
        # runs counted their first step); the fairscale backend's rings are timed.
        assert line["tokens_per_step"] is None and line["tokens_per_second"] is None
        assert line["model_flops_per_step"] == training[0]["model_flops_per_step"] > 0
        assert line["model_flops_per_second"] * line["step_time_s"] == pytest.approx(
            line["model_flops_per_step"]
        )
        assert 0 < line["mfu"] <= 1 and line["collective_time_s"] > 0
    runs = [line for line in read_all(path) if line["kind"] == "run"]
    assert [(run["step"], run["model_flops_counted"]["step"]) for run in runs] == [(0, 1), (4, 5)]
    assert all(run["model_flops_counted"]["flops"] == training[0]["model_flops_per_step"] for run in runs)
    for line in (lines[4], lines[-1]):
        assert set(line) == {
            "step",
            "epoch",
            "kind",
            "val_loss",
            "val_mae",
            "val_batch_size",
            "best_val_loss",
            "time",
        }
        assert line["val_batch_size"] == 16.0 and math.isfinite(line["val_loss"])
    assert lines[-1]["best_val_loss"] == min(lines[4]["val_loss"], lines[-1]["val_loss"])

    assert main(["plot", str(work_dir)]) == 0
    assert (
        "11 panels (loss, mae, batch_size, lr, samples_per_second, step_time_s, model_flops_per_step, "
        "model_flops_per_second, mfu, collective_time_s, peak_memory_mib)"
    ) in capsys.readouterr().out
    width, height = png_size(work_dir / "metrics.png")
    assert width > 0 and height > 0 and (work_dir / "metrics.png").stat().st_size > 10_000


def test_a_crash_right_after_a_checkpoint_keeps_the_checkpointed_steps_line(tmp_path: Path) -> None:
    # Every worker fails before step index 3, right after the checkpoint of step 3 (the failing
    # callback runs before the logs' own pre_batch). The rerun resumes after step 3 and never redoes
    # it: its line and row must have been written before the checkpoint was saved.
    config = train_config(
        engine="fairscale",
        train_steps=6,
        checkpoint_every=3,
        callbacks=[
            {"type": "test::fail_once", "step": 3},
            {"type": "fairscale::metrics"},
            {"type": "fairscale::tensorboard", "every": 1},
            {"type": "test::record_losses"},
        ],
    )
    work_dir = tmp_path / "work"
    (first,) = harness.run([harness.Train(config, work_dir)], out=tmp_path / "first")
    assert all(error is not None and "deliberate failure before step 3" in error for error in first.errors)
    assert [line["step"] for line in read_lines(work_dir / METRICS_FILE_NAME)] == [1, 2, 3]

    harness.train(config, work_dir)
    lines = read_lines(work_dir / METRICS_FILE_NAME)
    assert [(line["kind"], line["step"]) for line in lines] == [("train", step) for step in range(1, 7)]
    losses = json.loads((work_dir / "losses.json").read_text())
    assert {str(line["step"] - 1): line["loss"] for line in lines if line["kind"] == "train"} == losses

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work_dir / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [event.step for event in scalars] == list(range(1, 7))
    for event in scalars:
        assert event.value == pytest.approx(losses[str(event.step - 1)], rel=1e-6)


def test_the_workers_of_a_host_share_one_peak_measured_at_once(tmp_path: Path) -> None:
    """
    On CPU workers the host's workers measure the matmul peak at the same moment and share the
    host's best, so that workers stepping at the same speed report the same MFU (before, each
    measured its own whenever it got there: 29.7 % and 61.2 % on a shared machine).
    """
    work_dir = tmp_path / "work"
    harness.train(train_config(train_steps=2, checkpoint_every=2, callbacks=[]), work_dir).check()
    lines = read_all(work_dir / METRICS_FILE_NAME)
    (run,) = [line for line in lines if line["kind"] == "run"]
    first, second = run["peak_flops_per_second_per_worker"]
    assert first == second > 0, run
    assert run["peak_flops_per_second"] == 2 * first
    assert re.fullmatch(
        r"measured: 1024x1024 float32 matmul on \d+ thread\(s\) by each of the host's 2 worker\(s\) at "
        r"once, the host's best: [0-9.]+ GFLOP/s",
        run["peak"],
    ), run["peak"]
    for line in (line for line in lines if line["kind"] == "train"):
        assert line["mfu"] == pytest.approx(line["model_flops_per_second"] / (2 * first))


def test_progress_written_to_a_log_file_is_one_line_per_log_every_steps(tmp_path: Path) -> None:
    """
    ``tango run ... > log 2>&1``: no run of carriage-return redrawn bars in the file (before: Tango's
    bar, one ``\\r`` per redraw), but one line per ``log_every`` steps (Tango's rule: the first,
    every 4th and the last) with the loss and throughput, and one per validation.
    """
    experiment = train_config(train_steps=12, checkpoint_every=6, validate=True)
    experiment["steps"]["train"]["log_every"] = 4
    command = tango_command(experiment, tmp_path / "ws", tmp_path / "cwd")
    log = tmp_path / "tango.log"
    with open(log, "wb") as output:
        result = subprocess.run(
            command,
            cwd=tmp_path / "cwd",
            env=tango_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    text = log.read_bytes().decode()
    assert result.returncode == 0, text[-4000:]
    assert "\r" not in text and "it/s" not in text, text[-4000:]
    # Said at once, then the lines.
    assert "Training: 12 steps on 2 worker(s), a line every 4 step(s) (standard error is no terminal" in text
    progress = [
        line for line in text.splitlines() if line.startswith(("Training step ", "Validation after "))
    ]
    metrics = read_lines(train_work_dir(tmp_path / "ws") / METRICS_FILE_NAME)
    losses = {line["step"]: line["loss"] for line in metrics if line["kind"] == "train"}
    pattern = (
        r"Training step (\d+)/12 \(\d+%\): loss ([0-9.]+), [0-9.,]+ samples/s, MFU [0-9.e-]+ %, "
        r"0:\d\d:\d\d elapsed"
    )
    steps = [re.fullmatch(pattern, line) for line in progress if line.startswith("Training")]
    assert all(steps) and [int(step[1]) for step in steps if step] == [1, 4, 8, 12], progress
    for step in steps:
        assert step is not None and float(step[2]) == pytest.approx(losses[int(step[1])], abs=1e-4)
    assert [line.split(":")[0] for line in progress if line.startswith("Validation")] == [
        "Validation after step 6",
        "Validation after step 12",
    ], progress
