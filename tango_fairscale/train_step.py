"""
What this package adds to Tango's ``torch::train`` step, as plain functions: the integration
boundary (:mod:`tango_fairscale.compat`, patches T1 and T2) rebinds Tango's step and worker
functions to call :func:`run_step` and :func:`run_worker` with the originals, and does nothing else.

- :func:`run_step`, in Tango's main process: the package re-imported in the workers, the engine's
  callbacks added, pre-flight, the final model built on ``meta``, and the route: one process, one
  host (the rendezvous store served from here; one worker included) or a launch across hosts
  (any number of workers per host, 1 included); the engine's CPU workers spawned with malloc
  advising transparent huge pages and numpy's OpenBLAS starting the worker's share of threads
  (:func:`~tango_fairscale.cpu.memory.cpu_worker_environment`); the step's workers joined with a
  grace period (:func:`~tango_fairscale.compat.spawn_grace`, T4); a worker's ``CheckpointError``
  told as its one line.
- :func:`run_worker`, in each spawned worker: dies with its main process, and is stopped by it
  quietly (SIGINT ignored, SIGTERM ends it at once); across hosts, its
  global rank and ``TrainConfig``; once it finished, it ends without the interpreter's
  finalization (:func:`~tango_fairscale.launch.teardown.end_finished_worker`). In the main
  process of a step of one device on the engine (Tango runs such a step in-process), alone or as
  one host of several, it spawns that worker with the config of distributed training.
"""

import dataclasses
import logging
import os
from contextlib import ExitStack
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

from tango.common import Lazy
from tango.common.exceptions import ConfigurationError
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from . import compat
from . import launch as launching
from .checkpointing import newest_complete_checkpoint
from .cpu.memory import cpu_worker_environment
from .devices import devices_are_cpu
from .errors import CheckpointError, refused, worker_checkpoint_error
from .launch import teardown
from .launch.failures import worker_died
from .launch.signals import end_quietly_on_signals
from .preflight import preflight, pretrained_fingerprint, uses_fairscale_engine
from .step_result import FinalModelOnMeta, finish_result, load_final_weights, spawned_workers_result
from .telemetry.callbacks import RestoreRandomState
from .telemetry.metrics import MetricsLog

logger = logging.getLogger(__name__)

#: The package the spawned workers must import.
PACKAGE = "tango_fairscale"
#: ``torch::train``'s default ``distributed_port``.
TANGO_DEFAULT_PORT = 54761
#: Set by :func:`_train_distributed` around Tango's step of one device on the engine on one host:
#: Tango then calls its worker function in this process, which :func:`run_worker` spawns instead.
_SPAWN_ONE_WORKER: ContextVar[bool] = ContextVar("tango_fairscale_spawn_one_worker", default=False)


def with_engine_callbacks(callbacks: Any) -> List[Any]:
    """
    The callbacks every step on the engine gets, after the config's own (Tango pairs saved
    callback states with callbacks by position): the per-step metrics log, unless the config has
    one, and the restoring of the random generators on resume.
    """
    callbacks = list(callbacks or [])
    has_metrics = any(
        isinstance(callback, Lazy)
        and (
            getattr(callback, "_constructor", None) is MetricsLog
            or getattr(callback, "_params", {}).get("type") == "fairscale::metrics"  # type: ignore[union-attr]
        )
        for callback in callbacks
    )
    if not has_metrics:
        callbacks.append(Lazy(MetricsLog))
    callbacks.append(Lazy(RestoreRandomState))
    return callbacks


