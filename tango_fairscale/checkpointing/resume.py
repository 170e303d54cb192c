"""
Where a run resumes from, for both backends, before Tango looks for the step's
``checkpoint_state_latest``: the newest complete checkpoint when the link is missing, the newest
one every host can resume from across hosts, or the ``resume_from_checkpoint`` the config names.
Every function here is collective: all workers call it and meet at the same barriers.
"""

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch.distributed as dist
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import TrainConfig

from .. import checkpointing
from ..backends.lookup import holds_worker_files
from ..launch import HostWorld, multihost

logger = logging.getLogger(__name__)


def check_own(checkpoint_dir: Path, marker: Mapping[str, Any], config: TrainConfig) -> None:
    """
    A checkpoint in the step's own work directory was written by this step (its unique id, which
    covers the config, in the marker): one of another run (another learning rate, another model)
    copied or left there would be resumed without a word. One named by ``resume_from_checkpoint``
    lies elsewhere and is the user's choice. Markers written before the id was recorded pass.
    """
    work_dir = Path(config.work_dir).resolve()
    if work_dir not in Path(checkpoint_dir).resolve().parents:
        return
    written_by = marker.get(checkpointing.STEP_ID_FIELD)
    if written_by is None or written_by == config.step_id:
        return
    raise ConfigurationError(
        f"{checkpoint_dir.name} in this step's work directory was written by step {written_by}, not by "
        f"this one ({config.step_id}): it is another run's checkpoint, and resuming from it would "
        "continue that run. Move it out of the work directory, or name it with "
        "training_engine.resume_from_checkpoint to start from it on purpose."
    )


def find_own_checkpoint(config: TrainConfig, hosts: Optional[HostWorld]) -> bool:
    """Point ``checkpoint_state_latest`` at the checkpoint to resume from; return whether there is one."""
    if config.is_local_main_process:
        remove_interrupted_saves(config.work_dir)
    return _agree_on_own_checkpoint(config, hosts) if hosts is not None else _newest_on_this_host(config)


def remove_interrupted_saves(work_dir: Path) -> List[Path]:
    """
    Remove the checkpoint directories of saves that never got their marker (a worker killed during
    a save, before its peers could remove it): nothing resumes from them, and they hold a
    checkpoint's worth of disk. A host's part of a checkpoint across hosts has a marker of its own.
    """
    removed = []
    for directory in sorted(Path(work_dir).glob("checkpoint_state_step*")):
        if (
            directory.is_dir()
            and not directory.is_symlink()
            and not (directory / checkpointing.MARKER).exists()
        ):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    if removed:
        logger.warning(
            "Removed %s: save(s) interrupted before they were complete.",
            ", ".join(path.name for path in removed),
        )
    return removed


def _newest_on_this_host(config: TrainConfig) -> bool:
    """
    On one host: when the link is missing or dangling (Tango removes and re-creates it after each
    save, so a kill in between leaves none), point it at the newest complete checkpoint in the work
    directory, rather than let the run start over.
    """
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


def _agree_on_own_checkpoint(config: TrainConfig, hosts: HostWorld) -> bool:
    """
    Across hosts: point the link, on every host, at the newest checkpoint that every worker of
    every host can resume from (see :mod:`tango_fairscale.launch.multihost`), or remove it when there is none.
    """
    mine = multihost.resumable_steps(config.work_dir, config.world_size, config.worker_id, holds_worker_files)
    everyone: List[Dict[int, str]] = [{} for _ in range(config.world_size)]
    dist.all_gather_object(everyone, mine)
    step = multihost.agree(everyone)
    if config.is_local_main_process:
        _point_latest_at(config, step)
        if step is None and mine:
            logger.warning(
                "Host %d has checkpoints of steps %s, but none is complete on every host: training "
                "starts from the beginning.",
                hosts.node_rank,
                sorted(mine),
            )
        elif step is not None and max(mine) > step:
            logger.warning(
                "Host %d resumes from step %d, the newest checkpoint complete on every host "
                "(it has step %d, which another host did not finish).",
                hosts.node_rank,
                step,
                max(mine),
            )
    dist.barrier()
    return step is not None


def _point_latest_at(config: TrainConfig, step: Optional[int]) -> None:
    """Point this host's ``checkpoint_state_latest`` (and a newer ``..._best``) at ``step``."""
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


def link_resume_checkpoint(config: TrainConfig, source: Path, has_own_checkpoint: bool) -> None:
    """
    ``resume_from_checkpoint``: Tango resumes from ``checkpoint_state_latest`` in the step's work
    directory when it exists, right after constructing the engine; pointing that link at the
    requested checkpoint makes Tango restore the step count and data position as for any resume.
    """
    # Every worker looks before the link is created, so that all take the same branch
    # (and meet at the same barriers).
    dist.barrier()
    if has_own_checkpoint:
        logger.info("Resuming from this step's own checkpoint; ignoring resume_from_checkpoint")
        return
    try:
        source = checkpointing.resolve_checkpoint(source)
        marker = checkpointing.read_marker(source)
    except checkpointing.CheckpointError as error:
        raise ConfigurationError(f"resume_from_checkpoint: {error}") from None
    check_within_run(source, marker or {}, config.train_steps)
    # Each host's first worker: each host has its own work directory.
    if config.is_local_main_process:
        config.work_dir.mkdir(parents=True, exist_ok=True)
        if config.state_path.is_symlink():  # dangling: its target was removed
            config.state_path.unlink()
        config.state_path.symlink_to(source, target_is_directory=True)
    dist.barrier()


def check_within_run(checkpoint_dir: Path, marker: Mapping[str, Any], train_steps: Optional[int]) -> None:
    """
    ``resume_from_checkpoint`` of a step past the run's last: Tango would train nothing, save the
    checkpoint as the last step's and write ``weights.pt`` with the later step's weights, without a
    word. Applied in pre-flight and where the workers link the checkpoint (:func:`link_resume_checkpoint`).
    """
    step = marker.get("training_steps")
    if isinstance(step, bool) or not isinstance(step, int):
        step = multihost.step_of(checkpoint_dir)
    if train_steps is None or step is None or step <= train_steps:
        return
    raise ConfigurationError(
        f"training_engine.resume_from_checkpoint: {checkpoint_dir} is of step {step}, past this run's last "
        f"step (train_steps {train_steps}): nothing would be trained, and the weights saved as step "
        f"{train_steps}'s would be step {step}'s. Raise train_steps above {step} to train on from it, or "
        "remove resume_from_checkpoint to train from the start."
    )


def trainer_state_from_another_run(state: Dict[str, object]) -> Dict[str, object]:
    """
    A checkpoint of another run (``resume_from_checkpoint``) brings its step count, but its best
    validation metric was measured on that run's terms and its best checkpoint is not in this
    work directory: keep Tango from comparing against, or linking to, either.
    """
    state = dict(state)
    for key in list(state):
        if key.startswith(("val_", "best_")):
            state[key] = None
    state["callbacks"] = []
    return state
