"""
:class:`FairScaleTrainingEngine`: Tango's ``torch::train`` with the model sharded by FairScale's
Fully Sharded Data Parallel (ZeRO-3) instead of replicated by DDP.
"""

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.optim.grad_scaler import ShardedGradScaler
from tango.common import Lazy, Tqdm
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import (
    LRScheduler,
    Model,
    Optimizer,
    TorchTrainingEngine,
    TrainConfig,
)

from . import checkpointing
from .config import FSDPConfig
from .cpu.memory import limit_cpu_heap_growth
from .devices import devices_are_cpu, worker_computes_on_cpu
from .materialize import has_meta_parameters, materialize_module, parameters_on_meta
from .options import amp_dtype, check_engine_options
from .registry import register_training_engine

logger = logging.getLogger(__name__)


@register_training_engine("fairscale")
class FairScaleTrainingEngine(TorchTrainingEngine):
    """
    A :class:`~tango.integrations.torch.TrainingEngine` that shards parameters, gradients and
    optimizer state across the workers of :class:`~tango.integrations.torch.TorchTrainStep`
    with FairScale's :class:`~fairscale.nn.FullyShardedDataParallel`. Runs on GPUs (NCCL) and
    on CPU workers (gloo).

    .. tip::
        Registered as a :class:`~tango.integrations.torch.TrainingEngine` under the name
        "fairscale".

    .. tip::
        Wrap the model's layers as separate FSDP units with
        :func:`~tango_fairscale.with_wrapped_modules`: then only one layer's full parameters
        are gathered at a time, which is where the memory savings come from.

    .. important::
        Only the parameters listed below belong in a configuration file; Tango's
        ``torch::train`` step passes the others.

    .. warning::
        Needs distributed training: ``device_count`` of 2 or more in the ``torch::train`` step.

    :param amp:
        Use automatic mixed precision. With float16 the gradients are scaled by FairScale's
        :class:`~fairscale.optim.grad_scaler.ShardedGradScaler`; bfloat16 needs no scaling.
    :param max_grad_norm:
        If set, clip the gradients to this total norm, computed across all shards.
    :param amp_use_bfloat16:
        Use bfloat16 rather than float16 under AMP. Default: bfloat16 on CPU, float16 on GPU.
    :param fsdp_config:
        The FSDP options of the root unit (see :class:`~tango_fairscale.FSDPConfig`).
        Default: FairScale's defaults.
    :param resume_from_checkpoint:
        A complete checkpoint directory (``.../work/checkpoint_state_step<N>``), or the work
        directory of a ``torch::train`` step (its latest checkpoint is used), to start from when
        this step has no checkpoint of its own. It may come from a run with a different number
        of workers: parameters and optimizer state are resharded on load. Model, optimizer,
        LR scheduler, grad scaler and the step count are restored.
    :param init_on_meta:
        Build the model with its parameters on the ``meta`` device (no memory) and allocate
        each FSDP unit's parameters only right before sharding it, so that no worker ever holds
        the whole model: the peak is the worker's shards plus the largest unit. Parameters are
        initialised by each module's ``reset_parameters()`` and, for Hugging Face models, the
        model's ``_init_weights``: the same on every worker, but not the same random draws as an
        eager build. A parameter that neither initialiser covers is an error naming it.
    """

    def __init__(
        self,
        train_config: TrainConfig,
        model: Union[Model, Lazy[Model]],
        optimizer: Lazy[Optimizer],
        *,
        lr_scheduler: Optional[Lazy[LRScheduler]] = None,
        amp: bool = False,
        max_grad_norm: Optional[float] = None,
        amp_use_bfloat16: Optional[bool] = None,
        fsdp_config: Optional[FSDPConfig] = None,
        resume_from_checkpoint: Optional[str] = None,
        init_on_meta: bool = False,
    ) -> None:
        on_cpu = devices_are_cpu(train_config.devices)
        self.fsdp_config = fsdp_config or FSDPConfig()
        check_engine_options(
            distributed=train_config.is_distributed,
            device_count=len(train_config.devices or [None]),
            on_cpu=on_cpu,
            amp=amp,
            amp_use_bfloat16=amp_use_bfloat16,
            max_grad_norm=max_grad_norm,
            fsdp_config=self.fsdp_config,
            # Once per run, not once per worker.
            warn=train_config.worker_id == 0,
        )
        self.init_on_meta = init_on_meta
        if on_cpu:
            limit_cpu_heap_growth()
        # Tango's engine would build a torch.cuda.amp.GradScaler whenever amp is on (deprecated,
        # and wrong for sharded gradients): construct it without AMP, then set AMP up here.
        super().__init__(
            train_config,
            model,
            optimizer,
            lr_scheduler=lr_scheduler,
            amp=False,
            max_grad_norm=max_grad_norm,
            amp_use_bfloat16=amp_use_bfloat16,
        )
        self.amp = amp
        self.amp_dtype = amp_dtype(on_cpu, amp_use_bfloat16)
        # Loss scaling exists for float16's narrow range; bfloat16 has float32's.
        self.grad_scaler = ShardedGradScaler() if amp and self.amp_dtype == torch.float16 else None
        if resume_from_checkpoint is not None:
            self._link_resume_checkpoint(Path(resume_from_checkpoint))

    def _link_resume_checkpoint(self, source: Path) -> None:
        # Tango resumes from `checkpoint_state_latest` in the step's work directory when it
        # exists, right after constructing the engine: pointing that link at the requested
        # checkpoint makes Tango restore the step count and data position as for any resume.
        config = self.train_config
        has_own_checkpoint = config.state_path.exists()
        # Every worker looks before worker 0 creates the link, so that all take the same branch
        # (and meet at the same barriers).
        dist.barrier()
        if has_own_checkpoint:
            logger.info("Resuming from this step's own checkpoint; ignoring resume_from_checkpoint")
            return
        try:
            source = checkpointing.resolve_checkpoint(source)
        except checkpointing.CheckpointError as error:
            raise ConfigurationError(f"resume_from_checkpoint: {error}") from None
        if config.worker_id == 0:
            config.work_dir.mkdir(parents=True, exist_ok=True)
            if config.state_path.is_symlink():  # dangling: its target was removed
                config.state_path.unlink()
            config.state_path.symlink_to(source, target_is_directory=True)
        dist.barrier()

    def forward_train(
        self, micro_batch: Dict[str, Any], micro_batch_idx: int, num_micro_batches: int
    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        try:
            return super().forward_train(micro_batch, micro_batch_idx, num_micro_batches)
        except KeyError as error:
            if error.args != ("loss",):
                raise
            raise ConfigurationError(
                "The model's forward() returned no 'loss': torch::train needs forward() to return "
                'a dict with the training loss under "loss" (a scalar tensor).'
            ) from None

    @property
    def computes_on_cpu(self) -> bool:
        """Whether the FSDP units of this engine compute on CPU workers."""
        return worker_computes_on_cpu()

    def _construct_model(self, model: Union[Model, Lazy[Model]]) -> Model:
        if isinstance(model, Lazy):
            if self.init_on_meta:
                with parameters_on_meta():
                    model = model.construct()
            else:
                model = model.construct()
        if has_meta_parameters(model):
            # What with_wrapped_modules did not already allocate unit by unit: the root's own.
            # FairScale expects offloaded parameters to start on the CPU.
            device = (
                torch.device("cpu")
                if self.fsdp_config.move_params_to_cpu
                else self.train_config.worker_local_default_device
            )
            materialize_module(model, device, root=model)
        if not any(True for _ in model.parameters()):
            raise ConfigurationError(
                f"The model ({type(model).__name__}) has no parameters: there is nothing to shard or train."
            )
        if not worker_computes_on_cpu() and not self.fsdp_config.move_params_to_cpu:
            model.to(self.train_config.worker_local_default_device)
        self.module_aliases = checkpointing.module_aliases(model)
        return self.fsdp_config.wrap(model)  # type: ignore[return-value]

    def clip_grad_norm(self) -> None:
        if self.max_grad_norm is None:
            return
        if not self.computes_on_cpu:
            self.model.clip_grad_norm_(self.max_grad_norm)  # type: ignore[operator]
            return
        # FairScale's clip_grad_norm_ moves the norm to CUDA; on CPU workers compute the same
        # thing here: every worker holds a disjoint shard (padding is zero), so the squared
        # norms add up across workers.
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local = torch.zeros((), dtype=torch.float32)
        for grad in grads:
            local += grad.detach().float().pow(2).sum()
        dist.all_reduce(local)
        total_norm = local.sqrt()
        clip_coef = (self.max_grad_norm / (total_norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.detach().mul_(clip_coef.to(grad.dtype))

    def get_model_state(self) -> Dict[str, Any]:
        fsdp: FSDP = self.model  # type: ignore[assignment]
        return {"weights": fsdp.local_state_dict(), "metadata": fsdp.local_metadata_dict()}

    def load_model_state(self, state_dict: Dict[str, Any]) -> None:
        fsdp: FSDP = self.model  # type: ignore[assignment]
        fsdp.load_local_state_dict(state_dict["weights"])

    def _optimizer_keys(self) -> List[str]:
        """The local state-dict key of each parameter, in the optimizer's state order."""
        names = {id(p): checkpointing.clean_parameter_name(n) for n, p in self.model.named_parameters()}
        return [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    def save_checkpoint(self, checkpoint_dir: Path, client_state: Dict[str, Any]) -> None:
        checkpoint_dir = Path(checkpoint_dir)
        worker = self.train_config.worker_id
        if worker == 0:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            # The directory may hold an older save of the same step (a run that was resumed
            # from before it): it stops counting before any file in it changes.
            (checkpoint_dir / checkpointing.MARKER).unlink(missing_ok=True)
        dist.barrier()
        states: Dict[str, Any] = {
            "model": {
                **self.get_model_state(),
                "optimizer_keys": self._optimizer_keys(),
                "module_aliases": self.module_aliases,
            },
            "optimizer": self.optimizer.state_dict(),
            "trainer": client_state,
        }
        if self.lr_scheduler is not None:
            states["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.grad_scaler is not None:
            states["grad_scaler"] = self.grad_scaler.state_dict()
        for name, state in Tqdm.tqdm(
            states.items(),
            desc=f"Saving checkpoint {checkpoint_dir.name}",
            leave=False,
            disable=worker != 0,
        ):
            self._write_state(name, state, checkpointing.worker_file(checkpoint_dir, worker, name))
        # Only once every worker has its files on disk does the checkpoint count.
        dist.barrier()
        if worker == 0:
            checkpointing.write_marker(
                checkpoint_dir,
                world_size=self.train_config.world_size,
                extra={"training_steps": client_state.get("training_steps"), "files": sorted(states)},
            )
        dist.barrier()

    def _write_state(self, name: str, state: Any, path: Path) -> None:
        """Write one of this worker's checkpoint files (``name`` is ``"model"``, ``"optimizer"``, ...)."""
        checkpointing.atomic_save(state, path)

    def load_checkpoint(self, checkpoint_dir: Path) -> Dict[str, Any]:
        checkpoint_dir = Path(checkpoint_dir).resolve()
        marker = checkpointing.require_complete(checkpoint_dir)
        saved_world_size = marker["world_size"]
        worker = self.train_config.worker_id
        # Replicated state (scheduler, scaler, trainer) is the same in every worker's file;
        # a worker that did not exist in the saved run reads worker 0's.
        source_worker = worker if worker < saved_world_size else 0

        def load(name: str, from_worker: int = source_worker, mmap: bool = False) -> Any:
            path = checkpointing.worker_file(checkpoint_dir, from_worker, name)
            return checkpointing.safe_load(path, mmap=mmap)

        fsdp: FSDP = self.model  # type: ignore[assignment]
        local_weights = fsdp.local_state_dict()
        own_model = load("model")
        if saved_world_size == self.train_config.world_size and checkpointing.same_shapes(
            own_model["weights"], local_weights
        ):
            self.load_model_state(own_model)
            self.optimizer.load_state_dict(load("optimizer"))
        else:
            logger.info(
                "Resharding checkpoint %s from %d to %d workers",
                checkpoint_dir,
                saved_world_size,
                self.train_config.world_size,
            )
            # Every worker needs a slice of every saved file: mapped, not read whole, so that a
            # host running N workers does not hold N copies of the full model and optimizer.
            model_shards = [load("model", w, mmap=True) for w in range(saved_world_size)]
            optimizer_shards = [load("optimizer", w, mmap=True) for w in range(saved_world_size)]
            fsdp.load_local_state_dict(
                checkpointing.reshard_model_weights(model_shards, local_weights, worker)
            )
            self.optimizer.load_state_dict(
                checkpointing.reshard_optimizer_state(
                    model_shards, optimizer_shards, local_weights, self._optimizer_keys(), worker
                )
            )
        for name, component, fresh in (
            ("lr_scheduler", self.lr_scheduler, "the learning-rate schedule starts from its first step"),
            ("grad_scaler", self.grad_scaler, "the loss scale starts from its initial value"),
        ):
            if component is None:
                continue
            if not checkpointing.worker_file(checkpoint_dir, source_worker, name).is_file():
                # A checkpoint of a run configured without it (resume_from_checkpoint); the
                # marker guarantees that any file the saving run wrote is there.
                logger.warning("Checkpoint %s has no %s state: %s.", checkpoint_dir, name, fresh)
                continue
            component.load_state_dict(load(name))
        trainer_state = load("trainer")
        if self.train_config.work_dir.resolve() not in checkpoint_dir.parents:
            trainer_state = self._trainer_state_from_another_run(trainer_state)
        return trainer_state

    def _trainer_state_from_another_run(self, state: Dict[str, Any]) -> Dict[str, Any]:
        # A checkpoint of another run (resume_from_checkpoint) brings its step count, but its
        # best validation metric was measured on that run's terms and its best checkpoint is not
        # in this work directory: keep Tango from comparing against, or linking to, either.
        state = dict(state)
        for key in list(state):
            if key.startswith(("val_", "best_")):
                state[key] = None
        state["callbacks"] = []
        return state

    def save_complete_weights_from_checkpoint(self, checkpoint_dir: Path, weights_path: Path) -> None:
        logger.info("Consolidating the sharded weights of %s into %s", checkpoint_dir, weights_path)
        shards = checkpointing.load_model_shards(Path(checkpoint_dir).resolve())
        full_state = checkpointing.consolidate_model_state(shards)
        del shards
        checkpointing.atomic_save(full_state, Path(weights_path))
