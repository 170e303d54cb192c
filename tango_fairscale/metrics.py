"""
:class:`MetricsLog`: a per-step metrics log of a ``torch::train`` step, as JSON lines in the
step's work directory, registered as the callback ``"fairscale::metrics"``; and
:func:`read_metrics` / :func:`plot_metrics`, which ``python -m tango_fairscale plot`` uses.
"""

import json
import math
import numbers
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from tango.integrations.torch import TrainCallback

from .callbacks import peak_memory_mib
from .cpu.memory import malloc_advises_huge_pages
from .throughput import StepWindow, Window, combine, meter_for

__all__ = ["METRICS_FILE_NAME", "MetricsLog", "plot_metrics", "read_metrics"]

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

#: Fields of a line that are not metrics (not plotted).
NON_METRIC_FIELDS = ("step", "epoch", "kind", "time")

#: The kinds of lines that hold metrics over the steps (a ``run`` line describes a run instead).
METRIC_KINDS = ("train", "validation")


def _scalar(value: Any) -> Optional[float]:
    """``value`` as a float if it is a single number (a one-element tensor, an int or a float), else None."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item()) if value.numel() == 1 else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer beyond float's range (a hostile or corrupt line)
            return None
    return None


def _sums(outputs: Iterable[Mapping[str, Any]]) -> Dict[str, Tuple[float, int]]:
    """Per key of ``outputs``' scalar values: their sum and how many there were."""
    sums: Dict[str, Tuple[float, int]] = {}
    for output in outputs:
        for key, value in output.items():
            number = _scalar(value)
            if number is not None:
                total, count = sums.get(key, (0.0, 0))
                sums[key] = (total + number, count + 1)
    return sums


def _merge_means(per_worker: Sequence[Mapping[str, Tuple[float, int]]]) -> Dict[str, float]:
    """The mean of each key over every value that every worker summed, keys in first-seen order."""
    merged: Dict[str, Tuple[float, int]] = {}
    for sums in per_worker:
        for key, (total, count) in sums.items():
            old_total, old_count = merged.get(key, (0.0, 0))
            merged[key] = (old_total + total, old_count + count)
    return {key: total / count for key, (total, count) in merged.items() if count}


def _finite(value: Optional[float]) -> Optional[float]:
    # JSON has no NaN or infinity: such values are written as null, which keeps each line
    # readable by any JSON parser.
    return value if value is not None and math.isfinite(value) else None


@dataclass
class _Pending:
    """A training step whose line waits for its optimizer step to finish."""

    step: int  # Tango's 0-based step index
    epoch: int
    local_loss: float
    outputs: Dict[str, Tuple[float, int]]
    lr: Optional[float]
    mean_loss: Optional[float] = None  # Tango's loss averaged over workers, when log_batch got it


