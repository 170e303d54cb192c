"""Tango components used only by the tests (imported by the workers with ``-i tests.components``)."""

import faulthandler
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Dict, Sequence

import torch
from tango import Step
from tango.common.dataset_dict import DatasetDict
from tango.integrations.torch import Model, TrainCallback, TrainingEngine

from examples.toy.components import ToyRegressor
from tango_fairscale import FairScaleTrainingEngine

# Every process of a test's run (the main one and its workers import this module): SIGUSR1 prints
# each thread's Python stack to standard error, so a test whose run did not end in time can show
# where each process waits (tests.helpers.dump_stacks).
faulthandler.register(signal.SIGUSR1, all_threads=True)


def local(value: Any) -> Any:
    """This worker's part of a DTensor; anything else as it is."""
    # Imported here: torch.distributed.tensor costs every process that loads this module a second.
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


@TrainCallback.register("test::record_state_sizes")
class RecordStateSizes(TrainCallback):
    """
    Writes, per worker, how many parameter and optimizer-state elements (and bytes, gradients
    included) that worker holds after training, to ``state_sizes_worker{N}.json`` in the step's
    work directory.
    """

    def post_train_loop(self, step: int, epoch: int) -> None:
        model = self.training_engine.model
        optimizer = self.training_engine.optimizer
        # The torch backend's tensors are DTensors, whose numel() is the whole tensor's.
        states = [local(value) for state in optimizer.state.values() for value in state.values()]
        optimizer_numel = sum(v.numel() for v in states if isinstance(v, torch.Tensor) and v.dim() > 0)
        optimizer_bytes = sum(v.numel() * v.element_size() for v in states if isinstance(v, torch.Tensor))
        parameters = [local(p) for p in model.parameters()]
        sizes: Dict[str, Any] = {
            "worker": self.train_config.worker_id,
            "param_numel": sum(p.numel() for p in parameters),
            "optimizer_numel": optimizer_numel,
            "param_bytes": sum(p.numel() * p.element_size() for p in parameters),
            "grad_bytes": sum(
                local(p.grad).numel() * p.grad.element_size()
                for p in model.parameters()
                if p.grad is not None
            ),
            "optimizer_bytes": optimizer_bytes,
        }
        path = self.train_config.work_dir / f"state_sizes_worker{self.train_config.worker_id}.json"
        path.write_text(json.dumps(sizes))


@TrainCallback.register("test::record_losses")
class RecordLosses(TrainCallback):
    """Appends ``{step: batch_loss}`` (averaged over workers) to ``losses.json`` in the work directory."""

    def log_batch(self, step: int, epoch: int, batch_loss: float, batch_outputs: Any) -> None:
        if not self.is_local_main_process:
            return
        path = self.train_config.work_dir / "losses.json"
        losses = json.loads(path.read_text()) if path.exists() else {}
        losses[str(step)] = batch_loss
        path.write_text(json.dumps(losses))


@TrainCallback.register("test::record_process")
class RecordProcess(TrainCallback):
    """
    Writes ``process.json`` to the work directory before training: the process that trains (its
    parent's id, so that a test tells Tango's main process from a worker spawned by it) and its
    process group, as the workers see them.
    """

    def pre_train_loop(self) -> None:
        import torch.distributed as dist

        if not self.is_local_main_process:
            return
        record = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "process_group": dist.is_initialized(),
            "world_size": dist.get_world_size() if dist.is_initialized() else None,
        }
        (self.train_config.work_dir / "process.json").write_text(json.dumps(record))


