"""
What a trained ``torch::train`` step left, for a pipeline's own code: its outputs found in a Tango
workspace (:func:`train_outputs`), ``weights.pt`` read (:func:`read_weights`), and the model (and
optimizer) state of a checkpoint of either backend consolidated (:func:`read_checkpoint`). Public:
imported from ``tango_fairscale``, documented in ``docs/python-api.md``.
"""

import dataclasses
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from tango import Step
from tango.workspace import Workspace

from .checkpointing import consolidation
from .checkpointing.files import resolve_checkpoint, safe_load
from .output_paths import export_hf_path

#: The files ``torch::train`` and the engine write in a step's work directory.
WEIGHTS_FILE = "weights.pt"
METRICS_FILE = "metrics.jsonl"
LATEST_CHECKPOINT = "checkpoint_state_latest"


@dataclasses.dataclass(frozen=True)
class TrainOutputs:
    """Where one ``torch::train`` step's outputs are; a file not written (yet) is ``None``."""

    work_dir: Path
    """The step's work directory."""
    weights: Optional[Path]
    """``weights.pt``: the trained model's state dict (:func:`read_weights`), once training ended."""
    metrics: Optional[Path]
    """``metrics.jsonl``: one JSON line per logged step (the ``fairscale::metrics`` callback)."""
    latest_checkpoint: Optional[Path]
    """The latest complete checkpoint (:func:`read_checkpoint`)."""
    export_hf: Optional[Path]
    """The engine's ``export_hf`` directory, when the step's config gives one and it was written."""
    export_hf_merged: Optional[Path]
    """The engine's ``export_hf_merged`` directory, likewise."""


def train_outputs(workspace: Workspace, step: Union[Step, str], *, run: Optional[str] = None) -> TrainOutputs:
    """
    The outputs of the ``torch::train`` step ``step`` in ``workspace``: a :class:`~tango.Step`
    object (as a pipeline built in Python holds it), or the step's name in the run named ``run``
    (as ``tango run`` printed it; by default the workspace's latest run with that step).
    """
    if isinstance(step, Step):
        info = workspace.step_info(step)
    else:
        runs = [workspace.registered_run(run)] if run is not None else _latest_first(workspace)
        found = next((r.steps[step] for r in runs if step in r.steps), None)
        if found is None:
            where = f"run {run!r}" if run is not None else f"any run of {workspace.url}"
            raise KeyError(f"no step named {step!r} in {where}")
        info = found
    work_dir = workspace.work_dir(info)  # type: ignore[arg-type]  # Tango's caches take a StepInfo too
    engine = dict((info.config or {}).get("training_engine") or {})

    def existing(path: Path) -> Optional[Path]:
        return path if path.exists() else None

    def export(option: str) -> Optional[Path]:
        value = engine.get(option)
        return existing(export_hf_path(value, work_dir)) if isinstance(value, str) else None

    latest = work_dir / LATEST_CHECKPOINT
    return TrainOutputs(
        work_dir=work_dir,
        weights=existing(work_dir / WEIGHTS_FILE),
        metrics=existing(work_dir / METRICS_FILE),
        latest_checkpoint=latest.resolve() if latest.exists() else None,
        export_hf=export("export_hf"),
        export_hf_merged=export("export_hf_merged"),
    )


def _latest_first(workspace: Workspace) -> Any:
    return sorted(workspace.registered_runs().values(), key=lambda r: r.start_date, reverse=True)


def read_weights(path: Union[str, Path]) -> Dict[str, torch.Tensor]:
    """
    A ``weights.pt`` the engine wrote (either backend), as the plain model's state dict: read
    with ``weights_only`` and memory-mapped, so a large model costs page cache, not process memory.
    """
    return safe_load(Path(path), mmap=True)  # type: ignore[no-any-return]


def read_checkpoint(path: Union[str, Path], *, with_optimizer: bool = False) -> Dict[str, Any]:
    """
    The plain model's state dict of a checkpoint of either backend: a checkpoint directory, or a
    step's work directory (its latest checkpoint). Every file is checked against the
    checkpoint's marker first (SHA-256). With ``with_optimizer``: ``{"model": ..., "optimizer":
    ...}``, the optimizer state keyed by parameter name.
    """
    return consolidation.consolidate(resolve_checkpoint(Path(path)), with_optimizer=with_optimizer)
