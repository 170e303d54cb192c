"""
The patches of Hugging Face ``transformers`` (H1, H2), each applied when the module it changes is
first imported, by an import hook: a process that never imports ``transformers`` (seconds to
import) never does here either, and its version is checked then, not at import.
"""

import functools
import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Set

import torch.nn as nn

from .checks import IncompatibleVersionError, _require_attributes, check_version

# --- H1, H2: Hugging Face transformers, in the processes that import it ---------------------------------


class _ImportHooks(importlib.abc.MetaPathFinder):
    """
    Runs a function just before a named module is first executed (``before``), or just after
    (``after``, given the module), whoever imports it. First on ``sys.meta_path``, it only looks at
    the names it has hooks for and then leaves finding the module to the finders after it.
    """

    def __init__(self) -> None:
        self.before: Dict[str, List[Callable[[], None]]] = {}
        self.after: Dict[str, List[Callable[[ModuleType], None]]] = {}
        # The names being looked up by the other finders on our behalf (the import lock of each
        # name is held meanwhile, so one thread at a time).
        self._finding: Set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname in self._finding or (fullname not in self.before and fullname not in self.after):
            return None
        for hook in self.before.get(fullname, ()):
            hook()  # an error here is the import's error
        after = self.after.get(fullname)
        if not after:
            return None
        self._finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            for hook in after:
                hook(module)

        # On this module's own loader object: its type, and what reads it, are unchanged.
        loader.exec_module = exec_module
        return spec


_import_hooks: Optional[_ImportHooks] = None
_import_hooks_lock = threading.Lock()


def _when_imported(name: str, hook: Callable[[ModuleType], None]) -> None:
    """``hook(module)`` now if ``name`` is imported, else right after it is."""
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    _hooks().after.setdefault(name, []).append(hook)


def _before_import(name: str, hook: Callable[[], None]) -> None:
    """``hook()`` before ``name`` is executed, each time an import of it is attempted (idempotent hooks)."""
    if name not in sys.modules:
        _hooks().before.setdefault(name, []).append(hook)


def _hooks() -> _ImportHooks:
    global _import_hooks
    with _import_hooks_lock:
        if _import_hooks is None:
            _import_hooks = _ImportHooks()
            sys.meta_path.insert(0, _import_hooks)
        return _import_hooks


#: The module of Tango's that imports ``Conv1D`` from where ``transformers`` 4.57 no longer has it.
TANGO_IA3_MODULE = "tango.integrations.transformers.ia3"


# H1 upstream: none found
def _alias_conv1d() -> None:
    """
    H1, before Tango's ``ia3`` module runs: ``transformers.modeling_utils.Conv1D`` becomes the
    class that module means, ``transformers.pytorch_utils.Conv1D`` (which GPT-2's attention and MLP
    layers are, so its ``isinstance`` checks still find them). Where ``transformers`` still has
    the name there, nothing changes.
    """
    from transformers import modeling_utils, pytorch_utils

    if hasattr(modeling_utils, "Conv1D"):
        return
    check_version("transformers")
    _require_attributes(pytorch_utils, ("Conv1D",), "H1")
    conv1d = pytorch_utils.Conv1D
    if not (isinstance(conv1d, type) and issubclass(conv1d, nn.Module)):
        raise IncompatibleVersionError(
            f"tango-fairscale patch H1 aliases transformers.pytorch_utils.Conv1D, which is {conv1d!r} "
            "here, not a torch module class: the library changed. Install the versions in pyproject.toml."
        )
    modeling_utils.Conv1D = conv1d  # type: ignore[attr-defined]


#: H2's two functions: whether this thread builds on meta, and the loader to call then.
_building_on_meta: Optional[Callable[[], bool]] = None
_load_on_meta: Optional[Callable[..., Any]] = None


# H2 upstream: the same loss under torch.device("meta"), huggingface/transformers#36309
def _route_from_pretrained(modeling_utils: ModuleType) -> None:
    """H2: ``PreTrainedModel.from_pretrained`` calls the meta loader in a thread that builds on meta."""
    _require_attributes(modeling_utils, ("PreTrainedModel",), "H2")
    model_class = modeling_utils.PreTrainedModel
    descriptor = model_class.__dict__.get("from_pretrained")
    if not isinstance(descriptor, classmethod):
        raise IncompatibleVersionError(
            "tango-fairscale patch H2 wraps transformers.PreTrainedModel.from_pretrained, which is not a "
            "classmethod here: the library changed. Install the versions in pyproject.toml."
        )
    original: Callable[..., Any] = descriptor.__func__
    if getattr(original, "_tango_fairscale", False):
        return

    @functools.wraps(original)
    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if _building_on_meta is None or _load_on_meta is None or not _building_on_meta():
            return original(cls, *args, **kwargs)
        # Only the routing depends on what transformers' loading does: checked where it happens.
        check_version("transformers")
        return _load_on_meta(cls, *args, **kwargs)

    from_pretrained._tango_fairscale = True  # type: ignore[attr-defined]
    model_class.from_pretrained = classmethod(from_pretrained)


_install_lock = threading.Lock()


def install_transformers_patches(
    building_on_meta: Callable[[], bool], load_on_meta: Callable[..., Any]
) -> None:
    """
    H1 and H2, each applied when the module it changes is first imported (at once if it already
    is). ``load_on_meta(model_class, *args, **kwargs)`` takes over ``from_pretrained``'s call in a
    thread where ``building_on_meta()`` is true (H2). Idempotent.
    """
    global _building_on_meta, _load_on_meta
    with _install_lock:
        first = _building_on_meta is None
        _building_on_meta, _load_on_meta = building_on_meta, load_on_meta
        if not first:
            return
    _before_import(TANGO_IA3_MODULE, _alias_conv1d)
    _when_imported("transformers.modeling_utils", _route_from_pretrained)
