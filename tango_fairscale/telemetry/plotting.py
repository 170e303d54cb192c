"""
The drawing of a metrics log (``metrics.jsonl``, :mod:`tango_fairscale.telemetry.metrics`) that
``python -m tango_fairscale plot`` makes: :func:`metric_keys` and :func:`plot_metrics`.
"""

import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Sequence

from .figures import scalar
from .metrics import METRIC_KINDS

__all__ = ["MAX_PANELS", "NON_METRIC_FIELDS", "metric_keys", "panel_name", "panels_of", "plot_metrics"]

#: Fields of a line that are not metrics (not plotted).
NON_METRIC_FIELDS = ("step", "epoch", "kind", "time")


def metric_keys(lines: Iterable[Mapping[str, Any]]) -> List[str]:
    """The numeric fields of ``lines`` (not ``step``, ``epoch``, ``time``), in first-seen order."""
    keys: Dict[str, None] = {}
    for line in lines:
        if line.get("kind", "train") not in METRIC_KINDS:
            continue
        for key, value in line.items():
            if key not in NON_METRIC_FIELDS and scalar(value) is not None:
                keys.setdefault(key)
    return list(keys)


def panel_name(key: str) -> str:
    """The panel a metric is drawn in: ``val_loss`` and ``best_val_loss`` go with ``loss``."""
    for prefix in ("best_val_", "val_"):
        if key.startswith(prefix) and len(key) > len(prefix):
            return key[len(prefix) :]
    return key


#: The most panels one plot draws by default: 600 panels took 293 s and a 39 MB PNG to draw.
MAX_PANELS = 24


def panels_of(keys: Sequence[str]) -> Dict[str, List[str]]:
    """The panels ``keys`` are drawn in, in first-seen order, each with its keys."""
    panels: Dict[str, List[str]] = {}
    for key in keys:
        panels.setdefault(panel_name(key), []).append(key)
    return panels


def plot_metrics(
    lines: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    output: Path,
    title: str = "",
    max_panels: int = MAX_PANELS,
) -> List[str]:
    """
    Draw ``keys`` of ``lines`` over the steps into the PNG file ``output``: one panel per metric,
    a metric's validation values (``val_<key>``, ``best_val_<key>``) in its panel, the first
    ``max_panels`` panels only (the caller says which were left out: :func:`panels_of`). Returns
    the panels' names. Needs matplotlib (raises ImportError without it); draws with its Agg
    backend and never touches pyplot's global state.
    """
    import matplotlib  # noqa: F401 - imported first so that a missing matplotlib is an ImportError here
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lines = [line for line in lines if line.get("kind", "train") in METRIC_KINDS]
    panels = dict(list(panels_of(keys).items())[:max_panels])
    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6 * columns, 2.8 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    for ax, (name, series) in zip(axes, panels.items()):
        for key in series:
            points = [(line["step"], scalar(line.get(key))) for line in lines]
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
