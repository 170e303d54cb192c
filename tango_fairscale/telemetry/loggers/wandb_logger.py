"""
``fairscale::wandb``: a training run's metrics in Weights & Biases, on today's ``wandb`` client
(``pip install 'tango-fairscale[loggers]'``). One W&B run per training step, written by global
rank 0 with every worker's figures gathered into it (:class:`~.base.RankZeroLogger`), resumed by
a rerun of the step.
"""

import glob
import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import TrainCallback

from .base import RankZeroLogger

logger = logging.getLogger(__name__)

__all__ = ["WandbLogger", "default_run_id", "logged_steps_offline"]

#: W&B modes in which nothing reaches the server while the run lasts.
LOCAL_MODES = ("offline", "dryrun", "disabled")
#: The modes a config may give.
MODES = ("online", "offline", "disabled")


def check_writable_directory(owner: str, name: str, value: Any) -> None:
    """
    A callback's directory option: unset, or a directory this process can write in, or can create
    (its nearest existing parent is a directory it can write in). Nothing is created here.
    """
    if value is None:
        return
    path = Path(os.path.expanduser(str(value))).absolute()
    existing = next(candidate for candidate in (path, *path.parents) if candidate.exists())
    if not existing.is_dir():
        problem = "is a file" if existing == path else f"lies under {existing}, which is a file"
        raise ConfigurationError(
            f"{owner}: {name} {str(value)!r} {problem}: give a directory (or remove {name})."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        problem = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        raise ConfigurationError(
            f"{owner}: {name} {str(value)!r} {problem} by this user: give a directory you can write in "
            f"(or remove {name})."
        )


def default_run_id(step_id: str, work_dir: Path) -> str:
    """
    The W&B run id of a training step: the same for every rerun of the step in the same
    workspace (so a rerun resumes the run), another for the same step in another workspace.
    """
    digest = hashlib.sha256(f"{step_id}\n{Path(work_dir).resolve()}".encode()).hexdigest()
    return f"tfs-{digest[:24]}"


#: Seconds the W&B server has to answer before an online run logs offline instead.
SERVER_PROBE_SECONDS = 5.0


def server_unreachable(base_url: str, timeout: float = SERVER_PROBE_SECONDS) -> Optional[str]:
    """
    Why the W&B server at ``base_url`` cannot be reached (one phrase), or ``None`` when it
    answers within ``timeout`` seconds: any HTTP answer, an error status included, counts.
    """
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(base_url, method="HEAD"), timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        return f"the W&B server {base_url} did not answer within {timeout:g} s ({reason})"


def logged_steps_offline(wandb_dir: Path, run_id: str, exclude: Optional[Path] = None) -> List[int]:
    """
    The steps logged by earlier offline attempts of run ``run_id`` under ``wandb_dir`` (the
    ``wandb`` folder of a run's ``dir``): every history record's step, read from their
    ``run-<id>.wandb`` files with wandb's own reader (``wandb.sdk.internal.datastore``, as
    ``wandb sync`` reads them). A file that ends in a torn record (its writer was killed) counts
    up to it. ``exclude`` is the current attempt's directory.
    """
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    steps: List[int] = []
    for path in sorted(glob.glob(str(Path(wandb_dir) / f"*-{run_id}" / f"run-{run_id}.wandb"))):
        if exclude is not None and Path(path).parent.resolve() == Path(exclude).resolve():
            continue
        store = datastore.DataStore()
        try:
            store.open_for_scan(path)
            while True:
                data = store.scan_data()
                if data is None:
                    break
                record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
                record.ParseFromString(data)
                if record.WhichOneof("record_type") == "history":
                    steps.append(int(record.history.step.num))
        except Exception as error:  # noqa: BLE001 - a torn end: what came before it stands
            logger.debug("fairscale::wandb: %s ends early (%s)", path, error)
        finally:
            if store._fp is not None:  # the reader has no close for scanning
                store._fp.close()
    return steps


@TrainCallback.register("fairscale::wandb")
class WandbLogger(RankZeroLogger):
    """
    Logs the training step's metrics to Weights & Biases: one W&B run per ``torch::train`` step,
    written from global rank 0, with the loss, learning rate, throughput (samples/s, tokens/s),
    model FLOP/s, MFU, time in collectives and peak memory of the step, each worker's memory and
    throughput under ``worker<N>/``, and Tango's validation metric. The other workers' figures
    reach rank 0 through the rendezvous store, never a collective, so a slow or dead worker
    never holds the others up (see :class:`~tango_fairscale.telemetry.loggers.base.RankZeroLogger`). On one
    host and across hosts alike.

    .. tip::
        Registered as a :class:`~tango.integrations.torch.TrainCallback` under the name
        "fairscale::wandb". Add it with ``callbacks: [{type: "fairscale::wandb", project: "..."}]``;
        needs ``pip install 'tango-fairscale[loggers]'``. ``WANDB_MODE=offline`` keeps the run on
        disk (``wandb sync`` uploads it later).

    **Reruns.** The run id is derived from the step's unique id and its work directory
    (:func:`default_run_id`), so the rerun of a step that failed or was killed logs into the same
    run. It writes only the steps the run does not have yet: those after the server's last step
    (online), or after the last step the earlier attempts' offline directories hold (offline,
    where W&B keeps one directory per attempt with the same id: ``wandb sync`` them in order).
    Rows that a killed attempt gave W&B but W&B had not written yet are written again from a
    journal (``wandb/rows-<run id>.jsonl`` in ``dir``). So each step is logged once, even when the
    attempt that was killed had logged steps past the checkpoint the rerun resumes from (their
    first values stand).

    :param project: The W&B project. Default: W&B's (``WANDB_PROJECT``, else its own default).
    :param entity: The W&B entity (user or team). Default: W&B's.
    :param name: The run's display name. Default: the step's name.
    :param group: The run's group.
    :param tags: The run's tags.
    :param notes: The run's notes.
    :param config: Values to record as the run's config (the world size and the number of
        training steps are added).
    :param mode: ``"online"``, ``"offline"`` or ``"disabled"``. Default: W&B's (``WANDB_MODE``).
    :param dir: The directory W&B writes its files to. Default: the step's work directory.
    :param run_id: The W&B run id. Default: derived from the step (see above).
    The options of every logger, ``every`` (default: the step's ``log_every``), ``peak_tflops`` and
    ``final_wait_s``, are :class:`~tango_fairscale.telemetry.loggers.base.RankZeroLogger`'s.
    """

    NAME = "fairscale::wandb"
    REQUIRES = "wandb"

    def __init__(
        self,
        *args: Any,
        project: Optional[str] = None,
        entity: Optional[str] = None,
        name: Optional[str] = None,
        group: Optional[str] = None,
        tags: Optional[List[str]] = None,
        notes: Optional[str] = None,
        config: Optional[Dict[str, Any]] = None,
        mode: Optional[str] = None,
        dir: Optional[str] = None,
        run_id: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.check_options({"mode": mode, "dir": dir})
        self.project = project
        self.entity = entity
        self.name = name or self.train_config.step_name
        self.group = group
        self.tags = tags
        self.notes = notes
        self.config = dict(config or {})
        self.mode = mode
        self.dir = Path(dir) if dir is not None else Path(self.train_config.work_dir)
        self.run_id = run_id or default_run_id(self.train_config.step_id, self.train_config.work_dir)
        self.run: Any = None

    @classmethod
    def check_options(cls, options: Mapping[str, Any], train_steps: Optional[int] = None) -> None:
        super().check_options(options, train_steps)
        mode = options.get("mode")
        if mode is not None and mode not in MODES:
            raise ConfigurationError(
                f"{cls.NAME}: mode must be {', '.join(repr(m) for m in MODES)}, got {mode!r} (or remove it "
                "for W&B's own, WANDB_MODE)."
            )
        check_writable_directory(cls.NAME, "dir", options.get("dir"))

    def open(self, first_step: int) -> int:
        import wandb

        mode = self.mode or os.environ.get("WANDB_MODE") or "online"
        self.dir.mkdir(parents=True, exist_ok=True)
        if mode == "online":
            # W&B reads WANDB_BASE_URL when it sets up, not when Settings() is made.
            base_url = os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url
            unreachable = server_unreachable(base_url)
            if unreachable is not None:
                # W&B's own client retries for minutes (its init_timeout does not bound the login
                # it does first), while every other worker waits at the next collective.
                logger.warning(
                    "%s: %s: logging offline to %s instead; upload it later with `wandb sync %s`.",
                    self.NAME,
                    unreachable,
                    self.dir / "wandb",
                    self.dir / "wandb" / "offline-run-*",
                )
                mode = "offline"
        local = mode in LOCAL_MODES
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.name,
            group=self.group,
            tags=self.tags,
            notes=self.notes,
            config={
                "world_size": self.world_size,
                "train_steps": self.train_config.train_steps,
                **self.config,
            },
            mode=mode,  # type: ignore[arg-type]
            dir=str(self.dir),
            id=self.run_id,
            # Offline, W&B ignores resume (with a warning): every attempt is a directory of its own.
            resume=None if local else "allow",
        )
        if local:
            earlier = logged_steps_offline(self.dir / "wandb", self.run_id, exclude=Path(self.run.dir).parent)
            return max(earlier, default=0)
        # The server's next step: what an earlier attempt logged stands.
        return int(self.run.step) - 1 if self.run.resumed else 0

    def journal_path(self) -> Optional[Path]:
        # W&B's service writes a row a moment after log() returns: a killed run loses its last rows.
        return self.dir / "wandb" / f"rows-{self.run_id}.jsonl"

    def write(self, step: int, row: Dict[str, float]) -> None:
        if self.run is not None:
            self.run.log(row, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