@TrainCallback.register("test::slow_down")
class SlowDown(TrainCallback):
    """Sleeps after every batch, so that a test can kill a run between two checkpoints."""

    def __init__(self, *args: Any, seconds: float = 0.2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = seconds

    def post_batch(self, step: int, epoch: int, batch_loss: float, batch_outputs: Any) -> None:
        time.sleep(self.seconds)


@TrainCallback.register("test::save_after_load")
class SaveAfterLoad(TrainCallback):
    """Saves the engine's state to ``after_load/`` right before training starts (after any resume)."""

    def pre_train_loop(self) -> None:
        self.training_engine.save_checkpoint(
            self.train_config.work_dir / "after_load", {"training_steps": -1}
        )


@TrainingEngine.register("test::fairscale_crash_in_save")
class CrashInSave(FairScaleTrainingEngine):
    """
    The ``"fairscale"`` engine, except that worker 1 kills itself with SIGKILL right after
    writing its model file of checkpoint ``crash_at_checkpoint``, once (a marker file in the
    work directory remembers that it happened, so the re-run goes through).
    """

    def __init__(self, *args: Any, crash_at_checkpoint: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        write_file = self.sharding.write_file  # type: ignore[attr-defined]

        def write_then_crash(checkpoint_dir: Path, name: str, state: Any, step: Any) -> Dict[str, Any]:
            digest = write_file(checkpoint_dir, name, state, step)
            crashed = self.train_config.work_dir / "crashed_once"
            if (
                name == "model"
                and self.train_config.worker_id == 1
                and checkpoint_dir.name == crash_at_checkpoint
                and not crashed.exists()
            ):
                crashed.touch()
                os.kill(os.getpid(), signal.SIGKILL)
            return digest  # type: ignore[no-any-return]

        self.sharding.write_file = write_then_crash  # type: ignore[attr-defined]


@Model.register("test::no_parameters")
class NoParameters(Model):
    """A model with nothing to train."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"loss": (x.sum() - y.sum()) ** 2}


@Model.register("test::raises_in_constructor")
class RaisesInConstructor(Model):
    """A model whose constructor fails, as a user's can."""

    def __init__(self) -> None:
        super().__init__()
        raise ValueError("checkpoint file /nowhere/model.bin not found\nsecond line of the message")


@Model.register("test::no_loss")
class NoLoss(Model):
    """A model whose forward returns predictions but no loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"prediction": self.linear(x)}


@TrainCallback.register("test::fail_on_worker")
class FailOnWorker(TrainCallback):
    """Raises on one worker only, at a given step, while the others carry on into collectives."""

    def __init__(self, *args: Any, worker: int = 1, step: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker = worker
        self.step = step

    def pre_batch(self, step: int, epoch: int, batch: Any) -> None:
        if step == self.step and self.train_config.worker_id == self.worker:
            raise RuntimeError(f"deliberate failure on worker {self.worker} at step {step}")


@Model.register("test::t5")
class TinyT5(Model):
    """A T5 encoder-decoder built from config numbers, trained to reproduce its input."""

    def __init__(
        self, vocab_size: int = 64, d_model: int = 32, num_layers: int = 2, num_heads: int = 2
    ) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(
            vocab_size=vocab_size,
            d_model=d_model,
            d_kv=d_model // num_heads,
            d_ff=2 * d_model,
            num_layers=num_layers,
            num_heads=num_heads,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        self.t5 = T5ForConditionalGeneration(config)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"loss": self.t5(input_ids=input_ids, labels=labels).loss}


@Model.register("test::hf_gpt2")
class HFGPT2(Model):
    """
    A plain ``GPT2LMHeadModel`` with Hugging Face's defaults (its key/value cache on), built from
    config numbers, with dropout off so that every engine computes the same thing.
    """

    def __init__(self, n_layer: int, n_embd: int, n_head: int, vocab_size: int, n_positions: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            vocab_size=vocab_size,
            n_positions=n_positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.gpt2 = GPT2LMHeadModel(config)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"loss": self.gpt2(input_ids=input_ids, labels=labels).loss}


class _NormBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.linear(self.norm(x)))


@Model.register("test::norm_regressor")
class NormRegressor(Model):
    """The toy regressor's shape with a LayerNorm in every block (as in transformer blocks)."""

    def __init__(self, in_features: int = 8, width: int = 32, num_blocks: int = 3) -> None:
        super().__init__()
        self.input = torch.nn.Linear(in_features, width)
        self.blocks = torch.nn.Sequential(*[_NormBlock(width) for _ in range(num_blocks)])
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        prediction = self.head(self.norm(self.blocks(self.input(x)))).squeeze(-1).float()
        return {"loss": torch.nn.functional.mse_loss(prediction, y)}


@Model.register("test::attention_regressor")
class AttentionRegressor(Model):
    """Stock modules init_on_meta must initialise: nn.MultiheadAttention (``_reset_parameters``)
    and a bare ``nn.Parameter`` on a module without an initialiser."""

    def __init__(self, in_features: int = 8, width: int = 16) -> None:
        super().__init__()
        self.input = torch.nn.Linear(in_features, width)
        self.attention = torch.nn.MultiheadAttention(width, 2, batch_first=True)
        self.gain = torch.nn.Parameter(torch.full((width,), 0.5))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        hidden = self.input(x).unsqueeze(1)
        attended, _ = self.attention(hidden, hidden, hidden)
        prediction = self.head((hidden + attended * self.gain).squeeze(1)).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(prediction, y)}


class _ForgetfulInit(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(width, width))
        self.shift = torch.nn.Parameter(torch.empty(width))

    def reset_parameters(self) -> None:  # forgets ``shift``
        torch.nn.init.eye_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.shift


@Model.register("test::forgetful_init")
class ForgetfulInit(Model):
    """Two modules whose initialiser leaves a parameter unset: init_on_meta cannot build it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.first = _ForgetfulInit(width)
        self.second = _ForgetfulInit(width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        prediction = self.second(self.first(x)).sum(-1)
        return {"loss": torch.nn.functional.mse_loss(prediction, y)}


@Model.register("test::regressor_with_metrics")
class RegressorWithMetrics(Model):
    """
    A small regressor whose forward also returns a scalar metric (``mae``), a Python number
    (``batch_size``) and a non-scalar (``prediction``), for the ``fairscale::metrics`` tests.
    """

    def __init__(self, in_features: int = 8, width: int = 16) -> None:
        super().__init__()
        self.input = torch.nn.Linear(in_features, width)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, Any]:
        prediction = self.head(torch.nn.functional.gelu(self.input(x))).squeeze(-1)
        return {
            "loss": torch.nn.functional.mse_loss(prediction, y),
            "mae": (prediction - y).abs().mean().detach(),
            "batch_size": x.shape[0],
            "prediction": prediction.detach(),
        }


@TrainCallback.register("test::fail_once")
class FailOnce(TrainCallback):
    """
    Raises on every worker before training step ``step`` (0-based), once: a marker file in the
    work directory remembers it, so that re-running the same config resumes and finishes.
    """

    def __init__(self, *args: Any, step: int = 5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step = step
        # Decided before training, so that worker 0 writing the marker cannot change worker 1's mind.
        self.marker = self.train_config.work_dir / "failed_once"
        self.fail = not self.marker.exists()

    def pre_batch(self, step: int, epoch: int, batch: Any) -> None:
        if step == self.step and self.fail:
            if self.is_local_main_process:
                self.marker.touch()
            # No worker raises before the marker is written (a raising worker gets the others
            # terminated); every worker raises at this step, so none waits in a collective.
            if self.train_config.is_distributed:
                torch.distributed.barrier()
            raise RuntimeError(f"deliberate failure before step {step}")


@TrainCallback.register("test::fill_disk_once")
class FillDiskOnce(TrainCallback):
    """
    Fills the filesystem of the work directory, once, leaving ``leave_bytes`` free: with a file
    ``ballast`` in the work directory, written by worker 0 after training step ``step`` (0-based:
    before that step's checkpoint is saved) or, with ``step`` null, after the training loop
    (before ``weights.pt`` is written). A marker file in the work directory remembers it, so that
    re-running the same config (after removing the ballast: more space) resumes and finishes.
    """

    def __init__(self, *args: Any, step: Any = None, leave_bytes: int = 512 << 10, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step, self.leave_bytes = step, leave_bytes
        # Decided before training, so that worker 0 writing the marker cannot change worker 1's mind.
        self.marker = self.train_config.work_dir / "filled_disk_once"
        self.fill = not self.marker.exists()

    def _fill(self) -> None:
        if not self.fill:
            return
        if self.is_local_main_process:
            self.marker.touch()
            work_dir = self.train_config.work_dir
            free = os.statvfs(work_dir).f_bavail * os.statvfs(work_dir).f_frsize
            with open(work_dir / "ballast", "wb") as handle:
                os.posix_fallocate(handle.fileno(), 0, free - self.leave_bytes)
        # No worker saves before the disk is full.
        if self.train_config.is_distributed:
            torch.distributed.barrier()

    def post_batch(self, step: int, epoch: int, batch_loss: float, batch_outputs: Any) -> None:
        if step == self.step:
            self._fill()

    def post_train_loop(self, step: int, epoch: int) -> None:
        if self.step is None:
            self._fill()


@TrainCallback.register("test::kill_once")
class KillOnce(TrainCallback):
    """
    Kills every worker with SIGKILL before training step ``step`` (0-based), as ``kill -9`` of a
    run between two checkpoints would, once: a marker file in the work directory remembers it, so
    that re-running the same config resumes and finishes.
    """

    def __init__(self, *args: Any, step: int = 7, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step = step
        # Decided before training, so that worker 0 writing the marker cannot change worker 1's mind.
        self.marker = self.train_config.work_dir / "killed_once"
        self.kill = not self.marker.exists()

    def pre_batch(self, step: int, epoch: int, batch: Any) -> None:
        if step == self.step and self.kill:
            if self.is_local_main_process:
                self.marker.touch()
            # No worker dies before the marker is written; none is inside a collective after this.
            torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


@Model.register("test::dropout_regressor")
class DropoutRegressor(Model):
    """The toy regressor with dropout between blocks: its training draws from torch's generator."""

    def __init__(self, in_features: int = 8, width: int = 32, num_blocks: int = 3, p: float = 0.2) -> None:
        super().__init__()
        self.input = torch.nn.Linear(in_features, width)
        self.blocks = torch.nn.Sequential(
            *[
                torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Dropout(p))
                for _ in range(num_blocks)
            ]
        )
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        prediction = self.head(self.blocks(torch.relu(self.input(x)))).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(prediction, y)}


