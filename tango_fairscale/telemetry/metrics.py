"""
:class:`MetricsLog`: a per-step metrics log of a ``torch::train`` step, as JSON lines in the
step's work directory, registered as the callback ``"fairscale::metrics"``, which reads the step
telemetry (:mod:`tango_fairscale.telemetry`); and :func:`read_metrics`, which reads the file
back (``python -m tango_fairscale plot`` draws it: :mod:`tango_fairscale.telemetry.plotting`).
"""

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from tango.integrations.torch import TrainCallback

from ..compiling import stats as compiling_stats
from ..cpu.memory import malloc_advises_huge_pages
from ..cpu.threads import describe_threads
from .callback import TelemetryCallback
from .callbacks import check_peak_tflops, check_whole_number
from .core import RankWindows, is_logged
from .figures import finite, scalar
from .record import MeterInfo, StepRecord, mean_loss, mean_outputs, train_figures

__all__ = ["METRICS_FILE_NAME", "MetricsLog", "read_metrics"]

#: The file, in the training step's work directory, that :class:`MetricsLog` appends to.
METRICS_FILE_NAME = "metrics.jsonl"

#: The fields :class:`MetricsLog` writes itself; a model output of one of these names is written
#: as ``output_<name>`` instead.
RESERVED_FIELDS = (
    "step",
    "epoch",
    "kind",
    "loss",
    "lr",
    "samples_per_second",
    "step_time_s",
    "tokens_per_step",
    "tokens_per_second",
    "model_flops_per_step",
    "model_flops_per_second",
    "mfu",
    "collective_time_s",
    "peak_memory_mib",
    "time",
)

#: The kinds of lines that hold metrics over the steps (a ``run`` line describes a run instead).
METRIC_KINDS = ("train", "validation")


