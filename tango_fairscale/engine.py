"""
:class:`FairScaleTrainingEngine`: Tango's ``torch::train`` with the model sharded across the
workers instead of replicated by DDP. The engine is Tango's adapter: it turns Tango's calls into
calls of one sharding backend (:mod:`tango_fairscale.backends`), chosen by its ``backend`` option,
and holds no branch on which one.
"""

import gc
import logging
import os
import sys
import weakref
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from tango.common import Lazy
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import (
    LRScheduler,
    Model,
    Optimizer,
    TorchTrainingEngine,
    TrainConfig,
)
from tango.integrations.torch.util import move_to_device

from . import checkpointing, compat
from .backends.base import BackendContext, LoadedCheckpoint
from .backends.lookup import backend_class
from .checkpointing import random_state, resume
from .config import FSDPConfig
from .cpu.memory import limit_cpu_heap_growth, long_lived_allocations
from .cpu.threads import apply_threads, choose_threads
from .devices import devices_are_cpu, worker_computes_on_cpu
from .finetune.hf_export import (
    export_hf,
    export_merged_adapter,
    export_peft_adapter,
    hf_model_in,
    source_directory,
    weights_file,
)
from .finetune.lora import peft_model_in
from .launch import HostWorld
from .options import EngineOptions, amp_dtype
from .output_paths import export_hf_path
from .registry import register_training_engine

logger = logging.getLogger(__name__)