@TrainCallback.register("test::freeze_worker")
class FreezeWorker(TrainCallback):
    """Stops one worker's process (SIGSTOP) after a step: a worker that hangs without dying."""

    def __init__(self, *args: Any, worker: int = 1, step: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker, self.step = worker, step

    def post_batch(self, step: int, epoch: int, batch_loss: float, batch_outputs: Any) -> None:
        if self.train_config.worker_id == self.worker and step == self.step:
            (self.train_config.work_dir / f"frozen_pid_{os.getpid()}").touch()
            os.kill(os.getpid(), signal.SIGSTOP)


@Model.register("my_model")
class MyModel(Model):
    """
    The README's ``my_model``: a model whose layers are ``transformer.h.<i>``, as the README's
    ``modules_to_wrap`` pattern expects, on the toy regression data (``x``, ``y``).
    """

    def __init__(self, in_features: int = 8, width: int = 32, num_layers: int = 3) -> None:
        super().__init__()
        self.input = torch.nn.Linear(in_features, width)
        self.transformer = torch.nn.Module()
        self.transformer.h = torch.nn.ModuleList(  # type: ignore[assignment]
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(num_layers)
        )
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        hidden = self.input(x)
        for layer in self.transformer.h:  # type: ignore[union-attr]
            hidden = layer(hidden)
        return {"loss": torch.nn.functional.mse_loss(self.head(hidden).squeeze(-1), y)}


@Model.register("test::partly_frozen_regressor")
class PartlyFrozenRegressor(ToyRegressor):
    """The toy regressor with the submodules named in ``frozen`` frozen (``requires_grad=False``)."""

    def __init__(
        self, in_features: int = 8, width: int = 32, num_blocks: int = 4, frozen: Sequence[str] = ()
    ) -> None:
        super().__init__(in_features=in_features, width=width, num_blocks=num_blocks)
        for name in frozen:
            self.get_submodule(name).requires_grad_(False)


@Model.register("test::tied_lm")
class TiedLM(Model):
    """
    A tiny causal language model whose output head shares the token embedding's weight (as GPT-2's
    and Llama's tied heads do): ``num_blocks`` residual blocks between them.
    """

    def __init__(self, vocab_size: int = 64, width: int = 32, num_blocks: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.GELU())
            for _ in range(num_blocks)
        )
        self.head = torch.nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
        hidden = self.embed(tokens[:, :-1])
        for block in self.blocks:
            hidden = hidden + block(hidden)
        logits = self.head(hidden)
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())}


