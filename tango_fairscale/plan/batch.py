"""
One worker's micro-batch, as ``plan`` measures the step on it: its shape from a sample of the data
(the data step run here), from ``--sequence-length``, or from ``fairscale::tokenize_text``'s
``block_size``; and running a data step with the steps it reads, without a workspace.
"""

import copy
import inspect
import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, Mapping, Optional, Set, Tuple

import torch
import torch.nn as nn
from tango.common import Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import ConcatTensorDictsCollator, DataCollator

from .text import one_line

#: The data step whose ``block_size`` is the sequence length of every training example.
TOKENIZE_TEXT = "fairscale::tokenize_text"
#: ``tokenize_text``'s own default ``block_size``.
TOKENIZE_TEXT_BLOCK_SIZE = 128


@dataclass
class BatchSpec:
    """One worker's micro-batch: the shape and dtype of each tensor the model's forward gets."""

    tensors: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]
    batch_size: int
    """``train_dataloader.batch_size``: examples per worker and micro-batch."""
    grad_accum: int
    """Micro-batches per optimizer step."""
    sequence_length: Optional[int]
    """Tokens per example, where the batch has ``input_ids``."""
    source: str
    """Where the shape came from, for people."""
    others: Dict[str, Any] = field(default_factory=dict)
    """What the batch holds besides tensors (from a sample of the data), passed to forward as it is."""

    def with_batch_size(self, batch_size: int) -> "BatchSpec":
        """The same batch with ``batch_size`` examples (each tensor's first dimension)."""
        tensors = {
            key: ((batch_size, *shape[1:]) if shape and shape[0] == self.batch_size else shape, dtype)
            for key, (shape, dtype) in self.tensors.items()
        }
        return replace(self, tensors=tensors, batch_size=batch_size)

    @property
    def input_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.tensors.values())

    def describe(self) -> str:
        if self.sequence_length:
            shape = f"{self.batch_size} x {self.sequence_length} tokens"
        else:
            shape = f"{self.batch_size} examples"
        accum = f", grad_accum {self.grad_accum}" if self.grad_accum > 1 else ""
        return f"{shape} per worker and micro-batch{accum} ({self.source})"

    def as_dict(self) -> Dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "sequence_length": self.sequence_length,
            "source": self.source,
            "tensors": {
                key: {"shape": list(shape), "dtype": str(dtype).replace("torch.", "")}
                for key, (shape, dtype) in self.tensors.items()
            },
        }


def _data_step(
    step: Dict[str, Any], steps: Mapping[str, Any]
) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """The data step the training step reads (its name, ``None`` for one written inline) and its config."""
    reference = step.get("dataset_dict")
    if isinstance(reference, dict) and reference.get("type") == "ref":
        name = reference.get("ref")
        found = steps.get(name) if isinstance(name, str) else None
        return name, dict(found) if isinstance(found, dict) else None
    if isinstance(reference, dict) and "type" in reference:
        return None, dict(reference)
    return None, None


def _forward_parameters(model: nn.Module) -> Optional[Set[str]]:
    """The names ``model.forward`` takes; ``None`` when it takes any keyword (``**kwargs``)."""
    signature = inspect.signature(model.forward)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return set(signature.parameters)


def batch_spec(
    step: Dict[str, Any],
    steps: Mapping[str, Any],
    model: nn.Module,
    sequence_length: Optional[int],
    sample_data: bool,
) -> Tuple[Optional[BatchSpec], str]:
    """
    One worker's micro-batch: ``train_dataloader.batch_size`` examples, each of the shape that a
    sample of the data has (``sample_data``), or ``sequence_length`` tokens, or
    ``fairscale::tokenize_text``'s ``block_size``. ``(None, why)`` where it cannot be told.
    """
    loader = dict(step.get("train_dataloader") or {})
    grad_accum = int(step.get("grad_accum", 1))
    if "batch_sampler" in loader:
        return None, "train_dataloader has a batch_sampler, whose batch size the plan cannot read"
    batch_size = int(loader.get("batch_size", 1))
    data_name, data = _data_step(step, steps)
    if sample_data:
        return _sampled_batch(step, steps, loader, batch_size, grad_accum, data_name, data), ""
    block_size: Optional[int] = None
    source = ""
    if sequence_length is not None:
        if sequence_length < 1:
            raise ConfigurationError(f"--sequence-length must be at least 1, got {sequence_length}")
        block_size, source = sequence_length, "--sequence-length"
    elif data is not None and data.get("type") == TOKENIZE_TEXT:
        block_size = int(data.get("block_size", TOKENIZE_TEXT_BLOCK_SIZE))
        source = f"{TOKENIZE_TEXT}'s block_size"
    if block_size is None:
        return None, (
            "the shape of an example is unknown: give --sequence-length N (a language model's tokens per "
            "example) or --sample-data (run the data step for one batch)"
        )
    takes = _forward_parameters(model)
    if takes is not None and "input_ids" not in takes:
        return None, (
            f"{type(model).__name__}.forward takes no input_ids, so a sequence length does not say what a "
            "batch holds: give --sample-data (run the data step for one batch)"
        )
    shape = (batch_size, block_size)
    tensors: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {"input_ids": (shape, torch.long)}
    if takes is None or "labels" in takes:
        tensors["labels"] = (shape, torch.long)
    if data is not None and data.get("type") == TOKENIZE_TEXT and data.get("pack") is False:
        tensors["attention_mask"] = (shape, torch.long)
    return (
        BatchSpec(
            tensors=tensors,
            batch_size=batch_size,
            grad_accum=grad_accum,
            sequence_length=block_size,
            source=f"batch_size from train_dataloader, sequence length from {source}",
        ),
        "",
    )