#: The options' defaults, written once (:class:`~tango_fairscale.options.EngineOptions`).
_DEFAULTS = EngineOptions()


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
        Needs a process group: through the ``torch::train`` step any ``device_count`` (a step of
        one device gets its one worker spawned with one); built in your own code, a
        ``TrainConfig`` with ``is_distributed=True``.

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
    :param collective_timeout:
        Seconds that any collective (and the start of the process group) may wait for the other
        workers before the run fails with an error, instead of Tango's 30 minutes. A worker that
        dies closes its connections and fails the others' collectives at once; this bounds the
        wait for one that hangs, or a host that disappears without closing them. Raise it when
        one worker legitimately does something much longer than the others between two
        collectives (e.g. writing a very large checkpoint to a slow disk).
    :param backend:
        The FSDP implementation: ``"fairscale"`` (default, FairScale's FSDP with flat per-unit
        shards) or ``"torch"`` (PyTorch's own FSDP2, :func:`torch.distributed.fsdp.fully_shard`,
        each parameter a sharded DTensor, checkpoints through ``torch.distributed.checkpoint``).
        The same ``fsdp_config`` and ``with_wrapped_modules`` options select and configure the
        units; a field the torch backend cannot honour is refused, naming it. A checkpoint is
        resumed by the backend that wrote it. See ``docs/torch-backend.md``.
    :param accumulate_grads_locally:
        With ``grad_accum`` > 1 in the step: keep the gradients of every micro-batch but the last
        of an optimizer step on the worker (FSDP's ``no_sync``) and reduce-scatter once per step,
        instead of once per micro-batch: 1/``grad_accum`` of the gradient traffic. Costs memory:
        until the last micro-batch each worker holds full-size (unsharded) gradients of the whole
        model, as DDP does, instead of its shard of them. The result is the same up to the order
        of floating-point summation. With one worker there is nothing to reduce: no effect.
    :param hybrid_sharding:
        With ``backend: "torch"`` in a launch across hosts: shard each unit's parameters across the
        workers of each host only, and replicate them across hosts (HSDP, a 2-D device mesh). The
        all-gathers of every forward and backward pass then stay within a host; across hosts go
        the gradients only (one all-reduce per unit), at the cost of each host holding a whole
        copy of the sharded state: parameters, gradients and optimizer state take ``hosts`` times
        the memory per worker of full sharding. The result is the same up to the order of
        floating-point summation. On one host it changes nothing.
    :param export_hf:
        A directory to write at the end of training, after ``weights.pt``, that ``transformers``
        loads with ``from_pretrained``: ``config.json``, the weights as safetensors (shards and
        their index beyond 5 GB), and the tokenizer files of the directory the model was loaded
        from, if it had them. A relative path is relative to the step's work directory. Needs a
        ``transformers`` model in the step's model (e.g. ``"fairscale::from_pretrained"``). Written
        one tensor at a time from ``weights.pt``, atomically (by each host's first worker). It
        replaces only an earlier export; any other existing path, and the workspace, the work
        directory and what the run writes there, are refused in pre-flight
        (:mod:`tango_fairscale.output_paths`).
    :param export_hf_merged:
        For a peft (LoRA) model, whose ``export_hf`` is the adapter directory: also write the
        adapters merged into the base model (peft's ``merge_and_unload``) as a directory
        ``AutoModelForCausalLM.from_pretrained`` loads, here (relative: to the step's work
        directory), with the same rules as ``export_hf``. The merge holds the whole model in the
        writing worker's memory. Needs ``export_hf``.
    :param verify_checkpoints:
        Check the SHA-256 of every checkpoint file against the marker before resuming from it
        (re-reading each file once: on GPT-2 small's 0.7 GiB per worker, about as long as loading
        it). ``false`` checks sizes, headers and shapes only, for checkpoints too large to re-read.
    :param cpu_threads_per_worker:
        On CPU workers: the threads torch computes with in each worker (its intra-op threads). By
        default, ``OMP_NUM_THREADS`` where that is set, else the worker's share of the host's
        cores: the cores the process may run on (its CPU affinity) divided by the workers on the
        host, at least 1. torch's own default, every core in every worker, makes the workers'
        threads compete for the same cores (see :mod:`tango_fairscale.cpu.threads`). Set it above
        the share when the workers leave cores idle (e.g. while waiting on collectives over a slow
        network). GPU workers are left alone. The metrics log's run line records the number and
        where it came from.
    :param param_dtype:
        The dtype the parameters are held and updated in (the master weights, and so the optimizer
        state and the gradients reduced into them). Unset (the default): float32, whatever the
        model was built or loaded in: a checkpoint saved in bfloat16 or float16 (as hub
        checkpoints are; transformers 5 loads them in their own dtype) is upcast unit by unit
        right before each unit is sharded. ``fsdp_config.mixed_precision`` then gathers, computes
        and reduces in bfloat16 while updates keep float32's resolution. ``"bfloat16"`` or
        ``"float16"`` (``backend: "torch"`` only) trains in that dtype purely: half of float32's
        memory for parameters, gradients and optimizer state, but an update smaller than about
        1/128 (bfloat16) of a weight is rounded away; the run says so in one line.
        ``weights.pt`` and checkpoints hold the parameters in this dtype; ``export_hf`` writes each
        tensor in the dtype of the pretrained checkpoint it was loaded from (see ``docs/precision.md``).
    """

    def __init__(
        self,
        train_config: TrainConfig,
        model: Union[Model, Lazy[Model]],
        optimizer: Lazy[Optimizer],
        *,
        lr_scheduler: Optional[Lazy[LRScheduler]] = None,
        amp: bool = _DEFAULTS.amp,
        max_grad_norm: Optional[float] = _DEFAULTS.max_grad_norm,
        amp_use_bfloat16: Optional[bool] = _DEFAULTS.amp_use_bfloat16,
        fsdp_config: Optional[FSDPConfig] = _DEFAULTS.fsdp_config,
        resume_from_checkpoint: Optional[str] = _DEFAULTS.resume_from_checkpoint,
        init_on_meta: bool = _DEFAULTS.init_on_meta,
        collective_timeout: float = _DEFAULTS.collective_timeout,
        verify_checkpoints: bool = _DEFAULTS.verify_checkpoints,
        backend: str = _DEFAULTS.backend,
        accumulate_grads_locally: bool = _DEFAULTS.accumulate_grads_locally,
        hybrid_sharding: bool = _DEFAULTS.hybrid_sharding,
        export_hf: Optional[str] = _DEFAULTS.export_hf,
        export_hf_merged: Optional[str] = _DEFAULTS.export_hf_merged,
        cpu_threads_per_worker: Optional[int] = _DEFAULTS.cpu_threads_per_worker,
        param_dtype: Optional[str] = _DEFAULTS.param_dtype,
    ) -> None:
        on_cpu = devices_are_cpu(train_config.devices)
        self.options = EngineOptions(
            amp=amp,
            max_grad_norm=max_grad_norm,
            amp_use_bfloat16=amp_use_bfloat16,
            fsdp_config=fsdp_config,
            resume_from_checkpoint=resume_from_checkpoint,
            init_on_meta=init_on_meta,
            collective_timeout=collective_timeout,
            verify_checkpoints=verify_checkpoints,
            backend=backend,
            accumulate_grads_locally=accumulate_grads_locally,
            hybrid_sharding=hybrid_sharding,
            export_hf=export_hf,
            export_hf_merged=export_hf_merged,
            cpu_threads_per_worker=cpu_threads_per_worker,
            param_dtype=param_dtype,
        )
        self.fsdp_config = fsdp_config or FSDPConfig()
        #: The hosts of a launch across hosts (``None`` on one host): see tango_fairscale.launch.
        self.hosts = HostWorld.from_environment(os.environ) if train_config.is_distributed else None
        self.options.check(
            distributed=train_config.is_distributed,
            device_count=len(train_config.devices or [None]),
            on_cpu=on_cpu,
            hosts=self.hosts.num_nodes if self.hosts is not None else 1,
            # Once per run, not once per worker.
            warn=train_config.worker_id == 0,
        )
        self.backend = backend
        #: The sharding backend every model, gradient and checkpoint operation goes through.
        self.sharding = backend_class(backend)(
            BackendContext(
                train_config=train_config,
                fsdp_config=self.fsdp_config,
                init_on_meta=init_on_meta,
                hybrid_sharding=hybrid_sharding,
                verify_checkpoints=verify_checkpoints,
                hosts=self.hosts,
                on_cpu=on_cpu,
                precision=self.options.precision,
            )
        )
        self.accumulate_grads_locally = accumulate_grads_locally
        #: Whether the backward pass of the current micro-batch reduces the gradients.
        self._sync_gradients = True
        self.init_on_meta = init_on_meta
        self.verify_checkpoints = verify_checkpoints
        #: Generator states of the checkpoint resumed from, for RestoreRandomState.
        self.loaded_random_state: Optional[Dict[str, Any]] = None
        #: Called with Tango's trainer state before each checkpoint is saved: the step telemetry
        #: writes a validated step's line then, which Tango would have it write only after the save.
        self.before_checkpoint: List[Callable[[Dict[str, Any]], None]] = []
        self.hybrid_sharding = hybrid_sharding
        if on_cpu and train_config.is_distributed:
            # Before the model is built: torch's default of every core in every worker makes the
            # host's workers compete for its cores.
            workers_on_host = (
                self.hosts.local_world_size if self.hosts is not None else train_config.world_size
            )
            apply_threads(choose_threads(cpu_threads_per_worker, os.environ, workers_on_host))
        #: What the engine holds in the process for its life (the malloc threshold), ended by
        #: :meth:`close`, or when the engine is collected.
        self._process_settings = ExitStack()
        weakref.finalize(self, self._process_settings.close)
        if on_cpu:
            # The backend's threshold for what a step allocates and frees; the model's shards and
            # what a checkpoint loads outlive it (cpu/memory.py). Process-wide: restored by close().
            self._process_settings.enter_context(limit_cpu_heap_growth(self.sharding.cpu_mmap_threshold))
        if train_config.is_distributed:
            _start_process_group(train_config, on_cpu, collective_timeout)
        # Tango's engine would build a torch.cuda.amp.GradScaler whenever amp is on (deprecated,
        # and wrong for sharded gradients): construct it without AMP, then set AMP up here.
        with compat.process_group_already_started(train_config), long_lived_allocations():
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
        self.grad_scaler: Any = self.sharding.make_grad_scaler(self.amp_dtype) if amp else None
        if export_hf is not None and hf_model_in(self.model) is None:
            # Said before training, not after it.
            raise _no_hf_model_error()
        if export_hf_merged is not None and peft_model_in(self.model) is None:
            # Pre-flight says it for a model it can build on meta; this, for any other.
            raise _no_adapters_error()
        has_own_checkpoint = resume.find_own_checkpoint(train_config, self.hosts)
        if resume_from_checkpoint is not None:
            resume.link_resume_checkpoint(train_config, Path(resume_from_checkpoint), has_own_checkpoint)

    def forward_train(
        self, micro_batch: Dict[str, Any], micro_batch_idx: int, num_micro_batches: int
    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        # Tango calls backward() right after, with the loss only: decide here for it. With one
        # worker there is no traffic to save, and FairScale's no_sync under mixed precision freed
        # the low-precision parameters that the root unit, still "gathered", used in the next
        # micro-batch's forward (an out-of-bounds storage error on a single GPU).
        self._sync_gradients = (
            not self.accumulate_grads_locally
            or self.train_config.world_size == 1
            or micro_batch_idx == num_micro_batches - 1
        )
        try:
            return super().forward_train(micro_batch, micro_batch_idx, num_micro_batches)
        except KeyError as error:
            if error.args != ("loss",):
                raise
            raise ConfigurationError(
                "The model's forward() returned no 'loss': torch::train needs forward() to return "
                'a dict with the training loss under "loss" (a scalar tensor).'
            ) from None

    def forward_eval(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        # Tango's, under no_grad instead of inference_mode: FSDP makes some of its state in the
        # first forward pass, and a tensor made under inference_mode never joins autograd again. A
        # validation before the first training step (fairscale::validate_first) made FairScale's
        # units fail their first training forward.
        batch = move_to_device(batch, self.device)
        with torch.autocast(self.train_config.device_type, enabled=self.amp, dtype=self.amp_dtype):
            with torch.no_grad():
                return self.model(**batch)  # type: ignore[no-any-return]

    def backward(self, loss: torch.Tensor) -> None:
        with ExitStack() as stack:
            if not self._sync_gradients:
                # Both backends read the flag in their post-backward hooks only, so it is enough
                # to hold it over backward; the first backward outside reduces the sum.
                stack.enter_context(self._no_sync())
            super().backward(loss)

    def _no_sync(self) -> Any:
        return self.sharding.no_sync(self.model)

    @property
    def computes_on_cpu(self) -> bool:
        """Whether the FSDP units of this engine compute on CPU workers."""
        return worker_computes_on_cpu()

    def _construct_model(self, model: Union[Model, Lazy[Model]]) -> Model:
        built = self.sharding.build(model)
        name_causal_lm_loss(built)
        return built  # type: ignore[return-value]

    def clip_grad_norm(self) -> None:
        if self.max_grad_norm is not None:
            self.sharding.clip_grad_norm_(self.model, self.max_grad_norm)

    def _replicated_states(self) -> Dict[str, Any]:
        """The LR scheduler's and loss scaler's states, the same on every worker (when present)."""
        states: Dict[str, Any] = {}
        if self.lr_scheduler is not None:
            states["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.grad_scaler is not None:
            states["grad_scaler"] = self.grad_scaler.state_dict()
        return states

    def save_checkpoint(self, checkpoint_dir: Path, client_state: Dict[str, Any]) -> None:
        for listener in self.before_checkpoint:
            listener(client_state)
        states = {
            "trainer": client_state,
            **self._replicated_states(),
            # So that a resumed run draws the dropout masks an uninterrupted one would.
            "random_state": random_state.capture(),
        }
        self.sharding.save(
            Path(checkpoint_dir), self.model, self.optimizer, states, client_state.get("training_steps")
        )

    def load_checkpoint(self, checkpoint_dir: Path) -> Dict[str, Any]:
        checkpoint_dir = Path(checkpoint_dir).resolve()
        resume.check_own(checkpoint_dir, checkpointing.read_marker(checkpoint_dir) or {}, self.train_config)
        with long_lived_allocations():  # what it allocates (the optimizer state) lives for the run
            loaded = self.sharding.load(checkpoint_dir, self.model, self.optimizer)
        return self._restore_the_rest(checkpoint_dir, loaded)

    def _restore_the_rest(self, checkpoint_dir: Path, loaded: LoadedCheckpoint) -> Dict[str, Any]:
        """After the model and optimizer: scheduler, loss scaler, random state. Returns the trainer state."""
        for name, component, fresh in (
            ("lr_scheduler", self.lr_scheduler, "the learning-rate schedule starts from its first step"),
            ("grad_scaler", self.grad_scaler, "the loss scale starts from its initial value"),
        ):
            if component is None:
                continue
            saved_state = loaded.states.get(name)
            if saved_state is None:
                # A checkpoint of a run configured without it (resume_from_checkpoint); the
                # marker guarantees that any file the saving run wrote is there.
                logger.warning("Checkpoint %s has no %s state: %s.", checkpoint_dir, name, fresh)
                continue
            component.load_state_dict(saved_state)
        # Restored right before the training loop (RestoreRandomState): see there for why. On
        # another number of workers the saved generators do not map onto the new workers, which
        # keep the states seeded from the step's seed.
        self.loaded_random_state = loaded.random_state
        if loaded.resharded:
            logger.info("Resharded resume: random generators continue from the seed, not the saved states")
        trainer_state: Dict[str, Any] = loaded.states["trainer"]
        if self.train_config.work_dir.resolve() not in checkpoint_dir.parents:
            trainer_state = resume.trainer_state_from_another_run(trainer_state)  # type: ignore[assignment]
        return trainer_state

    def _release_training_state(self) -> None:
        """
        Drop the optimizer state and the gradients, before ``weights.pt`` is written. Tango calls
        :meth:`save_complete_weights_from_checkpoint` once, after the training loop and the last
        checkpoint, as the last thing a worker does; the memory the optimizer's moments took
        (two thirds of a worker's model state under AdamW) is then free for consolidating, which
        otherwise needed room beside the whole training state.
        """
        self.optimizer.state.clear()
        for parameter in self.model.parameters():
            parameter.grad = None
        # And what training left in reference cycles (autograd graphs, checkpoint planners).
        gc.collect()

    def close(self) -> None:
        """
        Give back what the engine set for the whole process: the malloc threshold of CPU workers
        (:func:`~tango_fairscale.cpu.memory.limit_cpu_heap_growth`, restored as far as glibc
        allows). Idempotent; also done when the engine is collected. Tango's worker never calls
        it: a spawned worker ends with the process (:mod:`tango_fairscale.launch.teardown`).
        """
        self._process_settings.close()

    def save_complete_weights_from_checkpoint(self, checkpoint_dir: Path, weights_path: Path) -> None:
        # Written one tensor at a time from shards that are mapped, not read into private memory,
        # after the optimizer state is dropped: the whole model beside the training state made
        # the end of a run need more memory than training did.
        logger.info("Consolidating the sharded weights of %s into %s", checkpoint_dir, weights_path)
        self._release_training_state()
        self.sharding.write_weights(Path(checkpoint_dir).resolve(), Path(weights_path))
        if self.options.export_hf is not None:
            self._export_hf(Path(weights_path), Path(self.options.export_hf))

    def _export_hf(self, weights_path: Path, directory: Path) -> None:
        hf_model = hf_model_in(self.model)
        if hf_model is None:
            raise _no_hf_model_error()
        # The path pre-flight checked (output_paths: what an export may replace).
        directory = export_hf_path(str(directory), self.train_config.work_dir)
        peft_model = peft_model_in(self.model)
        if peft_model is not None:
            # A LoRA fine-tune: the adapter is what trained, and what peft loads onto the base.
            logger.info("Writing %s for peft's PeftModel.from_pretrained", directory)
            export_peft_adapter(
                weights_file(weights_path),
                directory,
                peft_model,
                base_directory=source_directory(hf_model.config),
                work_dir=self.train_config.work_dir,
                label="training_engine.export_hf",
            )
            if self.options.export_hf_merged is not None:
                merged = export_hf_path(self.options.export_hf_merged, self.train_config.work_dir)
                logger.info("Writing %s: the adapters merged into the base, for from_pretrained", merged)
                export_merged_adapter(
                    directory,
                    merged,
                    work_dir=self.train_config.work_dir,
                    label="training_engine.export_hf_merged",
                )
            return
        logger.info("Writing %s for transformers' from_pretrained", directory)
        export_hf(
            weights_file(weights_path),
            directory,
            hf_model.config,
            model_class=type(hf_model),
            tokenizer_from=source_directory(hf_model.config),
            work_dir=self.train_config.work_dir,
            label="training_engine.export_hf",
        )


def name_causal_lm_loss(model: torch.nn.Module) -> None:
    """
    transformers (4.57) picks a model's loss from its class name, and the names of GPT-2's
    ``GPT2LMHeadModel`` and the other ``...LMHeadModel`` causal language models match none: the
    first forward pass with labels then warns, once in every worker, "`loss_type=None` was set in
    the config but it is unrecognized. Using the default loss: `ForCausalLMLoss`", which is the
    right loss for them. For the classes transformers' ``AutoModelForCausalLM`` maps to, that
    default is named here, so the loss is the same and the warning, about nothing the config
    says, is gone. Other models are left alone: for them the warning can mean a wrong loss.
    """
    if "transformers" not in sys.modules:  # no transformers model, and seconds saved importing it
        return
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lms = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    for module in model.modules():
        if (
            isinstance(module, PreTrainedModel)
            and type(module).__name__ in causal_lms
            and getattr(module, "loss_type", "") is None
        ):
            module.loss_type = "ForCausalLM"


def _no_hf_model_error() -> ConfigurationError:
    return ConfigurationError(
        "training_engine.export_hf: the step's model holds no transformers model to export (build it "
        "with fairscale::from_pretrained or a transformers class), or remove export_hf."
    )


def _no_adapters_error() -> ConfigurationError:
    # The merge folds LoRA adapters into the base: without any, nothing was written, silently.
    return ConfigurationError(
        "training_engine.export_hf_merged: the model has no LoRA adapters to merge (it is for "
        "fairscale::with_lora models); export_hf alone writes this model whole."
    )


def _start_process_group(config: TrainConfig, on_cpu: bool, collective_timeout: float) -> None:
    """
    What Tango's engine does, with a timeout: Tango starts the process group with none, so a
    collective waits 30 minutes for a worker that hangs or a host that vanished.
    """
    device: Optional[torch.device] = None
    if not on_cpu:
        device = torch.device(config.worker_local_default_device)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="gloo" if on_cpu else "nccl",
        init_method=f"tcp://{config.distributed_address}:{config.distributed_port}",
        world_size=config.world_size,
        rank=config.worker_id,
        timeout=timedelta(seconds=collective_timeout),
        # NCCL's communicators bound to this worker's GPU: without it NCCL guesses the device from
        # the global rank ("can cause a hang if rank to GPU mapping is heterogeneous"), warned in
        # every worker of the first GPU run.
        device_id=device,
    )
