"""
The throughput figures' pure parts, in this process: the table of GPU peaks, the measured CPU
peak, token counting, the arithmetic that combines the workers' figures, the timing of the
collectives, and the loggers' exchange of figures through a real TCP store.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
from tango.integrations.torch import TrainConfig

from tango_fairscale.cpu import timing
from tango_fairscale.telemetry.core import MAX_PENDING
from tango_fairscale.telemetry.figures import Window, combine, mfu, worker_figures
from tango_fairscale.telemetry.loggers.base import RankZeroLogger
from tango_fairscale.telemetry.peaks import GPU_PEAK_TFLOPS, gpu_peak, measure_cpu_peak
from tango_fairscale.telemetry.tokens import count_tokens
from tests.helpers import free_port

# --- peaks ------------------------------------------------------------------------------------------


#: Device names as ``torch.cuda.get_device_name()`` gives them, and the row of the table each must
#: find: the specific forms, not the general ones inside their names.
DEVICE_ROWS = [
    ("NVIDIA H100 80GB HBM3", "H100"),  # SXM5
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"),  # not the L4's row
    ("NVIDIA A10G", "A10G"),  # not the A10's row
    ("NVIDIA A10", "A10"),
]
#: The dtypes asked for (float32 with and without tf32) and the table's key for each.
PEAK_KEYS = [
    (torch.bfloat16, False, "bfloat16"),
    (torch.float16, False, "float16"),
    (torch.float32, False, "float32"),
    (torch.float32, True, "tf32"),
]


@pytest.mark.parametrize("name, row", DEVICE_ROWS)
@pytest.mark.parametrize("dtype, tf32, key", PEAK_KEYS)
def test_gpu_peaks_by_name_and_dtype(name: str, row: str, dtype: torch.dtype, tf32: bool, key: str) -> None:
    tflops = dict(GPU_PEAK_TFLOPS)[row][key]
    peak = gpu_peak(name, dtype, tf32=tf32)
    assert peak.flops_per_second == tflops * 1e12
    assert f"{row}, dense {key}" in peak.source and f"{tflops:g} TFLOP/s" in peak.source


def test_the_table_of_gpu_peaks_is_consistent() -> None:
    # Every row, once, and each found by a device name above.
    fragments = [fragment for fragment, _ in GPU_PEAK_TFLOPS]
    assert len(set(fragments)) == len(fragments)
    assert {row for _, row in DEVICE_ROWS} == set(fragments)
    # The first fragment in a device's name wins: one that contains another must come first.
    for index, earlier in enumerate(fragments):
        for later in fragments[index + 1 :]:
            assert earlier not in later, f"{later!r} is listed after {earlier!r}, whose row it would get"
    # Dense tensor-core rates as the data sheets give them: one rate for both 16-bit types, tf32 at
    # half of it, plain float32 at most tf32's (a sparse or mistyped figure breaks one of these).
    for fragment, peaks in GPU_PEAK_TFLOPS:
        assert set(peaks) == {"bfloat16", "float16", "tf32", "float32"}, fragment
        assert peaks["bfloat16"] == peaks["float16"], fragment
        assert peaks["tf32"] == pytest.approx(peaks["float16"] / 2, rel=0.02), fragment
        assert 0 < peaks["float32"] <= peaks["tf32"], fragment


def test_unknown_gpus_and_dtypes_leave_mfu_empty_with_a_note() -> None:
    unknown = gpu_peak("Some Future Accelerator", torch.bfloat16)
    assert unknown.flops_per_second is None
    assert (
        "not in the table of GPU peaks: MFU left empty" in unknown.source and "peak_tflops" in unknown.source
    )
    double = gpu_peak("NVIDIA H100 80GB HBM3", torch.float64)
    assert double.flops_per_second is None and "no float64 peak" in double.source
    assert mfu(1e12, None) is None and mfu(None, 1e12) is None and mfu(1e12, 0.0) is None
    assert mfu(1e12, 4e12) == 0.25


def test_cpu_peak_is_a_timed_matmul_on_this_process_threads() -> None:
    peak = measure_cpu_peak(torch.float32, seconds=0.05, size=256)
    assert peak.flops_per_second is not None and peak.flops_per_second > 0
    assert f"256x256 float32 matmul on {torch.get_num_threads()} thread(s)" in peak.source
    # The best repetition: never slower than the mean rate of the repetitions it took.
    repetitions = int(peak.source.split("best of ")[1].split(",")[0])
    assert repetitions >= 3
    # bfloat16 with its smaller default size.
    assert "512x512 bfloat16" in measure_cpu_peak(torch.bfloat16, seconds=0.01).source


# --- tokens -------------------------------------------------------------------------------------------


def test_tokens_from_the_attention_mask_or_the_input_ids() -> None:
    ids = torch.randint(10, (3, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    padded = count_tokens({"input_ids": ids, "attention_mask": mask})
    assert padded is not None
    assert (padded.tokens, padded.positions, padded.source) == (9, 15, "attention_mask")
    plain = count_tokens({"input_ids": ids, "labels": ids})
    assert plain is not None and (plain.tokens, plain.positions, plain.source) == (15, 15, "input_ids")
    # Not a sequence model's batch: samples/s only.
    assert count_tokens({"x": torch.zeros(4, 8), "y": torch.zeros(4)}) is None
    assert count_tokens({"input_ids": torch.arange(5)}) is None  # one sequence, no batch dimension
    assert count_tokens(torch.zeros(4, 8)) is None


# --- combining the workers' figures ---------------------------------------------------------------


def test_combine_workers_windows() -> None:
    # Two workers over the same 2 steps: worker 1 is slower (it sets the step time).
    fast = Window(steps=2, samples=16, tokens=256, seconds=1.0, flops=4e9, peak_flops_per_second=5e10)
    slow = Window(steps=2, samples=16, tokens=256, seconds=1.6, flops=4e9, peak_flops_per_second=3e10)
    fast.collective_seconds, slow.collective_seconds = 0.2, 0.5
    figures = combine([fast, slow])
    assert figures["step_time_s"] == 0.8
    assert figures["tokens_per_step"] == 256.0
    assert figures["tokens_per_second"] == 320.0
    assert figures["tokens_per_second"] * figures["step_time_s"] == figures["tokens_per_step"]
    assert figures["model_flops_per_step"] == 4e9
    assert figures["model_flops_per_second"] == 5e9
    assert figures["mfu"] == pytest.approx(5e9 / 8e10)
    assert figures["collective_time_s"] == 0.25  # the slowest worker's per step
    # Each worker's own figures.
    own = worker_figures(slow)
    assert own["samples_per_second"] == 10.0 and own["tokens_per_second"] == 160.0
    assert own["mfu"] == pytest.approx(4e9 / 1.6 / 3e10) and own["collective_time_s"] == 0.25

    # A figure one worker lacks is not totalled: no tokens, no peak, no collectives.
    partial = Window(steps=2, samples=16, tokens=None, seconds=1.0, flops=4e9, peak_flops_per_second=None)
    figures = combine([fast, partial])
    assert figures["tokens_per_step"] is None and figures["tokens_per_second"] is None
    assert figures["mfu"] is None and figures["collective_time_s"] is None
    assert figures["model_flops_per_step"] == 4e9
    assert combine([Window()])["step_time_s"] is None


# --- time in collectives ------------------------------------------------------------------------------


def test_timed_collectives_add_seconds_calls_and_a_profiler_range() -> None:
    before = timing.COLLECTIVES.totals()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        with timing.timed("all_gather"):
            torch.mm(torch.ones(64, 64), torch.ones(64, 64))
        with timing.timed("reduce_scatter"):
            pass
        with timing.timed("all_gather"):
            pass
    done = timing.COLLECTIVES.totals().since(before)
    assert done.calls == {"all_gather": 2, "reduce_scatter": 1}
    assert done.seconds["all_gather"] > 0 and done.total_seconds == pytest.approx(
        done.seconds["all_gather"] + done.seconds["reduce_scatter"]
    )
    names = [event.name for event in profiler.events()]
    assert names.count("tango_fairscale::all_gather") == 2
    assert names.count("tango_fairscale::reduce_scatter") == 1


# --- the loggers' exchange through the store --------------------------------------------------------


class Recorder(RankZeroLogger):
    """Keeps what rank 0 writes; ``held`` and a journal as a service that loses rows would have."""

    NAME = "test::recorder"

    def __init__(self, *args: Any, held: int = 0, journal: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held = held
        self.journal = Path(journal) if journal else None
        self.rows: List[Tuple[int, Dict[str, float]]] = []
        self.closed = False

    def open(self, first_step: int) -> int:
        self.first_step = first_step
        return self.held

    def journal_path(self) -> Optional[Path]:
        return self.journal

    def write(self, step: int, row: Dict[str, float]) -> None:
        self.rows.append((step, row))

    def close(self) -> None:
        self.closed = True


def make_workers(tmp_path: Path, port: int, **kwargs: Any) -> List[Recorder]:
    workers = []
    for rank in range(2):
        config = TrainConfig(
            step_id="s",
            work_dir=tmp_path,
            worker_id=rank,
            world_size=2,
            is_distributed=True,
            devices=[-1, -1],
            distributed_port=port,
            train_steps=6,
            log_every=1,
        )
        workers.append(
            Recorder(
                workspace=None,  # type: ignore[arg-type]
                train_config=config,
                training_engine=None,  # type: ignore[arg-type]
                dataset_dict=None,  # type: ignore[arg-type]
                train_dataloader=None,  # type: ignore[arg-type]
                peak_tflops=1.0,
                final_wait_s=0.5,
                **kwargs,
            )
        )
    return workers


def batch(size: int) -> List[Dict[str, torch.Tensor]]:
    return [{"input_ids": torch.zeros(size, 4, dtype=torch.long)}]


def step(worker: Recorder, index: int, loss: float) -> None:
    worker.pre_batch(index, 0, batch(2 + worker.rank))  # worker 1 takes 3 samples a step
    worker.post_batch(index, 0, loss, [])


def test_rank_zero_writes_each_step_once_with_every_workers_figures(tmp_path: Path) -> None:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    zero, one = make_workers(tmp_path, port)
    for worker in (zero, one):
        worker.pre_train_loop()
    # Worker 1 runs two steps behind worker 0: rank 0 holds its rows until worker 1's figures come.
    step(zero, 0, 1.0)
    step(zero, 1, 2.0)
    step(zero, 2, 3.0)  # writes nothing yet: no record of worker 1
    assert zero.rows == [] and zero.first_step == 0
    step(one, 0, 3.0)
    step(one, 1, 4.0)  # worker 1's step 1 record is sent as its step 2 starts
    step(zero, 3, 5.0)  # rank 0 finds it: step 1 is written, then step 2 waits for step 2's record
    assert [s for s, _ in zero.rows] == [1]
    zero.post_val_loop(3, 0, val_metric=0.5, best_val_metric=0.25)  # a validation after step 4
    for index in range(2, 5):
        step(one, index, 1.0)
        if index == 3:  # every worker validates (rank 0 waited out its final wait for this record)
            one.post_val_loop(3, 0, val_metric=0.5, best_val_metric=0.25)
    one.post_train_loop(4, 0)  # worker 1's last record (step 5)
    step(zero, 4, 7.0)
    zero.post_train_loop(4, 0)
    assert zero.closed
    assert [s for s, _ in zero.rows] == [1, 2, 3, 4, 5]
    rows = dict(zero.rows)
    # The loss averaged over the workers; each worker's figures under its name.
    assert [rows[s]["train/loss"] for s in (1, 2, 3, 4, 5)] == [2.0, 3.0, 2.0, 3.0, 4.0]
    assert rows[4]["val/loss"] == 0.5 and rows[4]["val/best_loss"] == 0.25 and "val/loss" not in rows[3]
    for row in rows.values():
        assert row["worker0/peak_memory_mib"] > 0 and row["worker1/peak_memory_mib"] > 0
        assert row["train/tokens_per_step"] == (2 + 3) * 4
        assert row["train/tokens_per_second"] * row["train/step_time_s"] == pytest.approx(20.0)
        assert row["train/model_flops_per_step"] == 0.0  # no model ran: nothing was counted
        # 4 tokens a sample, on each worker.
        for rank in (0, 1):
            assert row[f"worker{rank}/tokens_per_second"] == pytest.approx(
                4 * row[f"worker{rank}/samples_per_second"]
            )
    assert "train/mfu" in rows[1] and rows[1]["train/mfu"] == 0.0
    del server


def test_rank_zero_does_not_wait_for_a_worker_that_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The progress lines (attached where standard error is no terminal, as under pytest) wait
    # 30 s at the end by default; the recorder's 0.5 s is the wait under test.
    from tango_fairscale.telemetry.progress import ProgressLines

    monkeypatch.setattr(ProgressLines, "final_wait_s", 0.5)
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    zero, one = make_workers(tmp_path, port)
    for worker in (zero, one):
        worker.pre_train_loop()
    zero.train_config.train_steps = MAX_PENDING + 10
    step(one, 0, 1.0)
    step(one, 1, 1.0)  # worker 1 sends its step 1 record, then falls silent
    for index in range(MAX_PENDING + 3):
        step(zero, index, 2.0)
    # Past MAX_PENDING waiting rows, the oldest are written without worker 1's figures.
    written = [s for s, _ in zero.rows]
    assert written[0] == 1 and "worker1/peak_memory_mib" in zero.rows[0][1]
    assert written == list(range(1, len(written) + 1)) and len(written) >= 2
    assert "worker1/peak_memory_mib" not in zero.rows[1][1] and zero.rows[1][1]["train/loss"] == 2.0
    zero.post_train_loop(MAX_PENDING + 2, 0)  # waits final_wait_s at most, then writes the rest
    assert [s for s, _ in zero.rows] == list(range(1, MAX_PENDING + 4))
    del server


def test_a_rerun_writes_the_journaled_rows_the_service_lost(tmp_path: Path) -> None:
    journal = tmp_path / "rows.jsonl"
    # A killed run wrote steps 1-5 to its journal (and half a line); its service kept steps 1-2.
    lines = [json.dumps({"step": s, "row": {"train/loss": float(s)}}) for s in range(1, 6)]
    journal.write_text("\n".join(lines) + '\n{"step": 6, "ro')
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    zero, one = make_workers(tmp_path, port, held=2, journal=str(journal))
    for worker in (zero, one):
        worker.pre_train_loop()
    # The rerun resumes from the checkpoint after step 4: steps 3 and 4 come from the journal.
    step(one, 4, 1.0)
    step(zero, 4, 3.0)
    assert zero.rows == [(3, {"train/loss": 3.0}), (4, {"train/loss": 4.0})]
    one.post_train_loop(4, 0)
    zero.post_train_loop(4, 0)
    assert [s for s, _ in zero.rows] == [3, 4, 5] and zero.rows[2][1]["train/loss"] == 2.0
    # The journal: the rows up to the checkpoint, then this run's.
    assert [json.loads(line)["step"] for line in journal.read_text().splitlines()] == [1, 2, 3, 4, 5]
    del server
