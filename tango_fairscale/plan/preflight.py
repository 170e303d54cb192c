"""
``plan``'s pre-flight: the checks ``tango run`` makes before its workers start
(:func:`tango_fairscale.preflight.preflight`, with the engine's callbacks added as the step adds
them), called with the step's arguments as Tango constructs them from the config, so that
``plan`` refuses what the run would refuse, with the same line.

``plan`` has no workspace and runs no data step (unless ``--sample-data``), so two arguments are
stand-ins:

- the data: with ``--sample-data`` the data step's result; otherwise splits of unknown length,
  named as ``fairscale::tokenize_text`` makes them (``train``, and ``validation`` when it holds one
  out), or, for another data step, any split, never an error. The checks that count examples
  (batches per worker, ``train_epochs``) need the data: ``--sample-data`` runs them.
- the work directory: a path standing for ``WORKSPACE/cache/<step>/work``, with no checkpoint of
  its own, so that a relative ``export_hf`` is checked where it would go.
"""

from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional

from torch.utils.data import Dataset, IterableDataset

from ..preflight import preflight, uses_fairscale_engine
from ..train_step import with_engine_callbacks
from .batch import TOKENIZE_TEXT, _data_step, _run_step, _with_dependencies

__all__ = ["PLACEHOLDER_WORK_DIR", "plan_preflight"]

#: The work directory ``plan`` checks paths against: the run's is ``WORKSPACE/cache/<step id>/work``.
PLACEHOLDER_WORK_DIR = Path("/WORKSPACE/cache/STEP/work")


class _UnknownLength(Dataset):  # type: ignore[type-arg]
    """A split of a map-style dataset whose examples are not known here: ``len`` raises TypeError."""

    def __getitem__(self, index: int) -> Any:
        raise IndexError(index)


class _UnknownIterable(IterableDataset):  # type: ignore[type-arg]
    """A split of a data step whose kind of dataset is not known here: the sampler is not asked for."""

    def __iter__(self) -> Iterator[Any]:
        return iter(())


class _Splits(Mapping[str, Any]):
    """A stand-in ``DatasetDict``: ``names`` (``None``: any name) of splits of unknown length."""

    def __init__(self, names: Optional[List[str]], split: Any) -> None:
        self._names, self._split = names, split

    def __getitem__(self, name: str) -> Any:
        if self._names is not None and name not in self._names:
            raise KeyError(name)
        return self._split

    def __contains__(self, name: object) -> bool:
        return self._names is None or name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names or [])

    def __len__(self) -> int:
        return len(self._names or [])


def _stand_in(data: Optional[Dict[str, Any]]) -> _Splits:
    """The splits the data step ``data`` (its config) will make, as far as its config says."""
    if data is not None and data.get("type") == TOKENIZE_TEXT:
        held_out = ("validation_fraction", "validation_count", "dataset_validation_split")
        validation = any(data.get(name) is not None for name in held_out)
        return _Splits(["train", "validation"] if validation else ["train"], _UnknownLength())
    return _Splits(None, _UnknownIterable())


def _data(step_name: str, steps: Mapping[str, Any], sample_data: bool) -> Any:
    """The data pre-flight checks: the data step's result with ``sample_data``, else a stand-in."""
    name, data = _data_step(dict(steps[step_name]), steps)
    if not sample_data or data is None:
        return _stand_in(data)
    from tango.step_graph import StepGraph

    graph = StepGraph.from_params(_with_dependencies(name or "dataset_dict", data, steps))
    return _run_step(graph[name or "dataset_dict"], {})


def plan_preflight(
    step_name: str,
    steps: Mapping[str, Any],
    world_size: Optional[int] = None,
    *,
    device: Optional[str] = None,
    sample_data: bool = False,
) -> None:
    """
    Run the training step's pre-flight on step ``step_name`` of ``steps`` (the config's steps), for
    ``world_size`` workers (default: its ``device_count``; more than that are hosts of
    ``device_count`` workers each where they divide evenly) on ``device`` (``"cpu"`` or ``"cuda"``).
    Raises its :class:`~tango_fairscale.preflight.PreflightError`; a step not on this package's
    engine is not checked, as ``tango run`` does not check it.
    """
    import torch
    from tango.step_graph import StepGraph

    # Tango's own construction of the step's arguments (Lazy model, engine, loaders, callbacks).
    graph = StepGraph.from_params(_with_dependencies(step_name, dict(steps[step_name]), steps))
    kwargs = dict(graph[step_name].kwargs)
    if not uses_fairscale_engine(kwargs.get("training_engine")):
        return
    device_count = int(kwargs.pop("device_count", 1))
    workers = world_size or device_count
    hosts = workers // device_count if workers > device_count and workers % device_count == 0 else 1
    on_gpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    kwargs["callbacks"] = with_engine_callbacks(kwargs.get("callbacks"))
    kwargs["dataset_dict"] = _data(step_name, steps, sample_data)
    preflight(
        **kwargs,
        devices=[index if on_gpu else -1 for index in range(workers)],
        hosts=hosts,
        work_dir=PLACEHOLDER_WORK_DIR,
    )