def run_step(original: Callable[..., Any], step: Any, *args: Any, **kwargs: Any) -> Any:
    """Tango's ``TorchTrainStep._train`` (``original``) of ``step``, with what this package adds (T1)."""
    try:
        return _run_step(original, step, *args, **kwargs)
    except ProcessRaisedException as error:
        # (g) A worker's CheckpointError (a refused checkpoint, a full disk), configuration error
        # or timed-out collective is one line, not mp.spawn's traceback quoting the worker's.
        one_line = worker_checkpoint_error(error)
        if one_line is None:
            raise
        logger.debug("The worker's error, as mp.spawn reported it:%s", error)
        raise one_line from error
    except (ConfigurationError, CheckpointError) as error:
        # (h) A refusal in this process (the launch's environment, the hosts' rendezvous, the
        # engine's checks) is one line too, not Tango's "Uncaught exception" traceback.
        line = refused(error)
        if line is None:
            raise
        logger.debug("The refusal, with its traceback:", exc_info=error)
        raise line from error


def _run_step(
    original: Callable[..., Any],
    step: Any,
    model: Any,
    training_engine: Any,
    dataset_dict: Any,
    train_dataloader: Any,
    **kwargs: Any,
) -> Any:
    # (a) The set is Tango's own; it is passed to mp.spawn by the original _train.
    compat.extra_imported_modules().add(PACKAGE)
    on_fairscale = uses_fairscale_engine(training_engine)
    if on_fairscale:
        kwargs["callbacks"] = with_engine_callbacks(kwargs.get("callbacks"))
    args: Tuple[Any, ...] = (model, training_engine, dataset_dict, train_dataloader)
    devices = kwargs.get("devices")
    # The engine takes any number of workers, 1 included, on one host or on each of several:
    # a step of one device gets its one worker spawned with a process group of its own.
    launch = launching.detect_launch(os.environ) if devices and (len(devices) > 1 or on_fairscale) else None
    distributed = bool(devices and (len(devices) > 1 or on_fairscale))
    if launch is not None and not on_fairscale:
        raise ConfigurationError(
            f"tango runs under {launch.launcher} as host {launch.node_rank} of {launch.num_nodes}, "
            f'but step {step.name!r} does not use the "fairscale" training engine: training across '
            "hosts is what that engine adds. Use it, or run without the launcher (or with "
            "TANGO_FAIRSCALE_MULTIHOST=0, to train on each host separately)."
        )
    if not distributed:
        return _preflight_and_route(step, original, args, kwargs, on_fairscale, launch)
    # (e) SIGINT or SIGTERM to this process, alone or with its process group, stops the step the
    # same way from here on: pre-flight and the rendezvous included, not only while workers train
    # (before, a signal during pre-flight ended the run with click's "Aborted!" and exit status 1).
    hint = _resume_hint(step, across_hosts=launch is not None)
    with launching.stop_workers_on_signals(resume_hint=hint):
        try:
            return _preflight_and_route(step, original, args, kwargs, on_fairscale, launch)
        except ProcessExitedException as error:
            # (k) A worker killed by a signal (the OOM killer's SIGKILL, a crash) is one line naming
            # it, the signal and its likely cause, not Tango's traceback of mp.spawn's exception.
            rank = error.error_index + (launch.node_rank * len(devices or ()) if launch is not None else 0)
            logger.debug("The worker's death, as mp.spawn reported it: %s", error)
            raise worker_died(error, rank, hint()) from error


