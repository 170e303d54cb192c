"""
The step's result, the trained model, built in Tango's main process with one copy of the weights.

After the workers finish, Tango's ``torch::train`` builds the model again in its main process
(``model.construct()``), reads ``weights.pt`` (``torch.load``) and copies it in
(``load_state_dict``): the initialised model and the loaded state dict, two copies of the weights
at once, where training needed only a shard of them per worker. :class:`FinalModelOnMeta` stands
in for the step's ``Lazy`` model there (:mod:`tango_fairscale.compat`, T1): the model is built
with its parameters on ``meta`` (no memory), and Tango's one ``load_state_dict`` call adopts the
loaded tensors (``assign=True``) instead of copying them. The result is the same model, with the
same weights, tied parameters still tied, loadable the way Tango loads step results.
"""

import logging
import mmap
import os
import re
import shutil
import sys
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Tuple

import torch
import torch.nn as nn
from tango.common import Lazy

from .cpu.memory import META_BUILD_MMAP_THRESHOLD_BYTES, limit_cpu_heap_growth
from .materialize import has_meta_parameters, materialize_module, parameters_on_meta

logger = logging.getLogger(__name__)


def _tied_groups(model: nn.Module) -> List[List[str]]:
    """The names of each parameter reachable under more than one name (tied weights), in order."""
    names: Dict[int, List[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return [group for group in names.values() if len(group) > 1]


def _owner(model: nn.Module, name: str) -> Tuple[nn.Module, str]:
    module_path, _, attribute = name.rpartition(".")
    return (model.get_submodule(module_path) if module_path else model), attribute


def assign_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = False) -> Any:
    """
    ``model.load_state_dict(state_dict, strict=strict, assign=True)`` for a model built with its
    parameters on ``meta``: the model takes the state dict's tensors as they are (no copy), and
    parameters tied in the model (one ``Parameter`` under several names) stay one ``Parameter``.
    A parameter the state dict does not hold is allocated and initialised as ``init_on_meta``
    does (:func:`~tango_fairscale.materialize.materialize_module`), with a warning naming it.
    Returns what ``load_state_dict`` returns.
    """
    tied = _tied_groups(model)
    result = model.load_state_dict(state_dict, strict=strict, assign=True)
    for group in tied:
        first_owner, first_attribute = _owner(model, group[0])
        shared = first_owner._parameters[first_attribute]
        for name in group[1:]:
            owner, attribute = _owner(model, name)
            owner._parameters[attribute] = shared
    if has_meta_parameters(model):
        missing = [name for name, param in model.named_parameters() if param.is_meta]
        logger.warning(
            "The final weights hold no value for %s: initialised as init_on_meta does.",
            ", ".join(missing[:5]),
        )
        materialize_module(model, torch.device("cpu"))
    return result


class _AssignOnce:
    """
    The model's ``load_state_dict`` for Tango's one call after building the final model: assigns
    (:func:`assign_state_dict`), then removes itself, so the model pickles as it was built.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        del self.model.load_state_dict  # the instance attribute: the class's method is back
        return assign_state_dict(self.model, state_dict, strict=strict)


class FinalModelOnMeta(Lazy):
    """
    The step's ``Lazy`` model, as Tango's main process builds it after training: on ``meta``,
    with one :func:`assign_state_dict` for the load that follows. Pickles as the ``Lazy`` it wraps
    (the spawned workers get that one), and builds as it does where the model cannot be built on
    ``meta``.
    """

    def __init__(self, lazy: Lazy) -> None:
        super().__init__(lazy._constructor, lazy._params, lazy._constructor_extras)
        self.lazy = lazy

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_unwrapped, (self.lazy,))

    def construct(self, **kwargs: Any) -> Any:
        try:
            # Not recorded: every parameter takes weights.pt's tensor, so replaying the
            # constructor's initialisation (an eager init's time) would be wasted.
            # Each parameter allocated on the CPU and moved to meta leaves no heap behind it.
            with limit_cpu_heap_growth(META_BUILD_MMAP_THRESHOLD_BYTES), parameters_on_meta(record=False):
                model = self.lazy.construct(**kwargs)
        except Exception as error:  # noqa: BLE001 - a model that needs real tensors to build
            logger.debug("The final model does not build on the meta device (%s): building it whole", error)
            return self.lazy.construct(**kwargs)
        if isinstance(model, nn.Module) and has_meta_parameters(model):
            # nn.Module.__setattr__ keeps a plain callable in the instance dict, ahead of the method.
            model.load_state_dict = _AssignOnce(model)  # type: ignore[method-assign]
        return model


class _StayOnce:
    """
    The model's ``cpu`` for Tango's one call on its one-process route, which moves the model to the
    CPU before loading ``weights.pt``: a model on ``meta`` stays there (the load assigns CPU
    tensors). Removes itself, as :class:`_AssignOnce` does.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self) -> nn.Module:
        del self.model.cpu  # the instance attribute: the class's method is back
        return self.model