def _sampled_batch(
    step: Dict[str, Any],
    steps: Mapping[str, Any],
    loader: Dict[str, Any],
    batch_size: int,
    grad_accum: int,
    data_name: Optional[str],
    data: Optional[Dict[str, Any]],
) -> BatchSpec:
    """The first batch of the training split, from the data step run here (with the steps it refers to)."""
    from tango.step_graph import StepGraph

    if data is None:
        raise ConfigurationError(
            "--sample-data: the step's dataset_dict is neither a ref to a step of the config nor a step "
            "config; give --sequence-length instead"
        )
    name = data_name or "dataset_dict"
    configs = _with_dependencies(name, data, steps)
    try:
        graph = StepGraph.from_params(configs)
        result = _run_step(graph[name], {})
    except ConfigurationError:
        raise
    except Exception as error:  # noqa: BLE001 - the data step's own failure, on one line
        raise ConfigurationError(
            f"--sample-data: running the data step {name!r} raised {one_line(error)}"
        ) from None
    split_name = str(step.get("train_split", "train"))
    try:
        split = result[split_name]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"--sample-data: the data step {name!r} has no split {split_name!r}"
        ) from None
    examples = [split[index] for index in range(min(batch_size, len(split)))]
    collate_config = loader.get("collate_fn")
    # Tango's DataLoader default, unless the config names another.
    collate: DataCollator = (
        DataCollator.from_params(Params(copy.deepcopy(collate_config)))
        if collate_config
        else ConcatTensorDictsCollator()
    )
    batch = collate(examples)
    # The last batch of a small split may be short: the shape is that of a full one.
    tensors = {
        key: ((batch_size, *value.shape[1:]) if value.dim() else (), value.dtype)
        for key, value in batch.items()
        if isinstance(value, torch.Tensor)
    }
    others = {key: value for key, value in batch.items() if not isinstance(value, torch.Tensor)}
    ids = tensors.get("input_ids")
    return BatchSpec(
        tensors=tensors,
        batch_size=batch_size,
        grad_accum=grad_accum,
        sequence_length=ids[0][1] if ids and len(ids[0]) >= 2 else None,
        source=f"a batch of the data step {name!r}, run here",
        others=others,
    )


def _with_dependencies(name: str, config: Dict[str, Any], steps: Mapping[str, Any]) -> Dict[str, Any]:
    """``config`` under ``name``, with every step it refers to, directly or not."""
    found: Dict[str, Any] = {name: copy.deepcopy(config)}
    pending = [config]
    while pending:
        for value in _values(pending.pop()):
            if isinstance(value, dict) and value.get("type") == "ref" and value.get("ref") not in found:
                reference = value.get("ref")
                if not isinstance(reference, str) or not isinstance(steps.get(reference), dict):
                    raise ConfigurationError(
                        f"--sample-data: the data step refers to {reference!r}, not a step of the config"
                    )
                found[reference] = copy.deepcopy(steps[reference])
                pending.append(steps[reference])
    return found


def _values(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _values(item)
    elif isinstance(value, list):
        for item in value:
            yield from _values(item)


def _run_step(step: Any, done: Dict[str, Any]) -> Any:
    """Run a step of a :class:`~tango.step_graph.StepGraph`, the steps it reads first (no workspace)."""
    from tango import Step

    if step.name in done:
        return done[step.name]

    def resolve(value: Any) -> Any:
        if isinstance(value, Step):
            return _run_step(value, done)
        if isinstance(value, dict):
            return {key: resolve(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(resolve(item) for item in value)
        return value

    done[step.name] = step.run(**resolve(step.kwargs))
    return done[step.name]
