"""
The integration boundary: every change this package makes to FairScale, Tango, torch or
Hugging Face ``transformers``.

Nothing here happens at import, and nothing here is the package's logic: T1 and T2 route Tango's
step and worker functions to :mod:`tango_fairscale.train_step`, which :func:`install` is given.
Each patch is installed explicitly, by one function, which
first checks that the library it patches is inside the supported range (``pyproject.toml``'s;
no release inside it is refused as a whole) and that every attribute it rebinds is there, and
refuses with an error naming both otherwise. Where torch releases differ, a patch picks its
variant by a flag of :mod:`tango_fairscale.versions`; where a release lacks a patch's target, only
the feature that needs it is turned off (:func:`tango_fairscale.versions.feature_unavailable`).
``tests/test_canaries.py`` shows, per patch, that the upstream defect is still there:

- :func:`install` (called once by ``import tango_fairscale``) installs what every process
  needs: the step patches (T1, T2), the checkpoint autocast fix (F5), the input cast fix (F6),
  frozen and trainable parameters in one unit (F7), a single worker's mixed-precision gradients
  (F10), a stopped step told once (T6), a step's config mistake told in one line (T8) and the
  warning filters (W1-W5).
- :func:`enable_cpu_fsdp` installs F1-F4 and F9 in a process whose FSDP units compute on the CPU (the
  FairScale backend calls it before wrapping on a CPU worker); GPU workers never call it, so
  their FairScale code path is unchanged. :func:`disable_cpu_fsdp` undoes it (for tests).
- :func:`enable_cpu_fsdp2` installs S1 in a process whose FSDP2 units compute on the CPU (the
  torch backend calls it before sharding on a CPU mesh); :func:`disable_cpu_fsdp2` undoes it.
- :func:`meta_parameter_registration` is the one torch patch (P1), active only while the
  engine builds a model with ``init_on_meta``.
- :func:`install_transformers_patches` (called once by ``import tango_fairscale``) registers H1
  and H2, which are applied only when the module they change is imported (``transformers`` costs
  seconds to import: a process that does not use it never does), and check the ``transformers``
  version then (:data:`CHECKED_WHEN_USED`), not at import.

Each patch has an ID (F: FairScale, T: Tango, W: a warnings filter, D: torch's distributed
checkpoint, P: torch's module and ``nn.init`` functions, S: torch's FSDP2, H: ``transformers``),
which the function that installs it names in its checks and errors. The one list of the patches,
with each one's target, what installs it and why, is the table in ``docs/architecture.md`` ("The integration
boundary"); a new patch gets its row there (``tests/test_docs.py`` checks that every ID named here
has one).

Registration over the bundled integration's names (``exist_ok=True``) is in :mod:`.registry`.

Where each patch is (one module per library patched):

- :mod:`.checks`: what every patch checks first (the library's release, the attributes and
  signatures it rebinds), and :class:`IncompatibleVersionError`;
- :mod:`.fairscale_patches`: F1, F2, F3, F4, F9 (CPU workers), F5, F6, F7, F10 (every process;
  F8 is F7's hook, in ``compat/fairscale_flat_groups.py``);
- :mod:`.tango_patches`: T1, T2, T3, T4, T5, T6, T7, T8, T9;
- :mod:`.warning_filters`: W1, W2, W3, W4, W5;
- :mod:`.torch_patches`: S1, P1, D1;
- :mod:`.transformers_patches`: H1, H2 (and the import hook that applies them);
- :mod:`.installing`: :func:`install`.
"""

from .checks import (
    CHECKED_VERSIONS,
    CHECKED_WHEN_USED,
    SKIP_VERSION_CHECK_VARIABLE,
    TORCH_RANGE,
    IncompatibleVersionError,
    check_version,
    signature_matches,
)
from .fairscale_patches import cpu_fsdp_enabled, disable_cpu_fsdp, enable_cpu_fsdp
from .installing import install
from .tango_patches import (
    SPAWN_GRACE_SECONDS,
    extra_imported_modules,
    final_weights_from_disk,
    process_group_already_started,
    progress_bars_off,
    spawn_grace,
)
from .torch_patches import (
    META_SKIPPING_INITIALISERS,
    check_dcp_planner_overrides,
    cpu_fsdp2_available,
    cpu_fsdp2_enabled,
    disable_cpu_fsdp2,
    enable_cpu_fsdp2,
    meta_parameter_registration,
    meta_skipping_initialisers,
)
from .transformers_patches import TANGO_IA3_MODULE, install_transformers_patches
from .transformers_patches import _alias_conv1d as _alias_conv1d  # H1 alone, for its test
from .warning_filters import silence_internal_warnings

__all__ = [
    "CHECKED_VERSIONS",
    "CHECKED_WHEN_USED",
    "IncompatibleVersionError",
    "META_SKIPPING_INITIALISERS",
    "SKIP_VERSION_CHECK_VARIABLE",
    "SPAWN_GRACE_SECONDS",
    "TANGO_IA3_MODULE",
    "TORCH_RANGE",
    "check_dcp_planner_overrides",
    "check_version",
    "cpu_fsdp2_available",
    "cpu_fsdp2_enabled",
    "cpu_fsdp_enabled",
    "disable_cpu_fsdp",
    "disable_cpu_fsdp2",
    "enable_cpu_fsdp",
    "enable_cpu_fsdp2",
    "extra_imported_modules",
    "final_weights_from_disk",
    "install",
    "install_transformers_patches",
    "meta_parameter_registration",
    "meta_skipping_initialisers",
    "process_group_already_started",
    "progress_bars_off",
    "signature_matches",
    "silence_internal_warnings",
    "spawn_grace",
]
