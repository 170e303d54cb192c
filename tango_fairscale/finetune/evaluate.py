"""
The evaluation step ``"fairscale::evaluate"``: a language model's loss and perplexity on one split
of a dataset (e.g. the validation split of ``"fairscale::tokenize_text"``), the loss being the mean
over every token the model predicts, not over batches.

Why not Tango's ``torch::eval``: it averages each batch's metric over the batches, so a batch of
mostly padding weighs as much as a full one, and a perplexity taken from that is not the split's;
and it runs one process with the whole model. This step weighs each batch's loss by its predicted
tokens, and builds the model sharded across workers with the engine's FSDP when asked
(``device_count`` 2 or more, or a ``training_engine``), as ``torch::train`` does on the engine.
"""

import inspect
import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from tango import Step
from tango.common import Lazy, Params
from tango.common.dataset_dict import DatasetDictBase
from tango.common.exceptions import ConfigurationError
from tango.common.util import get_extra_imported_modules, import_extra_module
from tango.format import Format, JsonFormat
from tango.integrations.torch import Model, TrainConfig, TrainingEngine
from tango.integrations.torch.data import ConcatTensorDictsCollator
from tango.integrations.torch.util import move_to_device, resolve_device, set_seed_all
from tango.step import StepResources
from torch import nn

from ..errors import CheckpointError
from ..materialize import has_meta_parameters, mark_pretrained, parameters_on_meta
from ..preflight import PreflightError
from .text_data import IGNORE_INDEX

__all__ = [
    "STEP_NAME",
    "Evaluate",
    "TokenLoss",
    "batch_token_loss",
    "evaluate_model",
    "evaluate_sharded",
    "load_weights",
    "perplexity",
]

logger = logging.getLogger(__name__)

#: The step's registered name.
STEP_NAME = "fairscale::evaluate"
#: The file, in the step's work directory, that worker 0 of a sharded evaluation writes its sums to.
RESULT_FILE_NAME = "evaluation.json"
#: The engine of a sharded evaluation unless ``training_engine`` is given: FairScale's FSDP, each
#: unit built on ``meta`` and read from its files as it is sharded; the optimizer is never stepped.
DEFAULT_ENGINE: Dict[str, Any] = {
    "type": "fairscale",
    "init_on_meta": True,
    "optimizer": {"type": "torch::SGD", "lr": 0.0},
}

#: CPU worker processes per core a sharded evaluation may start. Each holds an interpreter, torch
#: and its share of the model, and past a few per core they only take turns on the cores; without a
#: bound, device_count 1000 forked a thousand processes.
MAX_CPU_WORKERS_PER_CORE = 4

_collate = ConcatTensorDictsCollator()


def _engine_for_evaluation(training_engine: Optional[Lazy[TrainingEngine]]) -> Lazy[TrainingEngine]:
    """
    The engine of a sharded evaluation: the default, or the one given with the default's optimizer
    where it names none (the engine needs one, built and never stepped; a config's engine block
    written for evaluation alone would otherwise fail in every worker).
    """
    from ..preflight import params_of

    if training_engine is None:
        return Lazy(TrainingEngine, Params(dict(DEFAULT_ENGINE)))
    params = params_of(training_engine)
    if not params or "optimizer" in params:
        return training_engine
    return Lazy(TrainingEngine, Params({**params, "optimizer": dict(DEFAULT_ENGINE["optimizer"])}))