def spawned_workers_result(model: Any) -> Any:
    """
    What Tango's one-process route of ``torch::train`` (one device) gets back from its worker
    function where that function spawned the worker (one worker per host across hosts): the
    final model, built as Tango's distributed route builds it (``model.construct()``; on ``meta``
    for a :class:`FinalModelOnMeta`), which that route then moves to the CPU and loads
    ``weights.pt`` into.
    """
    final = model.construct() if isinstance(model, Lazy) else model
    if isinstance(final, nn.Module) and has_meta_parameters(final):
        final.cpu = _StayOnce(final)  # type: ignore[method-assign]
    return final


def _unwrapped(lazy: Lazy) -> Lazy:
    """What a :class:`FinalModelOnMeta` unpickles as: the ``Lazy`` it wrapped."""
    return lazy


def finish_result(model: Any) -> Any:
    """
    The step's result as Tango returns it: should no ``weights.pt`` have been loaded into it (its
    ``load_state_dict`` never called), its parameters are allocated and initialised, not left on
    ``meta``.
    """
    if isinstance(model, nn.Module):
        if isinstance(model.__dict__.get("load_state_dict"), _AssignOnce):
            del model.load_state_dict
        if isinstance(model.__dict__.get("cpu"), _StayOnce):
            del model.cpu
        if has_meta_parameters(model):
            logger.warning(
                "No final weights were loaded into the step's result: it is initialised, not trained."
            )
            materialize_module(model, torch.device("cpu"))
    return model


#: File systems whose files are memory: a copy there would be RAM, not disk.
_MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


def _mount_point(field: str) -> str:
    """A mount point as ``/proc/self/mountinfo`` writes it, its octal escapes (``\\040``) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def _on_tmpfs(directory: Path) -> bool:
    """Whether ``directory`` is on tmpfs or ramfs (the longest mount point above it in mountinfo)."""
    best, fstype = "", ""
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            mount_point, after = _mount_point(fields[4]), fields[fields.index("-") + 1 :]
            inside = str(directory) == mount_point or str(directory).startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best):
                best, fstype = mount_point, after[0]
    except (OSError, ValueError, IndexError):
        return True  # unknown: take it for memory
    return fstype in _MEMORY_FILE_SYSTEMS


def load_final_weights(load: Callable[..., Any], path: Path, *args: Any, **kwargs: Any) -> Any:
    """
    Tango's ``torch.load`` of ``weights.pt`` in its main process, for the step's result: every
    tensor a view of a shared mapping of a private copy of the file, so that the trained model
    the step returns and caches is backed by the disk (page cache the kernel can write back and
    drop) instead of the process's private memory. That model is the main process's one large
    allocation: 4 bytes per parameter, whatever the number of workers (a LoRA run's frozen base
    included), which made Tango's main process the first to run out under a per-process limit
    on private memory (``ulimit -d``). Its resident set still holds the pages it reads (while
    Tango caches the result), as page cache would; what it saves is memory the kernel cannot
    reclaim. The cost: one more write of the file, and its disk space while the model lives.

    The copy, in ``weights.pt``'s directory and named as this package's other temporaries
    (``.weights.pt.PID.HEX.tmp``: one a killed process left is removed by the next write of
    ``weights.pt``), is unlinked as soon as it is mapped: nobody else sees it, the step's
    ``weights.pt`` is never written through the mapping (a later in-place write to the model,
    such as peft's ``merge_and_unload``, changes the copy), and its disk space is freed when the
    model is. Where that cannot be done as it should, ``load`` (torch's own) reads the file into
    memory as before: not on Linux, a directory on tmpfs (the copy would be memory too), a file
    in torch's older format (which cannot be mapped), or a copy that fails (a full disk: logged).
    """
    path = Path(path)
    if not sys.platform.startswith("linux") or _on_tmpfs(path.resolve().parent) or not _is_zip_file(path):
        return load(path, *args, **kwargs)
    copy = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        shutil.copyfile(path, copy)
        # Process-wide while it lasts: Tango's main process loads nothing else meanwhile.
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            return load(copy, *args, **{**kwargs, "mmap": True})
    except (OSError, RuntimeError) as error:
        copy.unlink(missing_ok=True)
        logger.warning("Reading %s into memory: mapping a copy of it failed (%s)", path, error)
        return load(path, *args, **kwargs)
    finally:
        copy.unlink(missing_ok=True)


def _is_zip_file(path: Path) -> bool:
    """Whether ``path`` is in torch's zip format (``torch.save``'s since 1.6), the one ``mmap`` reads."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"PK\x03\x04"
    except OSError:
        return False