def _preflight_and_route(
    step: Any,
    original: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    on_fairscale: bool,
    launch: Any,
) -> Any:
    """Pre-flight, then the step on its route: in this process, or its workers spawned here."""
    model, training_engine, dataset_dict, train_dataloader = args
    devices = kwargs.get("devices")
    distributed = bool(devices and (len(devices) > 1 or on_fairscale))
    options = None
    if on_fairscale:
        # (b) Across hosts, the world the data is split over is every host's workers.
        world: Dict[str, Any] = (
            {"devices": list(devices) * launch.num_nodes, "hosts": launch.num_nodes}
            if launch is not None and devices
            else {}
        )
        options = preflight(
            model=model,
            training_engine=training_engine,
            dataset_dict=dataset_dict,
            train_dataloader=train_dataloader,
            work_dir=step.work_dir,
            **{**kwargs, **world},
        )
    if not distributed:
        return original(step, *args, **kwargs)
    if on_fairscale and isinstance(model, Lazy):
        # (f) The final model in this process: on meta, the weights assigned, not copied.
        args = (FinalModelOnMeta(model), *args[1:])
    # CPU workers start with malloc advising huge pages and OpenBLAS's threads their share (both
    # read only at a start).
    workers_env = {}
    if options is not None and devices_are_cpu(devices):
        workers_env = cpu_worker_environment(os.environ, options.cpu_threads_per_worker, len(devices or ()))
    # (i) T4: a worker that ignores SIGTERM after another failed is killed sooner, in the spawns
    # of this step only. (j) T7: the step's result takes weights.pt's tensors from the disk
    # (a shared mapping of a private copy), not into this process's memory.
    with ExitStack() as stack:
        stack.enter_context(launching.environment(workers_env))
        stack.enter_context(compat.spawn_grace())
        if on_fairscale:
            final_weights = Path(step.work_dir) / "weights.pt"
            stack.enter_context(compat.final_weights_from_disk(final_weights, load_final_weights))
        return _train_distributed(step, launch, original, args, kwargs, on_fairscale)


def _train_distributed(
    step: Any,
    launch: Any,
    original: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    on_fairscale: bool,
) -> Any:
    """The step's workers spawned on this host, alone or as one host of several."""
    if launch is not None:
        return finish_result(_train_across_hosts(step, launch, original, args, kwargs))
    # (c) Served from this process for the life of the step (see tango_fairscale.launch).
    configured = getattr(step, "_config", None) or {}
    one_worker = _SPAWN_ONE_WORKER.set(on_fairscale and len(kwargs.get("devices") or ()) == 1)
    try:
        with launching.rendezvous_store(
            kwargs.get("distributed_port", TANGO_DEFAULT_PORT),
            set_in_config="distributed_port" in configured,
            address=kwargs.get("distributed_address", launching.LOCAL_ADDRESS),
        ) as port:
            kwargs["distributed_port"] = port
            return finish_result(original(step, *args, **kwargs))
    finally:
        _SPAWN_ONE_WORKER.reset(one_worker)


def _resume_hint(step: Any, across_hosts: bool = False) -> Callable[[], str]:
    """
    What the line a stopped run (SIGINT, SIGTERM) ends with says about resuming: Tango's
    ``torch::train`` resumes a step from its latest checkpoint when the same command runs again
    (the step's identity, and so its work directory, is its config). Read when the signal
    arrives: the checkpoints written until then count.
    """
    work_dir = Path(step.work_dir)
    rerun = "rerun the same tango run command"

    def hint() -> str:
        newest = None if across_hosts else newest_complete_checkpoint(work_dir)
        if newest is not None:
            return f"{rerun} to resume from its latest checkpoint, {newest.name}"
        if not across_hosts and not any(work_dir.glob("checkpoint_state_*")):
            return f"{rerun} to start the step again (it had no complete checkpoint yet)"
        # Across hosts the newest checkpoint every host has; another engine's checkpoints.
        return f"{rerun} to resume from the latest checkpoint"

    return hint


