"""
The patches of Tango: its ``torch::train`` step and worker functions routed to the step's logic
(T1, T2), its registry's search (T3), a stopped step told once (T6), a step's config mistake told
in one line (T8), and its progress bars (T9); and what the step's logic opens around Tango's
``_train``: the process group already started (T5), a grace period for the spawned workers (T4)
and the final weights loaded from disk (T7).
"""

import functools
import importlib
import inspect
import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from .checks import IncompatibleVersionError, _require_attributes, _require_signature

logger = logging.getLogger(__name__)


# --- T1, T2: Tango's torch::train step and its workers ----------------------------------------------

#: What the rebound step and worker functions call: the step's logic, plain code that
#: :func:`~tango_fairscale.compat.install` is given (:mod:`tango_fairscale.train_step`), so that this
#: module imports none of it.
StepLogic = Callable[..., Any]
_step_logic: Optional[StepLogic] = None
_worker_logic: Optional[StepLogic] = None


def route_steps_to(
    step_logic: StepLogic, worker_logic: StepLogic, config_error_logic: Optional[StepLogic]
) -> None:
    """What T1's step, T2's worker and T8's error call from now on (``compat.install`` gives them)."""
    global _step_logic, _worker_logic, _config_error_logic
    _step_logic, _worker_logic = step_logic, worker_logic
    _config_error_logic = config_error_logic


# T1 upstream: none found
# T2 upstream: the exit abort, pytorch/pytorch#179291 (abandoned)
def _wrap_train_step() -> None:
    """T1 and T2: Tango's step and worker functions call the step's logic, with the originals."""
    from tango.integrations.torch import train as tango_train

    _require_attributes(tango_train, ("TorchTrainStep", "_train"), "T1/T2")
    _require_attributes(tango_train.TorchTrainStep, ("_train",), "T1")
    step_class = tango_train.TorchTrainStep
    original: Callable[..., Any] = step_class._train
    if getattr(original, "_tango_fairscale", False):
        return

    @functools.wraps(original)
    def _train(self: Any, *args: Any, **kwargs: Any) -> Any:
        assert _step_logic is not None  # set by install() before this is bound
        return _step_logic(original, self, *args, **kwargs)

    _train._tango_fairscale = True  # type: ignore[attr-defined]
    step_class._train = _train  # type: ignore[method-assign]
    # T2: a module-level function (not functools.wraps'd), so that mp.spawn pickles it by its own
    # name: the spawned worker imports tango_fairscale to find it, which installs the patches there.
    global _original_train_worker
    if tango_train._train is not _train_worker:
        _original_train_worker = tango_train._train
        tango_train._train = _train_worker  # type: ignore[assignment]


#: Tango's worker function, as it was before T2 rebound it.
_original_train_worker: Optional[Callable[..., Any]] = None