@TrainCallback.register("fairscale::metrics", exist_ok=True)
class MetricsLog(TrainCallback):
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
      positions or samples (see :class:`~tango_fairscale.throughput.WorkerMeter`);
    - ``mfu``: ``model_flops_per_second`` over the sum of the workers' peak FLOP/s: a table of
      dense peaks on GPUs (``null`` for a GPU not in it), a matmul measured once per run on CPU
      workers, or ``peak_tflops``;
    - ``collective_time_s``: seconds per step in FSDP's all-gathers and reduce-scatters on the
      slowest worker (CPU workers of the ``"fairscale"`` engine, either backend; ``null`` where
      they are not timed: on GPUs and with other engines);
    - ``peak_memory_mib``: the highest peak memory of any worker so far
      (:func:`~tango_fairscale.callbacks.peak_memory_mib`: allocated CUDA memory on GPUs, the
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
    :func:`~tango_fairscale.cpu.memory.cpu_worker_environment`).

    A validation line (``"kind": "validation"``), after each validation loop, has ``step``,
    ``epoch``, ``time``, ``val_<name>`` for every scalar the model returned in validation
    (averaged over all validation batches of all workers), with ``val_<val_metric_name>`` being
    Tango's own validation metric, and ``best_val_<val_metric_name>``.

    A step's line is written once its optimizer step is done, when the next step (or a
    validation loop, a checkpoint, or the end of training) starts; each line is flushed as it is written, so
    a crashed run keeps the lines of the steps it finished. Non-finite numbers are written as
    ``null``. Writing a line takes one small ``all_gather_object`` over the workers.

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

    def __init__(
        self, *args: Any, every: int = 1, peak_tflops: Optional[float] = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if every < 1:
            raise ValueError(f"fairscale::metrics: every must be >= 1, got {every}")
        if peak_tflops is not None and not peak_tflops > 0:
            raise ValueError(f"fairscale::metrics: peak_tflops must be positive, got {peak_tflops}")
        self.every = every
        self.meter = meter_for(self.train_config, self.training_engine)
        self.meter.set_peak(None if peak_tflops is None else peak_tflops * 1e12)
        self._started = False
        self._first_step = 0
        self._described = False  # whether this run's run line was written
        self._pending: Optional[_Pending] = None
        self._lr: Optional[float] = None
        self._window = StepWindow(self.meter)  # this worker's figures since the previous line
        self._val_sums: Dict[str, Tuple[float, int]] = {}

    @property
    def path(self) -> Path:
        """The metrics file: ``metrics.jsonl`` in the step's work directory."""
        return self.work_dir / METRICS_FILE_NAME

    # --- Tango's hooks ------------------------------------------------------------------------

    def pre_train_loop(self) -> None:
        """Finds this worker's peak FLOP/s: on CPU workers, all workers measure at once, as they train."""
        self.meter.peak()

    def pre_batch(self, step: int, epoch: int, batch: List[Dict[str, Any]]) -> None:
        """Writes the previous step's line, and starts counting this step's samples and tokens."""
        if not self._started:
            # The first step this run takes is the number of steps done before it (0 unless
            # it resumed): no callback hook gets the resume step more directly.
            self._started = True
            self._first_step = step
            if self.is_local_main_process:
                self._drop_lines_after(step)
        self._flush()
        self._window.start_step(step, batch)
        # Read before the optimizer step: the engine steps the LR scheduler right after it.
        self._lr = self._current_lr()

    def post_batch(
        self, step: int, epoch: int, batch_loss: float, batch_outputs: List[Dict[str, Any]]
    ) -> None:
        """Keeps the step's loss and scalar outputs until its optimizer step is done."""
        self._window.end_forward_backward(step)
        self._pending = _Pending(step, epoch, batch_loss, _sums(batch_outputs), self._lr)

    def log_batch(
        self, step: int, epoch: int, batch_loss: float, batch_outputs: List[Dict[str, Any]]
    ) -> None:
        """Takes Tango's loss averaged over the workers (this hook only runs on Tango's log steps)."""
        if self._pending is not None and self._pending.step == step:
            self._pending.mean_loss = batch_loss

    def pre_val_batch(self, step: int, val_step: int, epoch: int, val_batch: Dict[str, Any]) -> None:
        """Writes the step's line and stops the clock for the validation loop."""
        self._flush()
        self._window.pause()
        if val_step == 0:
            self._val_sums = {}

    def post_val_batch(self, step: int, val_step: int, epoch: int, val_batch_outputs: Dict[str, Any]) -> None:
        """Adds up the validation batch's scalar outputs."""
        for key, (total, count) in _sums([val_batch_outputs]).items():
            old_total, old_count = self._val_sums.get(key, (0.0, 0))
            self._val_sums[key] = (old_total + total, old_count + count)

    def post_val_loop(self, step: int, epoch: int, val_metric: float, best_val_metric: float) -> None:
        """Writes the validation line."""
        self._flush()  # in case the loop had no batches
        self._window.pause()
        per_worker = self._gather(self._val_sums)
        self._val_sums = {}
        if not self.is_local_main_process:
            return
        name = self.train_config.val_metric_name
        line: Dict[str, Any] = {"step": step + 1, "epoch": epoch, "kind": "validation"}
        line.update({f"val_{key}": value for key, value in _merge_means(per_worker).items()})
        # Tango's values: what it compares to pick the best checkpoint.
        line[f"val_{name}"] = val_metric
        line[f"best_val_{name}"] = best_val_metric
        line["time"] = time.time()
        self._append(line)

    def post_train_loop(self, step: int, epoch: int) -> None:
        """Writes the last step's line."""
        self._flush()

    def state_dict(self) -> Dict[str, Any]:
        """
        Writes the pending step's line. Tango asks every callback for its state on every worker
        just before it saves a checkpoint: a run killed after that checkpoint resumes after this
        step and never redoes it, so its line must be in the file before the save.
        """
        self._flush()
        return super().state_dict()

    # --- the lines ----------------------------------------------------------------------------

    def _should_write(self, step: int) -> bool:
        last = self.train_config.train_steps
        return step == 0 or (step + 1) % self.every == 0 or (last is not None and step == last - 1)

    def _flush(self) -> None:
        """
        Write the pending step's line. Every worker calls this at the same points (Tango calls
        every hook on every worker), so the gather inside cannot leave one waiting.
        """
        pending, self._pending = self._pending, None
        if pending is None or not self._should_write(pending.step):
            return  # the samples and seconds go into the next line
        local: Dict[str, Any] = {
            "loss": pending.local_loss,
            "outputs": pending.outputs,
            "window": self._window.close(),
            "peak": peak_memory_mib(self.train_config.worker_local_default_device),
        }
        if not self._described:
            local["info"] = self.meter.info()
        gathered = self._gather(local)
        if not self._described:
            self._described = True
            if self.is_local_main_process:
                self._append(self._run_line([w["info"] for w in gathered]))
        if not self.is_local_main_process:
            return
        loss = pending.mean_loss
        if loss is None:
            loss = pending.local_loss
            if len(gathered) > 1:
                # As Tango averages it: a float32 sum over the workers, divided by their number.
                total = torch.tensor([w["loss"] for w in gathered], dtype=torch.float32).sum()
                loss = total.item() / len(gathered)
        line: Dict[str, Any] = {
            "step": pending.step + 1,
            "epoch": pending.epoch,
            "kind": "train",
            "loss": loss,
        }
        for key, value in _merge_means([w["outputs"] for w in gathered]).items():
            if key == "loss":
                continue  # the same values as Tango's batch loss, which is `loss` already
            line[f"output_{key}" if key in RESERVED_FIELDS else key] = value
        line["lr"] = pending.lr
        windows: List[Window] = [w["window"] for w in gathered]
        line["samples_per_second"] = sum(w.samples / w.seconds for w in windows if w.seconds > 0)
        line.update(combine(windows))
        line["peak_memory_mib"] = max(w["peak"] for w in gathered)
        line["time"] = time.time()
        self._append(line)

    def _run_line(self, infos: List[Any]) -> Dict[str, Any]:
        """The line that says how this run's figures are made (see the class docstring)."""
        first = infos[0]
        peaks = [info.peak_flops_per_second for info in infos]
        counted = [info.counted.get("flops") for info in infos]
        return {
            "step": self._first_step,
            "kind": "run",
            "world_size": len(infos),
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
            "time": time.time(),
        }

    def _current_lr(self) -> Optional[float]:
        optimizer = getattr(self.training_engine, "optimizer", None)
        groups = getattr(optimizer, "param_groups", None)
        if not groups:
            return None
        return _scalar(groups[0].get("lr"))

    def _gather(self, local: Any) -> List[Any]:
        if self.train_config.is_distributed and dist.is_available() and dist.is_initialized():
            gathered: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
            return gathered
        return [local]

    def _append(self, line: Dict[str, Any]) -> None:
        line = {key: _finite(value) if isinstance(value, float) else value for key, value in line.items()}
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


# --- reading and plotting ---------------------------------------------------------------------


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
        step = _scalar(line.get("step")) if isinstance(line, dict) else None
        if step is not None and math.isfinite(step):
            lines.append(line)
        else:
            skipped += 1
    return lines, skipped


def metric_keys(lines: Iterable[Mapping[str, Any]]) -> List[str]:
    """The numeric fields of ``lines`` (not ``step``, ``epoch``, ``time``), in first-seen order."""
    keys: Dict[str, None] = {}
    for line in lines:
        if line.get("kind", "train") not in METRIC_KINDS:
            continue
        for key, value in line.items():
            if key not in NON_METRIC_FIELDS and _scalar(value) is not None:
                keys.setdefault(key)
    return list(keys)


def panel_name(key: str) -> str:
    """The panel a metric is drawn in: ``val_loss`` and ``best_val_loss`` go with ``loss``."""
    for prefix in ("best_val_", "val_"):
        if key.startswith(prefix) and len(key) > len(prefix):
            return key[len(prefix) :]
    return key


def plot_metrics(
    lines: Sequence[Mapping[str, Any]], keys: Sequence[str], output: Path, title: str = ""
) -> List[str]:
    """
    Draw ``keys`` of ``lines`` over the steps into the PNG file ``output``: one panel per metric,
    a metric's validation values (``val_<key>``, ``best_val_<key>``) in its panel. Returns the
    panels' names. Needs matplotlib (raises ImportError without it); draws with its Agg
    backend and never touches pyplot's global state.
    """
    import matplotlib  # noqa: F401 - imported first so that a missing matplotlib is an ImportError here
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lines = [line for line in lines if line.get("kind", "train") in METRIC_KINDS]
    panels: Dict[str, List[str]] = {}
    for key in keys:
        panels.setdefault(panel_name(key), []).append(key)
    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6 * columns, 2.8 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    for ax, (name, series) in zip(axes, panels.items()):
        for key in series:
            points = [(line["step"], _scalar(line.get(key))) for line in lines]
            xs = [step for step, value in points if value is not None and math.isfinite(value)]
            ys = [value for _, value in points if value is not None and math.isfinite(value)]
            if key.startswith("best_val_"):
                ax.plot(xs, ys, linestyle="--", drawstyle="steps-post", label="best validation")
            elif key.startswith("val_"):
                ax.plot(xs, ys, marker="o", markersize=4, label="validation")
            else:
                ax.plot(xs, ys, marker="." if len(xs) <= 50 else None, label="train")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize="small")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if title:
        figure.suptitle(title, fontsize="medium")
    figure.savefig(output, format="png", dpi=100)
    return list(panels)