@Step.register("test::token_data")
class TokenData(Step):
    """Random token sequences (``tokens``) with a learnable pattern: ``train`` and ``validation`` splits."""

    DETERMINISTIC = True
    CACHEABLE = True

    def run(  # type: ignore[override]
        self,
        vocab_size: int = 64,
        length: int = 16,
        train_size: int = 256,
        validation_size: int = 64,
        seed: int = 0,
    ) -> DatasetDict:
        generator = torch.Generator().manual_seed(seed)

        def make(size: int) -> list:
            start = torch.randint(vocab_size, (size, 1), generator=generator)
            stride = torch.randint(1, 4, (size, 1), generator=generator)
            tokens = (start + stride * torch.arange(length)) % vocab_size
            return [{"tokens": tokens[i]} for i in range(size)]

        return DatasetDict(splits={"train": make(train_size), "validation": make(validation_size)})


@Step.register("test::lm_data")
class LanguageModelData(Step):
    """Random token sequences as a language model's batch (``input_ids``, ``labels``): a ``train`` split."""

    DETERMINISTIC = True
    CACHEABLE = True

    def run(self, vocab_size: int = 64, length: int = 16, size: int = 256, seed: int = 0) -> DatasetDict:  # type: ignore[override]
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(vocab_size, (size, length), generator=generator)
        return DatasetDict(splits={"train": [{"input_ids": t, "labels": t} for t in tokens]})