def _train_across_hosts(
    step: Any, launch: Any, original: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    """(d): run the step as this host's part of a launch across hosts (see :mod:`.launch`)."""
    devices = kwargs["devices"]
    timeout = launching.seconds_from_environment(
        os.environ, launching.RENDEZVOUS_TIMEOUT_VARIABLE, launching.DEFAULT_RENDEZVOUS_TIMEOUT
    )
    with launching.host_rendezvous(
        launch,
        step_id=step.unique_id,
        work_dir=step.work_dir,
        device_count=len(devices),
        timeout=timeout,
        step_name=step.name,
        base_files=pretrained_fingerprint(args[0]),  # the model (torch::train's first argument)
    ) as session:
        world = session.world
        interface = launching.socket_interface_environment(
            os.environ, world.hosts[world.node_rank].address, launching.interface_addresses()
        )
        if not interface and not os.environ.get("GLOO_SOCKET_IFNAME"):
            logger.warning(
                "No network interface here has address %s (the one that reaches MASTER_ADDR %s): gloo "
                "picks one from the host name. Set GLOO_SOCKET_IFNAME if the hosts cannot connect.",
                world.hosts[world.node_rank].address,
                launch.master_addr,
            )
        updates = {
            launching.WORLD_VARIABLE: world.to_json(),
            launching.AGENT_STORE_VARIABLE: str(True),
            **interface,
        }
        with launching.environment(updates):
            try:
                return original(step, *args, **kwargs)
            except Exception as error:
                # The error of the host where it started (lost, or failed first), if not this one.
                origin = session.failure(error)
                if origin is not None:
                    raise origin from error
                raise


def run_worker(
    original: Callable[..., Any], process_index: int, workspace: Any, config: Any, *args: Any, **kwargs: Any
) -> Any:
    """
    Tango's worker function (``original``), which ``mp.spawn`` runs with the index of the process
    on this host (T2). Distributed workers die with the process that spawned them, which alone
    acts on SIGINT and SIGTERM and stops them (:func:`~.launch.signals.end_quietly_on_signals`). In a launch
    across hosts the index becomes the global rank, and the worker's ``TrainConfig`` the global one
    (:func:`tango_fairscale.launch.worker_train_config`). A distributed worker that finished ends
    here (:func:`~tango_fairscale.launch.teardown.end_finished_worker`): it does not return.
    """
    world = launching.HostWorld.from_environment(os.environ)
    if (world is not None or _SPAWN_ONE_WORKER.get()) and not getattr(config, "is_distributed", False):
        # Tango's main process, training a step of one device on the engine, alone or as one host
        # of several: Tango runs such a step in its own process, without a process group. Spawn it
        # as Tango spawns several workers, with the config of distributed training.
        return _spawn_one_worker(workspace, config, *args, **kwargs)
    if getattr(config, "is_distributed", False):
        launching.die_with_parent()
        # Stopped by the main process (SIGTERM) without a word or a leaked semaphore.
        end_quietly_on_signals()
    if world is None or not getattr(config, "is_distributed", False):
        result = original(process_index, workspace, config, *args, **kwargs)
    else:
        os.environ.update(launching.worker_environment(world, process_index))
        host_config = launching.worker_train_config(config, world)
        result = original(world.global_rank(process_index), workspace, host_config, *args, **kwargs)
    if getattr(config, "is_distributed", False):
        # A spawned worker that finished: left to the interpreter's finalization, a gloo thread
        # finishing the last collective could ask for the GIL and abort the worker (SIGABRT) after
        # everything was written; it ends without it (see tango_fairscale.launch.teardown). Only on
        # success: a worker that raised may have a peer inside a collective with it, and its
        # error must reach the main process without waiting.
        teardown.end_finished_worker()
    return result


def _spawn_one_worker(
    workspace: Any,
    config: Any,
    model: Any,
    training_engine: Any,
    dataset_dict: Any,
    train_dataloader: Any,
    validation_dataloader: Any = None,
    callbacks: Any = None,
) -> Any:
    """
    (h) The step's one worker, alone or in a launch across hosts with ``device_count`` 1: spawned as
    Tango's ``TorchTrainStep._train`` spawns its workers (the same worker function and
    arguments), with ``is_distributed`` set, so that :func:`run_worker` gives it its global rank.
    Returns what Tango's one-process route expects back: the final model
    (:func:`~tango_fairscale.step_result.spawned_workers_result`).
    """
    import torch.multiprocessing as mp
    from tango.common.util import get_extra_imported_modules
    from tango.integrations.torch import train as tango_train

    mp.spawn(
        tango_train._train,
        args=(
            workspace,
            dataclasses.replace(config, is_distributed=True),
            model,
            training_engine,
            dataset_dict,
            train_dataloader,
            validation_dataloader,
            callbacks,
            get_extra_imported_modules(),
        ),
        nprocs=1,
    )
    return spawned_workers_result(model)
