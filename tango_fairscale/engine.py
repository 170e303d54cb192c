"""
:class:`FairScaleTrainingEngine`: Tango's ``torch::train`` with the model sharded by FairScale's
Fully Sharded Data Parallel (ZeRO-3) instead of replicated by DDP.
"""

import gc
import logging
import os
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

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

from . import checkpointing, consolidation, multihost
from .checkpointing import random_state
from .checkpointing.formats import check_written_by, dcp_files_of_worker, holds_worker_files
from .config import FSDPConfig
from .cpu.memory import limit_cpu_heap_growth
from .devices import devices_are_cpu, worker_computes_on_cpu
from .launch import HostWorld
from .materialize import has_meta_parameters, materialize_module, parameters_on_meta
from .options import amp_dtype, check_engine_options
from .registry import register_training_engine
from .wrapping import WrapPlan, deferred_wrapping, recorded_plan

logger = logging.getLogger(__name__)

#: Seconds a collective (or the process group's rendezvous) may wait for the other workers.
DEFAULT_COLLECTIVE_TIMEOUT = 300.0


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
        of floating-point summation.
    :param hybrid_sharding:
        With ``backend: "torch"`` in a launch across hosts: shard each unit's parameters across the
        workers of each host only, and replicate them across hosts (HSDP, a 2-D device mesh). The
        all-gathers of every forward and backward pass then stay within a host; across hosts go
        the gradients only (one all-reduce per unit), at the cost of each host holding a whole
        copy of the sharded state: parameters, gradients and optimizer state take ``hosts`` times
        the memory per worker of full sharding. The result is the same up to the order of
        floating-point summation. On one host it changes nothing.
    :param verify_checkpoints:
        Check the SHA-256 of every checkpoint file against the marker before resuming from it
        (re-reading each file once: on GPT-2 small's 0.7 GiB per worker, about as long as loading
        it). ``false`` checks sizes, headers and shapes only, for checkpoints too large to re-read.
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
        collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT,
        verify_checkpoints: bool = True,
        backend: str = "fairscale",
        accumulate_grads_locally: bool = False,
        hybrid_sharding: bool = False,
    ) -> None:
        on_cpu = devices_are_cpu(train_config.devices)
        self.fsdp_config = fsdp_config or FSDPConfig()
        #: The hosts of a launch across hosts (``None`` on one host): see tango_fairscale.launch.
        self.hosts = HostWorld.from_environment(os.environ) if train_config.is_distributed else None
        check_engine_options(
            distributed=train_config.is_distributed,
            device_count=len(train_config.devices or [None]),
            on_cpu=on_cpu,
            amp=amp,
            amp_use_bfloat16=amp_use_bfloat16,
            max_grad_norm=max_grad_norm,
            fsdp_config=self.fsdp_config,
            backend=backend,
            accumulate_grads_locally=accumulate_grads_locally,
            hybrid_sharding=hybrid_sharding,
            hosts=self.hosts.num_nodes if self.hosts is not None else 1,
            # Once per run, not once per worker.
            warn=train_config.worker_id == 0,
        )
        self.backend = backend
        self.accumulate_grads_locally = accumulate_grads_locally
        #: Whether the backward pass of the current micro-batch reduces the gradients.
        self._sync_gradients = True
        self.init_on_meta = init_on_meta
        if not isinstance(verify_checkpoints, bool):
            raise ConfigurationError(
                f"verify_checkpoints: expected true or false, got {verify_checkpoints!r}."
            )
        self.verify_checkpoints = verify_checkpoints
        #: Generator states of the checkpoint resumed from, for RestoreRandomState.
        self.loaded_random_state: Optional[Dict[str, Any]] = None
        self.hybrid_sharding = hybrid_sharding
        if on_cpu:
            limit_cpu_heap_growth()
        if train_config.is_distributed:
            _start_process_group(train_config, on_cpu, collective_timeout)
        # Tango's engine would build a torch.cuda.amp.GradScaler whenever amp is on (deprecated,
        # and wrong for sharded gradients): construct it without AMP, then set AMP up here.
        with _process_group_already_started(train_config):
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
        self.grad_scaler: Any = None
        if amp and backend == "torch":
            from .backends.torch_fsdp import make_grad_scaler

            self.grad_scaler = make_grad_scaler(self.amp_dtype, "cpu" if on_cpu else "cuda")
        elif amp and self.amp_dtype == torch.float16:
            self.grad_scaler = ShardedGradScaler()
        has_own_checkpoint = (
            self._agree_on_own_checkpoint() if self.hosts is not None else self._find_own_checkpoint()
        )
        if resume_from_checkpoint is not None:
            self._link_resume_checkpoint(Path(resume_from_checkpoint), has_own_checkpoint)

    def _find_own_checkpoint(self) -> bool:
        """
        On one host, before Tango looks for ``checkpoint_state_latest``: when the link is missing
        or dangling (Tango removes and re-creates it after each save, so a kill in between leaves
        none), point it at the newest complete checkpoint in the work directory, rather than let
        the run start over. Returns whether there is a checkpoint to resume from.
        """
        config = self.train_config
        if config.state_path.exists():
            return True
        newest = checkpointing.newest_complete_checkpoint(config.work_dir)
        # Every worker looks before worker 0 changes the link, so that all take the same branch.
        dist.barrier()
        if newest is not None and config.is_local_main_process:
            logger.warning(
                "%s is missing or dangling: resuming from %s, the newest complete checkpoint.",
                config.state_path,
                newest.name,
            )
            if config.state_path.is_symlink():
                config.state_path.unlink()
            config.state_path.symlink_to(newest.name, target_is_directory=True)
        dist.barrier()
        return newest is not None

    def _agree_on_own_checkpoint(self) -> bool:
        """
        Across hosts, before Tango looks for ``checkpoint_state_latest``: point it, on every host,
        at the newest checkpoint that every worker of every host can resume from (see
        :mod:`tango_fairscale.multihost`), or remove it when there is none. Returns whether there is.
        """
        assert self.hosts is not None
        config = self.train_config
        mine = multihost.resumable_steps(config.work_dir, config.world_size, config.worker_id)
        everyone: List[Dict[int, str]] = [{} for _ in range(config.world_size)]
        dist.all_gather_object(everyone, mine)
        step = multihost.agree(everyone)
        if config.is_local_main_process:
            self._point_latest_at(step)
            if step is None and mine:
                logger.warning(
                    "Host %d has checkpoints of steps %s, but none is complete on every host: training "
                    "starts from the beginning.",
                    self.hosts.node_rank,
                    sorted(mine),
                )
            elif step is not None and max(mine) > step:
                logger.warning(
                    "Host %d resumes from step %d, the newest checkpoint complete on every host "
                    "(it has step %d, which another host did not finish).",
                    self.hosts.node_rank,
                    step,
                    max(mine),
                )
        dist.barrier()
        return step is not None

    def _point_latest_at(self, step: Optional[int]) -> None:
        """Point this host's ``checkpoint_state_latest`` (and a newer ``..._best``) at ``step``."""
        config = self.train_config
        links = [config.state_path]
        best = config.best_state_path
        if best.is_symlink():
            best_step = multihost.step_of(Path(os.readlink(best)))
            # A best checkpoint newer than the resume point belongs to steps about to be redone.
            if step is None or (best_step is not None and best_step > step):
                links.append(best)
        for link in links:
            if link.is_symlink() or link.exists():
                link.unlink()
            if step is not None:
                # Relative, as Tango makes it.
                link.symlink_to(f"checkpoint_state_step{step}", target_is_directory=True)

    def _link_resume_checkpoint(self, source: Path, has_own_checkpoint: bool) -> None:
        # Tango resumes from `checkpoint_state_latest` in the step's work directory when it
        # exists, right after constructing the engine: pointing that link at the requested
        # checkpoint makes Tango restore the step count and data position as for any resume.
        config = self.train_config
        # Every worker looks before the link is created, so that all take the same branch
        # (and meet at the same barriers).
        dist.barrier()
        if has_own_checkpoint:
            logger.info("Resuming from this step's own checkpoint; ignoring resume_from_checkpoint")
            return
        try:
            source = checkpointing.resolve_checkpoint(source)
        except checkpointing.CheckpointError as error:
            raise ConfigurationError(f"resume_from_checkpoint: {error}") from None
        # Each host's first worker: each host has its own work directory.
        if config.is_local_main_process:
            config.work_dir.mkdir(parents=True, exist_ok=True)
            if config.state_path.is_symlink():  # dangling: its target was removed
                config.state_path.unlink()
            config.state_path.symlink_to(source, target_is_directory=True)
        dist.barrier()

    def forward_train(
        self, micro_batch: Dict[str, Any], micro_batch_idx: int, num_micro_batches: int
    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        # Tango calls backward() right after, with the loss only: decide here for it.
        self._sync_gradients = not self.accumulate_grads_locally or micro_batch_idx == num_micro_batches - 1
        try:
            return super().forward_train(micro_batch, micro_batch_idx, num_micro_batches)
        except KeyError as error:
            if error.args != ("loss",):
                raise
            raise ConfigurationError(
                "The model's forward() returned no 'loss': torch::train needs forward() to return "
                'a dict with the training loss under "loss" (a scalar tensor).'
            ) from None

    def backward(self, loss: torch.Tensor) -> None:
        with ExitStack() as stack:
            if not self._sync_gradients:
                # Both backends read the flag in their post-backward hooks only, so it is enough
                # to hold it over backward; the first backward outside reduces the sum.
                stack.enter_context(self._no_sync())
            super().backward(loss)

    def _no_sync(self) -> Any:
        if self.backend == "torch":
            from .backends.torch_fsdp import no_sync

            return no_sync(self.model)
        return self.model.no_sync()  # type: ignore[operator]

    @property
    def computes_on_cpu(self) -> bool:
        """Whether the FSDP units of this engine compute on CPU workers."""
        return worker_computes_on_cpu()

    def _construct_model(self, model: Union[Model, Lazy[Model]]) -> Model:
        if self.backend == "torch":
            return self._construct_torch_model(model)
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

    def _construct_torch_model(self, model: Union[Model, Lazy[Model]]) -> Model:
        """The torch backend: build the model with its wrap plan recorded, then shard it by the plan."""
        from .backends.torch_fsdp import make_mesh, shard_model

        if isinstance(model, Lazy):
            with deferred_wrapping(), parameters_on_meta() if self.init_on_meta else nullcontext():
                model = model.construct()
        elif any(isinstance(module, FSDP) for module in model.modules()):
            raise ConfigurationError(
                'training_engine.backend: "torch" got a model with FairScale FSDP units already in it: pass '
                "the model to the engine unconstructed (as a config does), so that with_wrapped_modules "
                'leaves its units to the torch backend, or use backend: "fairscale".'
            )
        if not any(True for _ in model.parameters()):
            raise ConfigurationError(
                f"The model ({type(model).__name__}) has no parameters: there is nothing to shard or train."
            )
        plan, unit_config = recorded_plan(model)
        if plan is None:  # not built by with_wrapped_modules: FSDP on the root only
            plan = WrapPlan(selected=(), checkpointed=frozenset(), fsdp=False)
        # Hybrid sharding: a 2-D mesh, shards within each host, replicas across hosts.
        hosts = self.hosts.num_nodes if self.hosts is not None and self.hybrid_sharding else 1
        mesh = make_mesh(self.train_config.world_size, hosts)
        if self.train_config.worker_id == 0:
            logger.info(
                "Sharding over the device mesh %s %s",
                mesh.mesh_dim_names,
                " x ".join(str(size) for size in mesh.shape),
            )
        return shard_model(model, plan, unit_config, self.fsdp_config, mesh)  # type: ignore[return-value]

    def clip_grad_norm(self) -> None:
        if self.max_grad_norm is None:
            return
        if self.backend == "torch":
            from .backends.torch_fsdp import clip_grad_norm_

            clip_grad_norm_(self.model, self.max_grad_norm)
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

    def _replicated_states(self) -> Dict[str, Any]:
        """The LR scheduler's and loss scaler's states, the same on every worker (when present)."""
        states: Dict[str, Any] = {}
        if self.lr_scheduler is not None:
            states["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.grad_scaler is not None:
            states["grad_scaler"] = self.grad_scaler.state_dict()
        return states

    def save_checkpoint(self, checkpoint_dir: Path, client_state: Dict[str, Any]) -> None:
        if self.backend == "torch":
            self._save_torch_checkpoint(Path(checkpoint_dir), client_state)
            return
        checkpoint_dir = Path(checkpoint_dir)
        worker = self.train_config.worker_id
        # The worker that maintains this host's directory: worker 0 on one host, each host's
        # first worker across hosts (whose directories are their own).
        keeper = self.train_config.is_local_main_process
        if keeper:
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
            **self._replicated_states(),
        }
        # So that a resumed run draws the dropout masks an uninterrupted one would.
        states["random_state"] = random_state.capture()
        step = client_state.get("training_steps")
        digests: Dict[str, Any] = {}
        for name, state in Tqdm.tqdm(
            states.items(),
            desc=f"Saving checkpoint {checkpoint_dir.name}",
            leave=False,
            disable=worker != 0,
        ):
            path = checkpointing.worker_file(checkpoint_dir, worker, name)
            digests[path.name] = self._write_state(name, state, path, step)
        # Every file's size and SHA-256 go into the marker; gathering them is also the barrier
        # after which every worker (of every host) has its files on disk.
        everyone: List[Dict[str, Any]] = [{} for _ in range(self.train_config.world_size)]
        dist.all_gather_object(everyone, digests)
        if keeper:
            extra: Dict[str, Any] = {
                "training_steps": step,
                "files": sorted(states),
                "digests": {name: digest for part in everyone for name, digest in part.items()},
            }
            if self.hosts is not None:
                multihost.link_other_hosts_files(checkpoint_dir, self.hosts, extra)
                extra.update(multihost.part_description(self.hosts))
            checkpointing.write_marker(checkpoint_dir, world_size=self.train_config.world_size, extra=extra)
        # Every host's marker is written before any host goes on (and removes its older
        # checkpoints): so the hosts always have a newest checkpoint in common.
        dist.barrier()

    def _save_torch_checkpoint(self, checkpoint_dir: Path, client_state: Dict[str, Any]) -> None:
        """The torch backend: model and optimizer shards through DCP, the rest per worker, then the marker."""
        from .backends.torch_fsdp_checkpoint import save_sharded

        extra_states = {
            "trainer": client_state,
            **self._replicated_states(),
            "random_state": random_state.capture(),
        }
        hosts = self.hosts
        fields = save_sharded(
            checkpoint_dir,
            self.model,
            self.optimizer,
            extra_states,
            step=client_state.get("training_steps"),
            node_of_rank=None if hosts is None else [hosts.node_of(r) for r in range(hosts.world_size)],
        )
        # save_sharded gathered every worker's digests, so every file is on disk. As for the
        # fairscale backend, each host's first worker marks its host's directory.
        if self.train_config.is_local_main_process:
            if hosts is not None:
                multihost.link_other_hosts_files(checkpoint_dir, hosts, fields)
                fields.update(multihost.part_description(hosts))
            checkpointing.write_marker(checkpoint_dir, world_size=fields["world_size"], extra=fields)
        dist.barrier()

    def _write_state(self, name: str, state: Any, path: Path, step: Optional[int]) -> Dict[str, Any]:
        """
        Write one of this worker's checkpoint files (``name`` is ``"model"``, ``"optimizer"``, ...),
        with the header that ties it to this worker, world size and step; return its digest.
        """
        config = self.train_config
        return checkpointing.atomic_save(
            checkpointing.with_header(
                state, kind=name, rank=config.worker_id, world_size=config.world_size, step=step
            ),
            path,
        )

    def load_checkpoint(self, checkpoint_dir: Path) -> Dict[str, Any]:
        if self.backend == "torch":
            return self._load_torch_checkpoint(Path(checkpoint_dir).resolve())
        checkpoint_dir = Path(checkpoint_dir).resolve()
        marker = self._loadable_marker(checkpoint_dir)
        saved_world_size = marker["world_size"]
        worker = self.train_config.worker_id
        # Replicated state (scheduler, scaler, trainer) is the same in every worker's file;
        # a worker that did not exist in the saved run reads worker 0's.
        source_worker = worker if worker < saved_world_size else 0
        world_size = self.train_config.world_size
        saved_names = checkpointing.saved_file_names(marker)

        def load(name: str, from_worker: int = source_worker, mmap: bool = False, hashes: bool = True) -> Any:
            # Checked against the marker's size and SHA-256 and the file's own header.
            return checkpointing.read_worker_state(
                checkpoint_dir,
                marker,
                from_worker,
                name,
                mmap=mmap,
                hashes=hashes and self.verify_checkpoints,
            )

        fsdp: FSDP = self.model  # type: ignore[assignment]
        local_weights = fsdp.local_state_dict()
        # Everything is read and checked before anything is applied, and the workers agree on the
        # outcome: a worker that finds a bad file must not leave the others waiting in a collective.
        try:
            own_model = load("model")
            checkpointing.check_same_parameter_shapes(own_model["metadata"], fsdp.local_metadata_dict())
            same_layout = saved_world_size == world_size and checkpointing.same_shapes(
                own_model["weights"], local_weights
            )
            if same_layout:
                model_shards, optimizer_shards = [own_model], [load("optimizer")]
            else:
                # Every worker needs a slice of every saved file: mapped, not read whole, so that a
                # host running N workers does not hold N copies of the full model and optimizer.
                # Each file's SHA-256 is checked by one worker, not all.
                model_shards = [
                    load("model", w, mmap=True, hashes=w % world_size == worker)
                    for w in range(saved_world_size)
                ]
                optimizer_shards = [
                    load("optimizer", w, mmap=True, hashes=w % world_size == worker)
                    for w in range(saved_world_size)
                ]
            self._check_same_optimizer(optimizer_shards[0], checkpoint_dir)
            components = {
                name: load(name) if name in saved_names else None for name in ("lr_scheduler", "grad_scaler")
            }
            trainer_state = load("trainer")
            saved_random_state = (
                load("random_state")
                if "random_state" in saved_names and saved_world_size == world_size
                else None
            )
            problem = None
        except checkpointing.CheckpointError as error:
            problem = str(error)
        problems: List[Optional[str]] = [None] * world_size
        dist.all_gather_object(problems, problem)
        found = [(rank, text) for rank, text in enumerate(problems) if text is not None]
        if found:
            rank, text = found[0]
            raise checkpointing.CheckpointError(
                f"Cannot resume from {checkpoint_dir} (found by worker {rank}"
                f"{f' and {len(found) - 1} other(s)' if len(found) > 1 else ''}): {text}"
            )

        if same_layout:
            self.load_model_state(own_model)
            self.optimizer.load_state_dict(optimizer_shards[0])
        else:
            logger.info(
                "Resharding checkpoint %s from %d to %d workers", checkpoint_dir, saved_world_size, world_size
            )
            fsdp.load_local_state_dict(
                checkpointing.reshard_model_weights(model_shards, local_weights, worker)
            )
            self.optimizer.load_state_dict(
                checkpointing.reshard_optimizer_state(
                    model_shards, optimizer_shards, local_weights, self._optimizer_keys(), worker
                )
            )
        return self._restore_the_rest(
            checkpoint_dir,
            components,
            saved_random_state,
            trainer_state,
            resharded=saved_world_size != world_size,
        )

    def _restore_the_rest(
        self,
        checkpoint_dir: Path,
        components: Dict[str, Any],
        saved_random_state: Optional[Dict[str, Any]],
        trainer_state: Dict[str, Any],
        *,
        resharded: bool,
    ) -> Dict[str, Any]:
        """After the model and optimizer: scheduler, loss scaler, random state. Returns the trainer state."""
        for name, component, fresh in (
            ("lr_scheduler", self.lr_scheduler, "the learning-rate schedule starts from its first step"),
            ("grad_scaler", self.grad_scaler, "the loss scale starts from its initial value"),
        ):
            if component is None:
                continue
            saved_state = components.get(name)
            if saved_state is None:
                # A checkpoint of a run configured without it (resume_from_checkpoint); the
                # marker guarantees that any file the saving run wrote is there.
                logger.warning("Checkpoint %s has no %s state: %s.", checkpoint_dir, name, fresh)
                continue
            component.load_state_dict(saved_state)
        # Restored right before the training loop (RestoreRandomState): see there for why. On
        # another number of workers the saved generators do not map onto the new workers, which
        # keep the states seeded from the step's seed.
        self.loaded_random_state = None if resharded else saved_random_state
        if resharded:
            logger.info("Resharded resume: random generators continue from the seed, not the saved states")
        if self.train_config.work_dir.resolve() not in checkpoint_dir.parents:
            trainer_state = self._trainer_state_from_another_run(trainer_state)
        return trainer_state

    def _load_torch_checkpoint(self, checkpoint_dir: Path) -> Dict[str, Any]:
        """The torch backend: DCP reads each worker's part of the saved shards, for any number of workers."""
        from .backends.torch_fsdp_checkpoint import load_sharded

        try:
            states = load_sharded(checkpoint_dir, self.model, self.optimizer, hashes=self.verify_checkpoints)
        except checkpointing.CheckpointError as error:
            raise self._explain_part(error, checkpoint_dir) from None
        marker = checkpointing.read_marker(checkpoint_dir)
        assert marker is not None  # load_sharded checked it
        resharded = marker["world_size"] != self.train_config.world_size
        if resharded:
            logger.info(
                "Resharding checkpoint %s from %d to %d workers",
                checkpoint_dir,
                marker["world_size"],
                self.train_config.world_size,
            )
        return self._restore_the_rest(
            checkpoint_dir, states, states.get("random_state"), states["trainer"], resharded=resharded
        )

    def _check_same_optimizer(self, saved: Dict[str, Any], checkpoint_dir: Path) -> None:
        """A checkpoint of another optimizer (type or options) would fail deep in PyTorch with a KeyError."""
        saved_groups, groups = saved.get("param_groups", []), self.optimizer.param_groups
        saved_options = sorted(set(saved_groups[0]) - {"params"}) if saved_groups else []
        options = sorted(set(groups[0]) - {"params"}) if groups else []
        if len(saved_groups) != len(groups) or saved_options != options:
            raise checkpointing.CheckpointError(
                f"{checkpoint_dir} holds the state of another optimizer: {len(saved_groups)} parameter "
                f"group(s) with options {saved_options}, where this run's {type(self.optimizer).__name__} "
                f"has {len(groups)} with {options}. Resume with the optimizer it was saved with."
            )

    def _loadable_marker(self, checkpoint_dir: Path) -> Dict[str, Any]:
        """
        The marker of a checkpoint this worker can load: a complete one, or (across hosts) this
        host's part of one of the same world size that holds this worker's files, which is all
        a worker reads when nothing is resharded.
        """
        marker = checkpointing.read_marker(checkpoint_dir) if checkpoint_dir.is_dir() else None
        if marker is not None:
            check_written_by(checkpoint_dir, marker, "fairscale")
            if self.hosts is not None and holds_worker_files(
                checkpoint_dir, marker, self.train_config.world_size, self.train_config.worker_id
            ):
                return marker
        try:
            return checkpointing.require_complete(checkpoint_dir)
        except checkpointing.CheckpointError as error:
            raise self._explain_part(error, checkpoint_dir) from None

    @staticmethod
    def _explain_part(error: Exception, checkpoint_dir: Path) -> Exception:
        """``error``, saying how to resume a checkpoint when it is a host's part of one across hosts."""
        try:
            marker = checkpointing.read_marker(checkpoint_dir) if checkpoint_dir.is_dir() else None
        except checkpointing.CheckpointError:
            marker = None
        part = multihost.describe_part(marker) if marker is not None else None
        if part is None:
            return error
        return checkpointing.CheckpointError(
            f"{error} It is {part}: resume it with the same hosts and device_count, or copy every "
            "host's worker files of it (worker*.pt, and dcp/ for the torch backend) into one directory "
            "to resume it elsewhere (on a shared filesystem each host's checkpoints are complete already)."
        )

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

    def save_complete_weights_from_checkpoint(self, checkpoint_dir: Path, weights_path: Path) -> None:
        # Written one tensor at a time from shards that are mapped, not read into private memory
        # (tango_fairscale.consolidation), after the optimizer state is dropped: the whole model
        # beside the training state made the end of a run need more memory than training did.
        logger.info("Consolidating the sharded weights of %s into %s", checkpoint_dir, weights_path)
        self._release_training_state()
        checkpoint_dir = Path(checkpoint_dir).resolve()
        if self.hosts is not None and self.backend == "torch":
            from .backends.torch_fsdp_checkpoint import dcp_part_model_source

            # As below, with DCP's data files (one per worker: save_sharded writes
            # single_file_per_rank), which hold the optimizer state besides the model's.
            with multihost.received_files_dir(checkpoint_dir) as received_dir:
                multihost.receive_missing_files(
                    checkpoint_dir,
                    self.hosts,
                    lambda marker, rank: next(iter(dcp_files_of_worker(marker, rank)), None),
                    received_dir,
                )
                part = dcp_part_model_source(checkpoint_dir, received_dir, hashes=self.verify_checkpoints)
                consolidation.save_model(part, Path(weights_path))
        elif self.hosts is not None:
            # Tango calls this on each host's first worker only (is_local_main_process): they
            # exchange what they lack, so every host's weights.pt is the whole model.
            shards = multihost.gather_model_shards(checkpoint_dir, self.hosts, hashes=self.verify_checkpoints)
            consolidation.save_model(consolidation.fairscale_model_source(shards), Path(weights_path))
        else:
            # Either backend's format, told apart by the marker.
            source = consolidation.model_source(checkpoint_dir, hashes=self.verify_checkpoints)
            consolidation.save_model(source, Path(weights_path))


@contextmanager
def _process_group_already_started(config: TrainConfig) -> Iterator[None]:
    """
    While Tango's engine constructor runs. It starts the process group itself when the config is
    distributed (with no timeout); the engine has started it already, with one, and a second start
    is an error. So the constructor sees the config as not distributed: nothing else in it reads
    the flag.
    """
    distributed = config.is_distributed
    config.is_distributed = False
    try:
        yield
    finally:
        config.is_distributed = distributed


def _start_process_group(config: TrainConfig, on_cpu: bool, collective_timeout: float) -> None:
    """
    What Tango's engine does, with a timeout: Tango starts the process group with none, so a
    collective waits 30 minutes for a worker that hangs or a host that vanished.
    """
    if isinstance(collective_timeout, bool) or not isinstance(collective_timeout, (int, float)):
        raise ConfigurationError(
            f"collective_timeout: must be a number of seconds, got {collective_timeout!r}."
        )
    if not collective_timeout > 0:
        raise ConfigurationError(f"collective_timeout: must be positive, got {collective_timeout!r}.")
    if not on_cpu:
        torch.cuda.set_device(config.worker_local_default_device)
    dist.init_process_group(
        backend="gloo" if on_cpu else "nccl",
        init_method=f"tcp://{config.distributed_address}:{config.distributed_port}",
        world_size=config.world_size,
        rank=config.worker_id,
        timeout=timedelta(seconds=collective_timeout),
    )