@Model.register("test::peft_lora")
def peft_lora(pretrained: str, r: int = 4, target_modules: Sequence[str] = ("q_proj", "v_proj")) -> Model:
    """
    A user's own LoRA constructor, as written without this package's help: peft's LoRA adapters on
    ``transformers``' ``from_pretrained`` model (dropout off, so that runs compare exactly).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(pretrained, attention_dropout=0.0)
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(target_modules))
    return get_peft_model(base, config)  # type: ignore[no-any-return]


@Model.register("test::llama_frozen_below")
def llama_frozen_below(pretrained: str, layers: int) -> Model:
    """
    Partial fine-tuning by hand: a pretrained Llama with its embeddings (tied to its head) and its
    first ``layers`` decoder layers frozen.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pretrained, attention_dropout=0.0)
    model.model.embed_tokens.requires_grad_(False)
    for layer in model.model.layers[:layers]:
        layer.requires_grad_(False)
    return model  # type: ignore[no-any-return]


@Model.register("test::skips_a_block_on_worker_1")
class SkipsABlockOnWorker1(Model):
    """The toy regressor whose forward skips its second block on worker 1 only (a data-dependent branch)."""

    def __init__(self) -> None:
        super().__init__()
        from examples.toy.components import ToyRegressor

        self.inner = ToyRegressor(in_features=8, width=16, num_blocks=3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        import torch.distributed as dist

        hidden = self.inner.input(x)
        for index, block in enumerate(self.inner.blocks):
            if index == 1 and dist.get_rank() == 1:
                continue
            hidden = block(hidden)
        return {"loss": self.inner.loss(self.inner.head(hidden).squeeze(-1), y)}


@Model.register("test::batchnorm_regressor")
class BatchNormRegressor(Model):
    """The toy regressor with a BatchNorm after its input layer: buffers that differ per worker."""

    def __init__(self) -> None:
        super().__init__()
        from examples.toy.components import ToyRegressor

        self.inner = ToyRegressor(in_features=8, width=16, num_blocks=2)
        self.norm = torch.nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        hidden = self.inner.blocks(self.norm(self.inner.input(x)))
        return {"loss": self.inner.loss(self.inner.head(hidden).squeeze(-1), y)}


@TrainCallback.register("test::record_buffers")
class RecordBuffers(TrainCallback):
    """Writes each worker's buffers (plain names) after training to ``buffers_worker{N}.pt``."""

    def post_train_loop(self, step: int, epoch: int) -> None:
        wrappers = {"_fsdp_wrapped_module", "_fpw_module", "_checkpoint_wrapped_module"}
        buffers = {
            ".".join(part for part in name.split(".") if part not in wrappers): b.detach().cpu().clone()
            for name, b in self.training_engine.model.named_buffers()
        }
        torch.save(buffers, self.train_config.work_dir / f"buffers_worker{self.train_config.worker_id}.pt")


@TrainCallback.register("test::kill_once_after_validation")
class KillOnceAfterValidation(TrainCallback):
    """
    Kills every worker with SIGKILL in the ``post_val_loop`` of step ``step`` (0-based), once:
    Tango calls it after that step's checkpoint is complete, and, listed before the metrics log,
    this callback runs before the log's hook. A marker file in the work directory remembers it.
    """

    def __init__(self, *args: Any, step: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step = step
        self.marker = self.train_config.work_dir / "killed_once"
        self.kill = not self.marker.exists()

    def post_val_loop(self, step: int, epoch: int, val_metric: float, best_val_metric: float) -> None:
        if step == self.step and self.kill:
            if self.is_local_main_process:
                self.marker.touch()
            torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


class _TiedPair(torch.nn.Module):
    """Two linear layers of one weight, tied after both are built (``b.weight = a.weight``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


@Model.register("test::tied_in_block")
class TiedInBlock(Model):
    """The toy regressor whose blocks each hold a weight tied inside the block (one FSDP unit each)."""

    def __init__(self, in_features: int = 8, width: int = 16, num_blocks: int = 2) -> None:
        super().__init__()
        self.input = torch.nn.Linear(in_features, width)
        self.blocks = torch.nn.Sequential(*[_TiedPair(width) for _ in range(num_blocks)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        prediction = self.head(self.blocks(torch.relu(self.input(x)))).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(prediction, y)}