@TrainCallback.register("fairscale::metrics", exist_ok=True)
class MetricsLog(TelemetryCallback):
    """
    Appends one JSON line per training step (and one per validation) to ``metrics.jsonl`` in
    the step's work directory, on worker 0. Works with any training engine (``"fairscale"``,
    Tango's ``"torch"``) and any number of workers.

    .. tip::
        Registered as a :class:`~tango.integrations.torch.TrainCallback` under the name
        "fairscale::metrics". Add it with ``callbacks: [{type: "fairscale::metrics"}]``, and
        plot the file with ``python -m tango_fairscale plot WORK_DIR``.

    A training line (``"kind": "train"``) has:

    - ``step``: optimizer steps done, counting this one (Tango's 0-based step index + 1, as in
      Tango's W&B callback and the names of its ``checkpoint_state_step<N>`` directories);
    - ``epoch``: Tango's 0-based epoch;
    - ``loss``: the step's loss averaged over its micro-batches and over the workers (the
      ``batch_loss`` Tango's ``log_batch`` gets; on steps where Tango does not call
      ``log_batch``, computed the same way from each worker's loss);
    - every scalar the model's ``forward`` returned (one-element tensors and numbers; other
      values are skipped), under the model's name for it, averaged over the micro-batches and
      the workers. The model's ``loss`` is the ``loss`` above; a name the line already uses
      (``lr``, ``step``...) is written as ``output_<name>``;
    - ``lr``: the learning rate of the optimizer's first parameter group for this step;
    - ``samples_per_second``: the training throughput of all workers since the previous line:
      the sum over workers of (samples of that worker's batches / that worker's wall time), the
      wall time running from the start of the first step this run took. Data loading,
      optimizer steps and checkpoint saves count, and so does the one-off set-up in a run's
      first step, which makes that line's number low; validation loops do not, nor does what
      Tango does between one and the next step (the checkpoint it saves after a validation);
    - ``step_time_s``: seconds per step since the previous line, on the slowest worker (its
      wall time, as for samples/s, divided by the steps);
    - ``tokens_per_step`` and ``tokens_per_second`` (= ``tokens_per_step / step_time_s``): the
      tokens of a step, all workers together, for batches with an ``attention_mask`` (its
      non-zero entries) or ``input_ids`` (every entry); ``null`` for other batches, whose
      throughput is samples/s only (the run line says so);
    - ``model_flops_per_step`` and ``model_flops_per_second``: the model's FLOPs of a step, all
      workers together, counted by :class:`torch.utils.flop_counter.FlopCounterMode` over the
      forward and backward passes of the run's first step as they execute (recomputed forward
      passes of activation checkpointing included), other steps scaled by their sequence
      positions or samples (see :class:`~tango_fairscale.telemetry.flops.FlopMeter`);
    - ``mfu``: ``model_flops_per_second`` over the sum of the workers' peak FLOP/s: a table of
      dense peaks on GPUs (``null`` for a GPU not in it), a matmul measured once per run on CPU
      workers, or ``peak_tflops``;
    - ``collective_time_s``: seconds per step in FSDP's all-gathers and reduce-scatters on the
      slowest worker (CPU workers of the ``"fairscale"`` engine, either backend; ``null`` where
      they are not timed: on GPUs and with other engines);
    - ``peak_memory_mib``: the highest peak memory of any worker so far
      (:func:`~tango_fairscale.telemetry.core.peak_memory_mib`: allocated CUDA memory on GPUs, the
      process's resident set size on CPU workers), measured after the step's optimizer step;
    - ``time``: the Unix time at which the line was written.

    Before the first training line of each run (a fresh start or a resume), a run line
    (``"kind": "run"``, ``step``: the steps done before it) says how those figures are made:
    ``world_size``, ``device``, ``compute_dtype``, ``peak_flops_per_second`` (all workers) and
    ``peak_flops_per_second_per_worker``, ``peak`` (where worker 0's peak comes from, e.g. the
    measured matmul), ``flops`` (how they are counted) with ``model_flops_counted`` (the counted
    step and its FLOPs, all workers), ``tokens`` (what is counted as tokens, or that there are
    none), ``collectives`` (what is timed) and ``malloc_huge_pages`` (whether worker 0's malloc
    advises transparent huge pages, as CPU workers spawned by ``tango run`` do:
    :func:`~tango_fairscale.cpu.memory.cpu_worker_environment`) and ``threads`` (worker 0's torch
    intra-op threads, ``intra_op``, and where the number came from, ``source``: the engine's
    ``cpu_threads_per_worker``, ``OMP_NUM_THREADS``, the worker's share of the host's cores, or
    torch's default; and ``blas``, the threads numpy's OpenBLAS was told to start, ``None`` for its
    default of one per core: :mod:`tango_fairscale.cpu.threads`).

    A validation line (``"kind": "validation"``), after each validation loop, has ``step``,
    ``epoch``, ``time``, ``val_<name>`` for every scalar the model returned in validation
    (averaged over all validation batches of all workers), with ``val_<val_metric_name>`` being
    Tango's own validation metric, and ``best_val_<val_metric_name>``. The validation before the
    first step (the callback ``fairscale::validate_first``: the model's loss before any training)
    is a validation line of ``step`` 0 with ``"baseline": true`` and no ``best_val_`` value (Tango
    picks the best checkpoint among those it saves, and step 0 has none).

    A step's line is written once its optimizer step is done, when the next step (or a
    validation loop, a checkpoint, or the end of training) starts; each line is flushed as it is written, so
    a crashed run keeps the lines of the steps it finished. Non-finite numbers are written as
    ``null``. The workers' figures come from the step telemetry (:mod:`tango_fairscale.telemetry`):
    every worker puts its record of a step in the run's rendezvous store, and worker 0 (each host's
    first worker, across hosts) waits for the others' records before it writes the step's line
    (the other workers never wait).

    **Resuming.** The file always describes the run that continues: when a run starts, it first
    drops every line whose ``step`` is greater than the number of steps already done, that is
    the checkpoint it resumed from (all lines when it starts from scratch, e.g. after a crash
    before the first checkpoint). The steps redone after a resume are thus logged once, by the
    run that redid them, and ``step`` values never repeat within a kind. (Unparsable lines, the
    half-written end of a crashed run, are dropped too.)

    :param every:
        Write a training line every this many steps, and for the first and the last step (the
        rule of Tango's ``log_every``). Samples/s then covers all the steps since the previous
        line. Validation lines are always written. Default: every step.
    :param peak_tflops:
        Each worker's peak in TFLOP/s for MFU, instead of the table of GPUs or the measurement on
        CPU workers (for a GPU the table lacks). Default: none.
    """

    NAME = "fairscale::metrics"
    # A crashed run keeps the lines of the steps it finished: each is written as its step ends.
    waits_each_step = True

    def __init__(
        self, *args: Any, every: int = 1, peak_tflops: Optional[float] = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.check_options({"every": every, "peak_tflops": peak_tflops})
        self.every = every
        self.telemetry.set_peak_tflops(peak_tflops)
        self._started = False
        self._described = False  # whether this run's run line was written
        self._infos: Dict[int, MeterInfo] = {}  # each worker's, from its first record of the run
        self._windows = RankWindows()  # each worker's figures since the previous line
        # What compiling had cost this process before this run (a process that ran another
        # training before, as a test's worker does): the run's lines count from here.
        before = compiling_stats()
        self._compile_before = (before.graphs, before.seconds)
        self._compiled_graphs = before.graphs  # this worker's compiled graphs at the previous line

    @classmethod
    def check_options(cls, options: Mapping[str, Any], train_steps: Optional[int] = None) -> None:
        """The constructor's options by name, in a worker and in pre-flight (``check_callbacks``)."""
        check_whole_number(cls.NAME, "every", options.get("every"), 1)
        check_peak_tflops(cls.NAME, options.get("peak_tflops"))

    @property
    def path(self) -> Path:
        """The metrics file: ``metrics.jsonl`` in the step's work directory."""
        return self.work_dir / METRICS_FILE_NAME

    def pre_batch(self, step: int, epoch: int, batch: List[Dict[str, Any]]) -> None:
        """On the run's first step, drops the lines it will redo (see "Resuming" above)."""
        if not self._started:
            # The first step this run takes is the number of steps done before it (0 unless
            # it resumed): no callback hook gets the resume step more directly.
            self._started = True
            if self.writes:
                self._drop_lines_after(step)
        super().pre_batch(step, epoch, batch)

    # --- the lines ----------------------------------------------------------------------------

    def receive(self, records: List[StepRecord]) -> None:
        """Writes the line of a step (on logged steps) or of a validation, from every worker's record."""
        own = self.own(records)
        if own.kind == "train":
            self._train_line(records, own)
        elif own.kind in ("validation", "baseline"):
            self._validation_line(records, own)

    def _train_line(self, records: List[StepRecord], own: StepRecord) -> None:
        for record in records:
            if record.info is not None:
                self._infos.setdefault(record.rank, record.info)
        self._windows.add(records)
        if not is_logged(own.step - 1, self.every, self.train_config.train_steps):
            return  # the samples and seconds go into the next line
        if not self._described and self._infos:
            self._described = True
            self._append(self._run_line())
        line: Dict[str, Any] = {
            "step": own.step,
            "epoch": own.epoch,
            "kind": "train",
            "loss": mean_loss(records, own),
        }
        for key, value in mean_outputs(records).items():
            if key == "loss":
                continue  # the same values as Tango's batch loss, which is `loss` already
            line[f"output_{key}" if key in RESERVED_FIELDS else key] = value
        line["lr"] = own.lr
        line.update(train_figures(records, list(self._windows.take().values())))
        compiled = compiling_stats()
        if compiled.graphs != self._compiled_graphs:
            # The line of the step that compiled (with_wrapped_modules.compile): this worker's
            # seconds in the calls that compiled, and its graphs so far in this run (a recompile
            # adds one).
            self._compiled_graphs = compiled.graphs
            graphs_before, seconds_before = self._compile_before
            line["compile_s"] = round(compiled.seconds - seconds_before, 3)
            line["compiled_graphs"] = compiled.graphs - graphs_before
        line["time"] = time.time()
        self._append(line)

    def _validation_line(self, records: List[StepRecord], own: StepRecord) -> None:
        name = self.train_config.val_metric_name
        line: Dict[str, Any] = {"step": own.step, "epoch": own.epoch, "kind": "validation"}
        if own.kind == "baseline":
            # Made only by a run that starts from no checkpoint, which redoes every step: the
            # lines of an earlier attempt go (the first step's pre_batch then keeps this one).
            self.path.unlink(missing_ok=True)
            line["baseline"] = True
        line.update({f"val_{key}": value for key, value in mean_outputs(records).items()})
        # Tango's values: what it compares to pick the best checkpoint (a baseline has no checkpoint).
        line[f"val_{name}"] = own.val_metric
        if own.kind == "validation":
            line[f"best_val_{name}"] = own.best_val_metric
        line["time"] = time.time()
        self._append(line)

    def _run_line(self) -> Dict[str, Any]:
        """The line that says how this run's figures are made (see the class docstring)."""
        infos = [info for _, info in sorted(self._infos.items())]
        first = infos[0]
        peaks = [info.peak_flops_per_second for info in infos]
        counted = [info.counted.get("flops") for info in infos]
        return {
            "step": self.telemetry.first_step,
            "kind": "run",
            "world_size": self.telemetry.world_size,
            "device": first.device,
            "compute_dtype": first.compute_dtype,
            "peak_flops_per_second": None if None in peaks else sum(peaks),
            "peak_flops_per_second_per_worker": peaks,
            "peak": first.peak,
            "flops": first.flops,
            "model_flops_counted": {
                "step": first.counted.get("step"),
                "flops": None if None in counted else sum(counted),
            },
            "tokens": first.tokens,
            "collectives": first.collectives,
            "malloc_huge_pages": malloc_advises_huge_pages(),
            "threads": describe_threads(),
            "time": time.time(),
        }

    def _append(self, line: Dict[str, Any]) -> None:
        line = {key: finite(value) if isinstance(value, float) else value for key, value in line.items()}
        # Opened, written and flushed per line: a crash (of this process) loses no finished line.
        with open(self.path, "a") as handle:
            handle.write(json.dumps(line, allow_nan=False) + "\n")
            handle.flush()

    def _drop_lines_after(self, steps_done: int) -> None:
        """Keep only the lines of the first ``steps_done`` steps (see "Resuming" above)."""
        if not self.path.exists():
            return
        kept = []
        for text in self.path.read_text().splitlines():
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if not isinstance(line, dict) or not isinstance(line.get("step"), int):
                continue
            # A run line at steps_done belongs to a run that started there, which is redone now.
            if line["step"] < steps_done or (line["step"] == steps_done and line.get("kind") != "run"):
                kept.append(text + "\n")
        # Replaced in one rename, so a crash now leaves either the old file or the new one.
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text("".join(kept))
        os.replace(temporary, self.path)


# --- reading ----------------------------------------------------------------------------------


def read_metrics(path: Path) -> Tuple[List[Dict[str, Any]], int]:
    """The lines of a metrics file as dicts, and how many lines could not be read (skipped)."""
    lines: List[Dict[str, Any]] = []
    skipped = 0
    for text in Path(path).read_text().splitlines():
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            skipped += 1
            continue
        step = scalar(line.get("step")) if isinstance(line, dict) else None
        if step is not None and math.isfinite(step):
            lines.append(line)
        else:
            skipped += 1
    return lines, skipped
