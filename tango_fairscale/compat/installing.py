"""
:func:`install`: the patches every process needs, installed once by ``import tango_fairscale``
(the step's routing T1-T3, T6, T8; FairScale's F5-F7, F10; the warnings filters W1-W5).
"""

import threading
from typing import Optional

from .checks import CHECKED_VERSIONS, check_version
from .fairscale_patches import (
    _install_checkpoint_autocast,
    _install_flat_groups,
    _install_root_input_cast,
    _install_unsharded_grad_cast,
)
from .tango_patches import (
    StepLogic,
    _one_line_step_config_errors,
    _quiet_integration_search,
    _quiet_reported_stops,
    _wrap_train_step,
    route_steps_to,
)
from .warning_filters import silence_internal_warnings

_install_lock = threading.Lock()
_installed = False


def install(
    step_logic: StepLogic, worker_logic: StepLogic, config_error_logic: Optional[StepLogic] = None
) -> None:
    """
    Install the patches every process needs (T1-T3, T6, T8, F5-F7, F10, W1-W5), once; ``import
    tango_fairscale`` calls it with the step's logic (:mod:`tango_fairscale.train_step`): what
    the rebound step (``step_logic(original, step, *args, **kwargs)``) and worker
    (``worker_logic(original, process_index, *args, **kwargs)``) functions run, and what tells a
    step's construction error in one line (``config_error_logic(type_name, keys, error)``, T8).
    """
    global _installed
    with _install_lock:
        route_steps_to(step_logic, worker_logic, config_error_logic)
        if _installed:
            return
        for distribution in (*CHECKED_VERSIONS, "torch"):
            check_version(distribution)
        _install_checkpoint_autocast()
        _install_root_input_cast()
        _install_flat_groups()
        _install_unsharded_grad_cast()
        _wrap_train_step()
        _quiet_integration_search()
        silence_internal_warnings()
        _quiet_reported_stops()
        _one_line_step_config_errors()
        _installed = True