@dataclass
class TokenLoss:
    """The summed token loss of some batches, and what it was summed over."""

    loss_sum: float = 0.0
    """The sum, over every predicted token, of its loss (nats)."""

    tokens: int = 0
    """The predicted tokens: the labels other than -100, less the first ``label_shift`` of each example."""

    examples: int = 0
    """The examples of those batches."""

    batches: int = 0
    """The batches."""

    @property
    def loss(self) -> float:
        """The mean token loss, ``loss_sum / tokens`` (NaN without tokens)."""
        return self.loss_sum / self.tokens if self.tokens else math.nan

    def add(self, loss_sum: float, tokens: int, examples: int) -> None:
        """One batch's sums."""
        self.loss_sum += loss_sum
        self.tokens += tokens
        self.examples += examples
        self.batches += 1

    def result(self, split: str, workers: int) -> Dict[str, Any]:
        """The step's result: ``loss``, ``perplexity`` (``exp(loss)``) and what they cover."""
        return {
            "loss": self.loss,
            "perplexity": perplexity(self.loss),
            "tokens": self.tokens,
            "examples": self.examples,
            "batches": self.batches,
            "split": split,
            "workers": workers,
        }


def perplexity(loss: float) -> float:
    """``exp(loss)``: infinite where that overflows a float."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def batch_token_loss(outputs: Any, batch: Mapping[str, Any], label_shift: int = 1) -> Tuple[float, int]:
    """
    A batch's summed token loss and its predicted tokens: the model's ``loss`` (the mean over the
    batch's predicted tokens, as a Hugging Face causal LM computes it) times the number of labels
    other than -100 past the first ``label_shift`` positions of each example (a causal LM predicts
    position ``i`` from the positions before it, so the first label is never predicted: 1; 0 for a
    model whose loss compares each position with its own label).
    """
    labels = batch.get("labels")
    if not isinstance(labels, torch.Tensor):
        raise ConfigurationError(
            f"{STEP_NAME}: the split's examples have no 'labels' tensor; the step needs an LM's "
            "examples (input_ids and labels, as fairscale::tokenize_text makes them)."
        )
    tokens = int((labels[..., label_shift:] != IGNORE_INDEX).sum())
    if tokens == 0:
        return 0.0, 0  # nothing predicted: the model's mean over no token is NaN
    try:
        loss = outputs["loss"]
    except (KeyError, TypeError):
        loss = None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigurationError(
            f"{STEP_NAME}: the model's forward() returned no scalar 'loss' for a batch with labels; "
            "the step needs a model whose forward(**batch) returns it (a transformers LM, a Tango Model)."
        )
    return float(loss.detach().double()) * tokens, tokens


def batch_count(examples: int, batch_size: int) -> int:
    return math.ceil(examples / batch_size)


def batch_at(split: Sequence[Any], index: int, batch_size: int) -> Dict[str, Any]:
    """Batch ``index`` of ``split`` in order (the last may be smaller), collated as Tango's ``DataLoader``."""
    start = index * batch_size
    return _collate([split[i] for i in range(start, min(start + batch_size, len(split)))])


def evaluate_model(
    model: nn.Module, split: Sequence[Any], batch_size: int, label_shift: int = 1, device: Any = None
) -> TokenLoss:
    """In this process: ``model`` (eval mode, on ``device``: a GPU if any) over every batch of ``split``."""
    from ..engine import name_causal_lm_loss

    device = resolve_device(device)
    model.eval()
    model.to(device)
    name_causal_lm_loss(model)  # as the engine does: the loss is the same, without its warning
    totals = TokenLoss()
    with torch.inference_mode():
        for index in range(batch_count(len(split), batch_size)):
            batch = batch_at(split, index, batch_size)
            outputs = model(**move_to_device(batch, device))
            totals.add(*batch_token_loss(outputs, batch, label_shift), examples=len(batch["labels"]))
            del outputs
    return totals


def evaluate_sharded(
    config: TrainConfig,
    model: Lazy[Model],
    training_engine: Lazy[TrainingEngine],
    split: Sequence[Any],
    batch_size: int,
    label_shift: int = 1,
    weights: Optional[str] = None,
) -> TokenLoss:
    """
    On each worker of a process group (``config``: ``worker_id``, ``world_size``, the port): the
    model built by the engine, sharded, and the split's batches dealt out in turn (batch ``i`` to
    worker ``i % world_size``: the batches of a single-process evaluation); every worker runs as many
    forward passes (FSDP's all-gathers are collective), one with nothing left to evaluate repeats a
    batch and counts nothing. Returns the sums of all workers, on every worker.
    """
    set_seed_all(config.seed)
    source = model if weights is None else Lazy(with_weights, model=model, weights=weights)
    engine = training_engine.construct(train_config=config, model=source)
    engine.model.eval()
    rank, world_size = config.worker_id, config.world_size
    batches = batch_count(len(split), batch_size)
    local = TokenLoss()
    for turn in range(math.ceil(batches / world_size)):
        index = turn * world_size + rank
        batch = batch_at(split, index % batches, batch_size)
        outputs = engine.forward_eval(batch)
        if index < batches:
            local.add(*batch_token_loss(outputs, batch, label_shift), examples=len(batch["labels"]))
        del outputs
    # float64: a sum over millions of tokens keeps its digits.
    sums = torch.tensor(
        [local.loss_sum, local.tokens, local.examples, local.batches],
        dtype=torch.float64,
        device=config.worker_local_default_device,
    )
    dist.all_reduce(sums)
    loss_sum, tokens, examples, count = sums.tolist()
    return TokenLoss(loss_sum, int(tokens), int(examples), int(count))


def load_weights(model: nn.Module, path: Union[str, Path]) -> nn.Module:
    """
    ``model``'s parameters and persistent buffers from the state dict file ``path`` (``weights.pt``
    of a ``torch::train`` step, or ``consolidate``'s output), memory-mapped. On a model built on
    ``meta`` (the engine's ``init_on_meta``) each parameter is marked with its tensor, read when its
    FSDP unit is materialised: no worker reads the whole file into its own memory.
    """
    path = Path(path)
    state = read_weights(path)
    check_weights_fit(model, state, path)
    if not has_meta_parameters(model):
        model.load_state_dict(state)
        return model
    for name, parameter in model.named_parameters():
        mark_pretrained(parameter, lambda name=name: state[name])  # type: ignore[misc]
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in state and not buffer.is_meta:
                buffer.copy_(state[name])
    return model


def read_weights(path: Union[str, Path]) -> Mapping[str, torch.Tensor]:
    """The state dict in the file ``path``, memory-mapped (its tensors are read when used)."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file is the same mistake
        raise ConfigurationError(
            f"weights: {path} is not a state dict torch.load reads ({type(error).__name__}); give "
            "a training step's weights.pt or the output of python -m tango_fairscale consolidate."
        ) from error
    if not isinstance(state, Mapping):
        raise ConfigurationError(
            f"weights: {path} holds a {type(state).__name__}, not a state dict; give a training "
            "step's weights.pt or the output of python -m tango_fairscale consolidate."
        )
    return state


def check_weights_fit(model: nn.Module, state: Mapping[str, Any], path: Union[str, Path]) -> None:
    """``state`` has exactly ``model``'s parameters and persistent buffers (on ``meta`` too)."""
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        shown = ", ".join(
            [*(f"missing {k}" for k in missing[:3]), *(f"unexpected {k}" for k in unexpected[:3])]
        )
        raise ConfigurationError(
            f"weights: {path} does not fit the model ({shown}; {len(missing)} missing, {len(unexpected)} "
            "unexpected in all): give the weights of a model built from this config."
        )


def with_weights(model: Lazy[Model], weights: str) -> Model:
    """``model``, built (on ``meta`` where the engine builds so), with the weights of the file ``weights``."""
    built = model.construct()
    load_weights(built, weights)
    return built


def _devices(device_count: int) -> List[int]:
    """Tango's rule (``TorchTrainStep._get_devices``): GPUs when there are enough, else CPU workers (-1)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= device_count:
        return list(range(device_count))
    return [-1] * device_count


def _worker(
    rank: int,
    step_id: str,
    work_dir: str,
    port: int,
    devices: List[int],
    seed: int,
    model: Lazy[Model],
    training_engine: Lazy[TrainingEngine],
    split: Sequence[Any],
    batch_size: int,
    label_shift: int,
    weights: Optional[str],
    include_package: List[str],
) -> None:
    """One worker of a sharded evaluation (``mp.spawn``): worker 0 writes the sums to the work directory."""
    from tango.common import logging as tango_logging

    from ..launch import die_with_parent
    from ..launch.signals import end_quietly_on_signals
    from ..launch.teardown import end_finished_worker

    die_with_parent()
    end_quietly_on_signals()
    for name in include_package:
        import_extra_module(name)
    tango_logging.initialize_worker_logging(rank)
    config = TrainConfig(
        step_id,
        Path(work_dir),
        step_name=STEP_NAME,
        worker_id=rank,
        seed=seed,
        is_distributed=True,
        devices=devices,
        distributed_port=port,
        world_size=len(devices),
    )
    totals = evaluate_sharded(config, model, training_engine, split, batch_size, label_shift, weights)
    if rank == 0:
        path = Path(work_dir) / RESULT_FILE_NAME
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(asdict(totals)))
        os.replace(temporary, path)
    # Without the interpreter's finalization, where gloo's threads can abort it (teardown.py).
    end_finished_worker()


def _check_engine(engine: Lazy[TrainingEngine], device_count: int) -> None:
    """
    A sharded evaluation's workers and engine, as pre-flight checks the training step's: each
    mistake failed in every worker before (a traceback per worker), and ``device_count`` had no
    bound (1000 forked a thousand CPU processes).
    """
    from ..cpu.threads import available_cores
    from ..devices import devices_are_cpu
    from ..options import EngineOptions
    from ..preflight import check_engine_keys, params_of, uses_fairscale_engine

    on_cpu = devices_are_cpu(_devices(device_count))
    limit = MAX_CPU_WORKERS_PER_CORE * available_cores()
    if on_cpu and device_count > limit:
        raise ConfigurationError(
            f"{STEP_NAME}: device_count {device_count} would start {device_count} CPU worker processes "
            f"({torch.cuda.device_count()} GPUs here) on the {available_cores()} cores this process may "
            f"run on: give at most {limit} ({MAX_CPU_WORKERS_PER_CORE} per core)."
        )
    params = params_of(engine)
    if not params:
        return  # an engine built in Python, not from a config: it checks its options in each worker
    if not uses_fairscale_engine(engine):
        raise ConfigurationError(
            f'{STEP_NAME}: training_engine: a sharded evaluation builds the model with the "fairscale" '
            f'engine, not {params.get("type")!r}: give the training step\'s "fairscale" engine block, '
            "or remove training_engine (and use device_count 1 for one process)."
        )
    check_engine_keys(engine)
    EngineOptions.from_config(params).check(
        distributed=True, device_count=device_count, on_cpu=on_cpu, warn=False
    )


def _check_examples(split: str, data: Sequence[Any], label_shift: int) -> None:
    """The split's first example: a language model's (a ``labels`` tensor), with a token to predict."""
    example = data[0]
    labels = example.get("labels") if isinstance(example, Mapping) else None
    if not isinstance(labels, torch.Tensor):
        has = (
            f"keys {', '.join(map(str, example))}" if isinstance(example, Mapping) else type(example).__name__
        )
        raise ConfigurationError(
            f"{STEP_NAME}: dataset_dict: the examples of split {split!r} have no 'labels' tensor (they "
            f"have {has}); the step evaluates a language model on examples of input_ids and labels, "
            "as fairscale::tokenize_text makes them."
        )
    length = labels.shape[-1] if labels.dim() else 1
    if label_shift >= length:
        # Every label would be skipped: a loss of no token (NaN), which Tango cached as the result.
        raise ConfigurationError(
            f"{STEP_NAME}: label_shift {label_shift} leaves no token to predict in the examples of "
            f"split {split!r}, of {length} tokens: give 1 for a causal LM (transformers shifts the "
            "labels itself), 0 for a model whose loss compares each position with its own label."
        )


def _check_forward(built: Any, split: str, example: Mapping[str, Any]) -> None:
    """``forward()`` takes every key of the split's batches: the model is called as ``model(**batch)``."""
    try:
        parameters = inspect.signature(built.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return
    extra = [str(key) for key in example if key not in parameters]
    if extra:
        raise ConfigurationError(
            f"{STEP_NAME}: model: {type(built).__name__}.forward({', '.join(parameters)}) takes no "
            f"{extra[0]!r}, a key of the batches of dataset_dict split {split!r} "
            f"({', '.join(map(str, example))}): the step calls model(**batch) and needs the batch's "
            "mean token loss under 'loss', as a transformers causal LM returns it given labels."
        )


def _check_model_and_data(model: Any, split: str, data: Any, weights: Optional[str] = None) -> None:
    """
    The model's inputs (a pretrained directory that is there, ``weights`` that fit it), a
    ``forward()`` that takes the batches, and data that fits the model.
    """
    from ..preflight import check_pretrained_models
    from .data_fit import check_data_fits_model
    from .hf_export import hf_model_in

    state = None
    if weights is not None:
        try:
            state = read_weights(weights)
        except ConfigurationError as error:
            raise ConfigurationError(f"{STEP_NAME}: {error}") from None
    if isinstance(model, Lazy):
        check_pretrained_models(model, init_on_meta=False)
        try:
            # As the workers build it under init_on_meta: transformers' from_pretrained refuses meta.
            with torch.device("meta"), parameters_on_meta():
                built = model.construct()
        except Exception as error:  # noqa: BLE001 - one that does not build on meta is built for real later
            logger.debug("Not checking the data against the model: it does not build on meta (%s)", error)
            return
    else:
        built = model
    if state is not None:
        try:
            check_weights_fit(built, state, str(weights))
        except ConfigurationError as error:
            raise ConfigurationError(f"{STEP_NAME}: {error}") from None
    _check_forward(built, split, data[0])
    check_data_fits_model(hf_model_in(built), [(split, data)], f"{STEP_NAME}: dataset_dict")


@Step.register(STEP_NAME)
class Evaluate(Step):
    """
    A language model's loss and perplexity on one split of a dataset: the loss is the mean over
    every predicted token of the split (each batch's loss weighted by its tokens, labels of -100 not
    counted), the perplexity ``exp(loss)``. The result (JSON, cached by Tango) is
    ``{"loss", "perplexity", "tokens", "examples", "batches", "split", "workers"}``; the numbers are
    also printed, and logged at INFO level.

    .. tip::
        Registered as a :class:`~tango.step.Step` under the name "fairscale::evaluate".

    The model, one of:

    - a training step's result, ``model: {type: "ref", ref: "train"}`` (built already, so evaluated
      in one process);
    - a model's config, e.g. ``{type: "fairscale::from_pretrained", pretrained_model_name_or_path:
      DIR}`` for a directory the engine's ``export_hf`` (or ``consolidate --format hf``) wrote, or the
      training step's model config with ``weights`` (its ``weights.pt``).

    Where it runs:

    - ``device_count`` 1 (default): in Tango's process, on a GPU if there is one. For models that
      fit one process: nothing is spawned, and a step's result is evaluated as it is.
    - ``device_count`` 2 or more, or a ``training_engine`` given: that many workers (GPUs where
      there are enough, else CPU processes; with ``device_count`` 1, one worker, as a model trained
      on one GPU with CPU offload is evaluated), each building the model from its config sharded by
      the ``"fairscale"`` engine
      (``training_engine``; by default FairScale's FSDP with ``init_on_meta``, so that each unit
      reads its own tensors from the files as it is sharded and no worker holds the whole model),
      for models that do not fit one process. Give the model's config as in the training step
      (``fairscale::with_wrapped_modules`` for its units). The batches are the single-process
      evaluation's, dealt out to the workers in turn, so the result is the same up to floating-point
      rounding.

    :param model: The model (see above). Its ``forward(**batch)`` returns the batch's mean token
        loss under ``"loss"``, as ``transformers``' causal LMs do with ``labels``.
    :param dataset_dict: The data, e.g. ``{type: "ref", ref: "data"}`` for ``fairscale::tokenize_text``.
    :param split: The split to evaluate on.
    :param batch_size: Examples per forward pass (per worker).
    :param weights: A state dict file (a training step's ``weights.pt``, ``consolidate``'s output)
        loaded into the model built from ``model``'s config, memory-mapped (on ``meta`` under
        ``init_on_meta``: each unit reads its own tensors). Its size and modification time are
        part of the step's id, so new weights at the same path are evaluated again.
    :param device_count: Workers (see above); CPU workers at most :data:`MAX_CPU_WORKERS_PER_CORE`
        per core.
    :param training_engine: The engine of a sharded evaluation (any ``device_count``), e.g.
        the training step's (its optimizer is built and never stepped; without one, the default's).
        Default: ``{type: "fairscale", init_on_meta: true, optimizer: {type: "torch::SGD", lr: 0}}``.
    :param label_shift: Positions of each example whose labels the model does not predict: 1 for a
        causal LM (``transformers`` shifts the labels by one), 0 for a model whose loss compares
        each position with its own label.
    :param seed: Seeds the random generators before the model is built.
    """

    DETERMINISTIC = True
    CACHEABLE = True
    FORMAT: Format = JsonFormat()
    VERSION = "001"

    @property
    def resources(self) -> StepResources:
        return self.step_resources or StepResources(gpu_count=self.kwargs.get("device_count", 1))

    @property
    def unique_id(self) -> str:
        # Tango names a result after the step's config: a retrained weights.pt at the same path
        # would reuse the old evaluation. Its size and time tell a new file without reading it.
        cached = self.unique_id_cache
        if cached is None:
            cached = super().unique_id
            weights = self.kwargs.get("weights")
            if isinstance(weights, str) and Path(weights).is_file():
                stat = Path(weights).stat()
                cached = f"{cached}-{stat.st_size:x}-{stat.st_mtime_ns:x}"
            self.unique_id_cache = cached
        return cached

    def run(  # type: ignore[override]
        self,
        model: Union[Lazy[Model], Model],  # Lazy first, as torch::train: a config is built where it runs
        dataset_dict: DatasetDictBase,
        split: str = "validation",
        batch_size: int = 8,
        weights: Optional[str] = None,
        device_count: int = 1,
        training_engine: Optional[Lazy[TrainingEngine]] = None,
        label_shift: int = 1,
        seed: int = 42,
    ) -> Dict[str, Any]:
        in_process = device_count == 1 and training_engine is None
        try:
            data = self._checked(
                model, dataset_dict, split, batch_size, weights, device_count, training_engine, label_shift
            )
            if in_process:
                # In the wrapper too: the model's build, weights that do not load, a forward()
                # without a loss are the config's mistakes, told in one line.
                set_seed_all(seed)
                built = model.construct() if isinstance(model, Lazy) else model
                if weights is not None:
                    load_weights(built, weights)
                totals = evaluate_model(built, data, batch_size, label_shift)
        except PreflightError:
            raise
        except (ConfigurationError, CheckpointError) as error:
            # Without Tango's traceback: the one line (sharded, before any worker is spawned).
            raise PreflightError(f"{type(error).__name__}: {error}") from None
        if not in_process:
            assert isinstance(model, Lazy)
            engine = _engine_for_evaluation(training_engine)
            totals = self._sharded(model, engine, data, batch_size, label_shift, weights, device_count, seed)
        if totals.tokens == 0:
            # A loss of no token is NaN: raised, so that Tango does not cache it as the result.
            raise PreflightError(
                f"ConfigurationError: {STEP_NAME}: split {split!r} has no token to predict (every label "
                f"is -100, or among the first label_shift {label_shift} of its example): check the data "
                "and label_shift."
            )
        result = totals.result(split, device_count)
        line = (
            f"{STEP_NAME}: split {split!r}, {totals.tokens:,} tokens in {totals.examples:,} examples: "
            f"loss {result['loss']:.6g}, perplexity {result['perplexity']:.6g}"
        )
        logger.info(line)
        # Printed too: Tango logs warnings only unless --log-level is given, and these numbers are
        # what the step is for.
        print(line, flush=True)
        return result

    def _checked(
        self,
        model: Any,
        dataset_dict: DatasetDictBase,
        split: str,
        batch_size: int,
        weights: Optional[str],
        device_count: int,
        training_engine: Any,
        label_shift: int,
    ) -> Sequence[Any]:
        """The split, after every option is checked (one line each, naming the option)."""
        for name, value in (("batch_size", batch_size), ("device_count", device_count)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(
                    f"{STEP_NAME}: {name} must be a whole number, 1 or more, got {value!r}."
                )
        if isinstance(label_shift, bool) or not isinstance(label_shift, int) or label_shift < 0:
            raise ConfigurationError(f"{STEP_NAME}: label_shift must be 0 or more, got {label_shift!r}.")
        if split not in dataset_dict.splits:
            raise ConfigurationError(
                f"{STEP_NAME}: split {split!r} is not in the dataset (its splits: "
                f"{', '.join(sorted(dataset_dict.splits))})."
            )
        data = dataset_dict[split]
        if len(data) == 0:
            raise ConfigurationError(f"{STEP_NAME}: split {split!r} has no examples.")
        if weights is not None and not Path(weights).is_file():
            raise ConfigurationError(
                f"{STEP_NAME}: weights: {weights} is not a file (a training step's weights.pt)."
            )
        if training_engine is not None:
            from ..options import check_cpu_threads
            from ..preflight import params_of

            # Read in this process for the workers' environment (_sharded), so checked here.
            check_cpu_threads(params_of(training_engine).get("cpu_threads_per_worker"))
        if (device_count > 1 or training_engine is not None) and not isinstance(model, Lazy):
            what = f"device_count {device_count}" if device_count > 1 else "training_engine"
            raise ConfigurationError(
                f"{STEP_NAME}: {what} builds the model sharded in each worker from "
                "its config, but model is a model built already (a step's result); give the training "
                "step's model config with weights (its weights.pt), or use device_count 1."
            )
        if device_count > 1 or training_engine is not None:
            _check_engine(_engine_for_evaluation(training_engine), device_count)
        _check_examples(split, data, label_shift)
        _check_model_and_data(model, split, data, weights)
        return data  # type: ignore[no-any-return]

    def _sharded(
        self,
        model: Lazy[Model],
        engine: Lazy[TrainingEngine],
        data: Sequence[Any],
        batch_size: int,
        label_shift: int,
        weights: Optional[str],
        device_count: int,
        seed: int,
    ) -> TokenLoss:
        """The workers spawned as ``torch::train`` spawns them, the rendezvous store served from here."""
        import torch.multiprocessing as mp

        from .. import compat
        from ..cpu.memory import cpu_worker_environment
        from ..launch import environment, free_port, rendezvous_store
        from ..preflight import params_of

        devices = _devices(device_count)
        work_dir = Path(self.work_dir)
        result_path = work_dir / RESULT_FILE_NAME
        result_path.unlink(missing_ok=True)
        workers_env = {}
        if devices[0] < 0:
            # As torch::train's CPU workers get them (train_step.py).
            option = params_of(engine).get("cpu_threads_per_worker")
            workers_env = cpu_worker_environment(os.environ, option, device_count)
        with (
            environment(workers_env),
            rendezvous_store(free_port(), set_in_config=False) as port,
            compat.spawn_grace(),  # T4, as for torch::train's workers
        ):
            mp.spawn(
                _worker,
                args=(
                    self.unique_id,
                    str(work_dir),
                    port,
                    devices,
                    seed,
                    model,
                    engine,
                    data,
                    batch_size,
                    label_shift,
                    str(weights) if weights is not None else None,
                    sorted(get_extra_imported_modules()),
                ),
                nprocs=device_count,
            )
        return TokenLoss(**json.loads(result_path.read_text()))