def _train_worker(process_index: int, workspace: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
    """T2: Tango's worker function (``tango.integrations.torch.train._train``), which ``mp.spawn`` runs."""
    original = _original_train_worker
    if original is None:  # T2 not installed in this process: Tango's own function is still there
        from tango.integrations.torch import train as tango_train

        original = tango_train._train
    assert _worker_logic is not None  # the worker imported tango_fairscale, which installed it
    return _worker_logic(original, process_index, workspace, config, *args, **kwargs)


def extra_imported_modules() -> Any:
    """T1 (a): the set of modules Tango re-imports in its spawned workers (Tango's own object)."""
    from tango.common import util as tango_util

    _require_attributes(tango_util, ("get_extra_imported_modules",), "T1")
    return tango_util.get_extra_imported_modules()


# T5 upstream: none found
@contextmanager
def process_group_already_started(config: Any) -> Iterator[None]:
    """
    T5: while Tango's engine constructor runs. It starts the process group itself when the config
    is distributed (with no timeout); the engine has started it already, with one, and a second
    start is an error. So the constructor sees the config as not distributed: nothing else in it
    reads the flag (checked against ai2-tango 1.3's ``TorchTrainingEngine.__init__``).
    """
    _require_attributes(config, ("is_distributed",), "T5")
    distributed = config.is_distributed
    config.is_distributed = False
    try:
        yield
    finally:
        config.is_distributed = distributed


# --- T3: Tango's search for a registered name ---------------------------------------------------------


# T3 upstream: none found
def _quiet_integration_search() -> None:
    """
    When a config names an unregistered type, Tango imports each of its bundled integrations to
    look for it, skipping those whose dependencies are missing, but only when the integration
    itself says so: its ``transformers`` integration fails with ``No module named 'datasets'``
    whenever ``transformers`` is installed without ``datasets`` (the examples extra without hf), and
    that error replaced Tango's "not a registered name" answer to a typo. While Tango imports an
    integration in that search, an import error for another, absent top-level package becomes the
    ``IntegrationMissingError`` Tango already skips.
    """
    from tango.common import registrable
    from tango.common.exceptions import IntegrationMissingError

    _require_attributes(registrable, ("import_module_and_submodules",), "T3")
    original = registrable.import_module_and_submodules
    if getattr(original, "_tango_fairscale", False):
        return

    @functools.wraps(original)
    def import_module_and_submodules(package_name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(package_name, *args, **kwargs)
        except ImportError as error:
            missing = (error.name or "").split(".")[0]
            if not package_name.startswith("tango.integrations.") or not missing or missing == "tango":
                raise
            raise IntegrationMissingError(package_name.rsplit(".", 1)[-1], {missing}) from error

    import_module_and_submodules._tango_fairscale = True  # type: ignore[attr-defined]
    registrable.import_module_and_submodules = import_module_and_submodules


# --- T6: a stopped step, told once ---------------------------------------------------------------------


# T6 upstream: none found
def _quiet_reported_stops() -> None:
    """
    T6: SIGINT or SIGTERM ends a step with
    :class:`~tango_fairscale.launch.signals.TrainingStopped` after its handler logged one line
    (what stopped the run, how to resume). Tango's step logs every exception that leaves
    ``run()`` (``Step.log_failure``): a ``SystemExit`` as "Uncaught exception" with its traceback,
    then "Step failed"; the run's log capture (``insert_handlers``) logs it again unless Tango
    counts it as logged. For this one exception, unless the step's logger is at debug level, the
    wrapper logs nothing and adds it to Tango's own list of logged exceptions
    (``tango.common.logging._EXCEPTIONS_LOGGED``, which ``log_exception`` consults). Everything
    else Tango does with it (recording the step as failed) is unchanged.
    """
    from tango.common import logging as tango_logging
    from tango.step import Step

    from ..launch.signals import STOPPED_HOOKS, TrainingStopped

    _require_attributes(Step, ("log_failure",), "T6")
    _require_attributes(tango_logging, ("_EXCEPTIONS_LOGGED",), "T6")
    if not isinstance(tango_logging._EXCEPTIONS_LOGGED, list):
        raise IncompatibleVersionError("T6: tango.common.logging._EXCEPTIONS_LOGGED is no longer a list.")
    original = Step.log_failure
    if getattr(original, "_tango_fairscale", False):
        return

    @functools.wraps(original)
    def log_failure(self: Any, exception: Optional[BaseException] = None) -> None:
        if isinstance(exception, TrainingStopped) and not self.logger.isEnabledFor(logging.DEBUG):
            tango_logging._EXCEPTIONS_LOGGED.append(exception)
            return
        original(self, exception)

    log_failure._tango_fairscale = True  # type: ignore[attr-defined]
    Step.log_failure = log_failure  # type: ignore[method-assign]

    def count_as_logged(stopped: BaseException) -> None:
        # A stop outside any step (between two steps) reaches the run's log capture without
        # passing log_failure: counted as logged as soon as its line is (unless debugging).
        if not logging.getLogger("tango").isEnabledFor(logging.DEBUG):
            tango_logging._EXCEPTIONS_LOGGED.append(stopped)

    STOPPED_HOOKS.append(count_as_logged)


# --- T9: Tango's progress bars off where progress goes out as lines -----------------------------------


# T9 upstream: none found
def progress_bars_off() -> None:
    """
    T9: in this process from now on, Tango's progress bars (``tango.common.tqdm.Tqdm.tqdm``: the
    training loop's, the validation's, catching the data loader up, the checkpoint's) are created
    disabled: a worker whose standard error is no terminal prints its progress as lines instead
    (:mod:`tango_fairscale.telemetry.progress`). Tango's bar passes ``disable`` itself (off on
    workers other than the first), so neither tqdm's ``TQDM_DISABLE`` nor Tango's
    ``FILE_FRIENDLY_LOGGING`` (a cleaned bar every 2 s, and again in the log every 10 s) can do it.
    """
    from tango.common.tqdm import Tqdm

    _require_attributes(Tqdm, ("tqdm",), "T9")
    original = Tqdm.__dict__["tqdm"]
    function = getattr(original, "__func__", original)
    if getattr(function, "_tango_fairscale", False):
        return

    @functools.wraps(function)
    def tqdm(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **{**kwargs, "disable": True})

    tqdm._tango_fairscale = True  # type: ignore[attr-defined]
    Tqdm.tqdm = staticmethod(tqdm)  # type: ignore[method-assign,assignment]


#: T8's logic: the one-line error (or None) for a step's construction error; set by
#: :func:`~tango_fairscale.compat.install`.
_config_error_logic: Optional[StepLogic] = None


def _step_type_and_keys(params: Any) -> Tuple[Any, List[str]]:
    if isinstance(params, str):
        return params, []
    if hasattr(params, "get") and hasattr(params, "keys"):  # a dict or Tango's Params
        return params.get("type"), [str(key) for key in params.keys()]
    return None, []


# T8 upstream: none found
def _one_line_step_config_errors() -> None:
    """
    T8: an option that is not one, or a value of the wrong type, in the config of one of the
    package's steps (``fairscale::tokenize_text``, ``fairscale::evaluate``): Tango's
    ``Step.from_params`` raised it inside a 38-42-line traceback ("Extra parameters passed to
    TokenizeText", "Expected block_size to be int"); the wrapper raises the one line the logic
    gives (with the nearest option), a ``CliRunError`` that Tango prints alone. Other steps'
    errors, and anything the logic does not recognise, pass unchanged.
    """
    from tango.common.exceptions import ConfigurationError
    from tango.step import Step

    _require_attributes(Step, ("from_params",), "T8")
    original = inspect.getattr_static(Step, "from_params")
    if not isinstance(original, classmethod):
        raise IncompatibleVersionError("T8: tango.step.Step.from_params is no longer a classmethod.")
    function = original.__func__
    if getattr(function, "_tango_fairscale", False):
        return

    @functools.wraps(function)
    def from_params(cls: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        type_name, keys = _step_type_and_keys(params)
        try:
            return function(cls, params, *args, **kwargs)
        except (TypeError, ConfigurationError) as error:
            one_line = None if _config_error_logic is None else _config_error_logic(type_name, keys, error)
            if one_line is None:
                raise
            raise one_line from error

    from_params._tango_fairscale = True  # type: ignore[attr-defined]
    Step.from_params = classmethod(from_params)  # type: ignore[method-assign,assignment]


def undo_step_config_errors() -> None:
    """Undo T8 (for the canary test)."""
    from tango.step import Step

    current = inspect.getattr_static(Step, "from_params")
    wrapped = getattr(current.__func__, "__wrapped__", None)
    if getattr(current.__func__, "_tango_fairscale", False) and wrapped is not None:
        Step.from_params = classmethod(wrapped)  # type: ignore[method-assign,assignment]


# --- T4: how long Tango's step waits for workers after one failed ---------------------------------------

#: Seconds ``mp.spawn`` gives the other workers after one failed: to exit by themselves, then
#: again after SIGTERM, before SIGKILL.
SPAWN_GRACE_SECONDS = 5.0

_spawn_grace_lock = threading.Lock()
#: How many ``spawn_grace`` blocks are open, in all threads; the rebinding lives while any is.
_spawn_grace_blocks = 0
#: ``ProcessContext.join`` as it was before the first open block rebound it.
_spawn_join_original: Optional[Callable[..., Any]] = None
#: Per thread: how many ``spawn_grace`` blocks this thread is inside.
_spawn_grace_local = threading.local()


def _spawn_grace_depth() -> int:
    depth: int = getattr(_spawn_grace_local, "depth", 0)
    return depth


# T7 upstream: none found
@contextmanager
def final_weights_from_disk(path: Path, load_final_weights: Callable[..., Any]) -> Iterator[None]:
    """
    T7: inside, this thread's ``torch.load`` of ``path`` (Tango's load of the step's
    ``weights.pt`` into the step's result, in its main process, after the workers) goes to
    ``load_final_weights(torch.load, path, ...)``
    (:func:`tango_fairscale.step_result.load_final_weights`: the tensors views of a shared
    mapping of a private copy, not a private copy in memory). Every other load, and every other
    thread's, is passed through unchanged; ``torch.load`` is restored when the block ends.
    Tango's ``_train`` calls ``torch.load`` as an attribute of the ``torch`` module, so only that
    name reaches it. The step's logic opens it around Tango's ``_train``
    (:func:`tango_fairscale.train_step.run_step`).
    """
    _require_attributes(torch, ("load",), "T7")
    _require_attributes(torch.serialization, ("set_default_mmap_options",), "T7")
    original = torch.load
    target = Path(path).resolve()
    thread = threading.get_ident()
    # Off once the block ends, should another patch have rebound torch.load over this one meanwhile.
    active = [True]

    @functools.wraps(original)
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            active[0]
            and threading.get_ident() == thread
            and isinstance(f, (str, os.PathLike))
            and Path(f).resolve() == target
            and not kwargs.get("mmap")
        ):
            return load_final_weights(original, Path(f), *args, **kwargs)
        return original(f, *args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        active[0] = False
        if torch.load is load:
            torch.load = original


# T4 upstream: ProcessContext.join takes a grace period, mp.spawn none: pytorch/pytorch#131278
@contextmanager
def spawn_grace() -> Iterator[None]:
    """
    T4: inside, ``torch.multiprocessing``'s spawn contexts joined by this thread without a grace
    period (as Tango's step calls ``mp.spawn``) get :data:`SPAWN_GRACE_SECONDS`. When one of
    Tango's workers fails, the spawn context sends the others SIGTERM and waits 30 s before
    SIGKILL; a worker that hangs (stopped, or stuck in C++ code that never returns to Python's
    signal handling) ignores SIGTERM, so every such failure cost 30 s more than the
    ``collective_timeout`` that detected it. ``mp.spawn`` takes no grace period, so Tango's step
    cannot be given one: ``ProcessContext.join`` is rebound while a block is open (in any thread:
    counted, so one thread leaving cannot remove it under another), and restored when the last one
    ends; other threads' joins, and joins given a grace period, are passed through unchanged.
    The step's logic opens it around Tango's ``_train`` (:func:`tango_fairscale.train_step.run_step`).
    """
    global _spawn_grace_blocks, _spawn_join_original
    # The module: ``torch.multiprocessing.spawn`` as an attribute is the function of that name.
    spawn = importlib.import_module("torch.multiprocessing.spawn")
    with _spawn_grace_lock:
        if _spawn_grace_blocks == 0:
            _require_attributes(spawn, ("ProcessContext",), "T4")
            _require_attributes(spawn.ProcessContext, ("join",), "T4")
            original = spawn.ProcessContext.join
            _require_signature(original, ("self", "timeout", "grace_period"), "T4")

            @functools.wraps(original)
            def join(self: Any, timeout: Optional[float] = None, grace_period: Optional[float] = None) -> Any:
                if grace_period is None and _spawn_grace_depth() > 0:
                    grace_period = SPAWN_GRACE_SECONDS
                return original(self, timeout, grace_period)

            join._tango_fairscale = True  # type: ignore[attr-defined]
            spawn.ProcessContext.join = join  # type: ignore[method-assign]
            _spawn_join_original = original
        _spawn_grace_blocks += 1
    _spawn_grace_local.depth = _spawn_grace_depth() + 1
    try:
        yield
    finally:
        _spawn_grace_local.depth -= 1
        with _spawn_grace_lock:
            _spawn_grace_blocks -= 1
            if _spawn_grace_blocks == 0:
                if getattr(spawn.ProcessContext.join, "_tango_fairscale", False):
                    spawn.ProcessContext.join = _spawn_join_original  # type: ignore[method-assign]
                else:  # rebound again by someone else meanwhile: theirs is left in place
                    logger.warning("ProcessContext.join was rebound during a step: left as it is (T4)")
                _spawn_join_original = None
