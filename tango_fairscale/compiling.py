"""
Compiled units: ``torch.compile`` of each wrapped module's own ``forward``, applied by a backend
before it checkpoints and shards the module (torchtitan's order), so that the FSDP hooks and the
checkpoint wrapper stay outside the compiled code and the parameter names stay the plain model's.
Repeated blocks of one class share their compiled graphs (their ``forward`` is one code object,
and the module is an input of the graph). What compiling cost is counted here, per process, and
reported by :func:`summary`.
"""

import functools
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from tango.common import FromParams
from tango.common.exceptions import ConfigurationError
from torch import nn
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from .errors import did_you_mean

__all__ = ["COMPILE_MODES", "CompileConfig", "CompileStats", "compile_config", "compile_unit", "stats"]

logger = logging.getLogger(__name__)

#: ``torch.compile``'s modes (``mode``).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class CompileConfig(FromParams):
    """How each wrapped module is compiled (``with_wrapped_modules.compile``; ``true`` for the defaults)."""

    fullgraph: bool = False
    """``torch.compile(fullgraph=...)``: refuse a graph break instead of running its part eagerly."""

    dynamic: Optional[bool] = False
    """``torch.compile(dynamic=...)``: ``False`` compiles for the shapes seen (a new batch shape
    recompiles, counted); ``None`` lets torch mark shapes dynamic after a recompile."""

    mode: Optional[str] = None
    """``torch.compile(mode=...)``: one of :data:`COMPILE_MODES`, or ``None`` for the default."""

    backend: str = "inductor"
    """``torch.compile(backend=...)``: ``"inductor"`` (generated kernels), ``"aot_eager"`` (traced,
    not generated: for checking that a model traces), ``"eager"``."""

    fallback_to_eager: bool = False
    """A unit that cannot be compiled runs eagerly, with one warning naming it; ``False`` (default):
    the run stops with one line naming the unit."""

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in COMPILE_MODES:
            raise ConfigurationError(
                f"with_wrapped_modules.compile.mode: {self.mode!r} is not one of {list(COMPILE_MODES)}."
            )
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigurationError(
                "with_wrapped_modules.compile.backend: expected a name such as 'inductor', got "
                f"{self.backend!r}."
            )

    def arguments(self) -> Dict[str, Any]:
        """``torch.compile``'s keyword arguments."""
        return {
            "fullgraph": self.fullgraph,
            "dynamic": self.dynamic,
            "mode": self.mode,
            "backend": self.backend,
        }


def compile_config(value: Union[None, bool, Dict[str, Any], CompileConfig]) -> Optional[CompileConfig]:
    """The config of ``with_wrapped_modules.compile`` (``true``, ``false`` or a dict), ``None`` for off."""
    if value is None or value is False:
        return None
    if value is True:
        return CompileConfig()
    if isinstance(value, CompileConfig):
        return value
    if isinstance(value, dict):
        known = set(CompileConfig.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            hint = did_you_mean(unknown[0], sorted(known)) or f"its options are {sorted(known)}"
            raise ConfigurationError(f"with_wrapped_modules.compile.{unknown[0]}: not an option: {hint}")
        return CompileConfig(**value)
    raise ConfigurationError(
        "with_wrapped_modules.compile: expected true, false or a dict of torch.compile's options, got "
        f"{value!r}."
    )


@dataclass
class CompileStats:
    """What compiling cost this process: the calls that compiled, by unit."""

    seconds: float = 0.0
    """Wall time of the unit calls that compiled (their compile and their first run)."""

    graphs: int = 0
    """Graphs compiled (forward and backward each count, per shape)."""

    compiled_units: List[str] = field(default_factory=list)
    """The units whose call compiled something, in order (a unit named twice recompiled)."""

    fallbacks: List[str] = field(default_factory=list)
    """Units that run eagerly because they could not be compiled (``fallback_to_eager``)."""

    steps_done: int = 0
    """Optimizer steps done when last read (recompiles after the first step are named as such)."""

    def recompiled(self) -> List[str]:
        """Units that compiled more than once."""
        seen: Dict[str, int] = {}
        for unit in self.compiled_units:
            seen[unit] = seen.get(unit, 0) + 1
        return [unit for unit, count in seen.items() if count > 1]

    def as_dict(self) -> Dict[str, Any]:
        return {
            "compile_s": round(self.seconds, 3),
            "compiled_graphs": self.graphs,
            "recompiled_units": self.recompiled(),
            "eager_units": list(self.fallbacks),
        }


_stats = CompileStats()
_lock = threading.Lock()


def stats() -> CompileStats:
    """This process's :class:`CompileStats`."""
    return _stats


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_unit(module: nn.Module, config: CompileConfig, name: str) -> None:
    """
    Compile ``module``'s own forward in place (the module, its hooks and its parameter names are
    unchanged), after the backend checkpointed it: through torch's checkpoint wrapper (its inner
    module) and FairScale's (which calls the class's ``forward``, not the instance's). A call that
    compiles is timed and counted under ``name``; one that cannot be compiled stops with a one-line
    :class:`ConfigurationError` naming ``name``, or runs eagerly under ``config.fallback_to_eager``.
    """
    inner = getattr(module, "_checkpoint_wrapped_module", None)
    target = inner if isinstance(inner, nn.Module) else module
    forward = target.forward
    if (
        isinstance(forward, functools.partial)
        and getattr(forward.func, "__name__", "") == "_checkpointed_forward"
    ):
        # FairScale's checkpoint_wrapper: partial(_checkpointed_forward, type(module).forward, ...).
        original = forward.args[0]
        compiled = _compiled(original, config, name, type(target).__name__)
        target.forward = functools.partial(forward.func, compiled, *forward.args[1:], **forward.keywords)  # type: ignore[method-assign]
    else:
        target.forward = _compiled(forward, config, name, type(target).__name__)  # type: ignore[method-assign]


def _compiled(eager: Callable[..., Any], config: CompileConfig, name: str, kind: str) -> Callable[..., Any]:
    """``eager`` compiled, its compiling counted, its failures told in one line (see :func:`compile_unit`)."""
    compiled = torch.compile(eager, **config.arguments())
    state = {"eager": False}

    def forward(*args: Any, **kwargs: Any) -> Any:
        if state["eager"] or is_in_torch_dispatch_mode():
            # Under a dispatch mode (the FLOP meter's FlopCounterMode in the first step) Dynamo does
            # not trace, and remembers the code as skipped: the unit would never compile. Eager here.
            return eager(*args, **kwargs)
        before, start = _graph_count(), time.perf_counter()
        try:
            result = compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            if not config.fallback_to_eager:
                raise ConfigurationError(
                    f"with_wrapped_modules.compile: unit {name or '(root)'} ({kind}) "
                    f"cannot be compiled: {type(error).__name__}: {first}. Set compile.fallback_to_eager: "
                    "true to run it eagerly, or compile: false."
                ) from None
            logger.warning(
                "with_wrapped_modules.compile: unit %s (%s) cannot be compiled (%s: %s): it runs eagerly.",
                name or "(root)",
                kind,
                type(error).__name__,
                first,
            )
            state["eager"] = True
            with _lock:
                _stats.fallbacks.append(name)
            return eager(*args, **kwargs)
        added = _graph_count() - before
        if added:
            seconds = time.perf_counter() - start
            with _lock:
                _stats.seconds += seconds
                _stats.graphs += added
                _stats.compiled_units.append(name)
                times = _stats.compiled_units.count(name)
            _report(name, kind, added, seconds, times)
        return result

    forward.__wrapped__ = eager  # type: ignore[attr-defined]
    return forward


def _report(name: str, kind: str, graphs: int, seconds: float, times: int) -> None:
    """The first worker's line for a call that compiled; a warning from a unit's third compile on."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    # A unit compiles once, and a checkpointed one once more for its recomputation with gradients;
    # more is a recompilation (another shape, dtype or grad mode): named, since each one costs.
    line = f"compile: unit {name or '(root)'} ({kind}) compiled {graphs} graph(s) in {seconds:.1f} s"
    if times > 2:
        logger.warning(
            "%s (its compile number %d: a recompilation; with changing shapes set compile.dynamic: null)",
            line,
            times,
        )
    else:
        # Printed, as the evaluation prints its numbers: Tango logs warnings only unless --log-level
        # is given, and a run that sits compiling for a minute should say so.
        print(line, file=sys.stderr, flush=True)


def innermost(selected: List[str]) -> List[str]:
    """The selected modules with no other selected module inside them: the ones compiled."""
    return [name for name in selected if not any(other.startswith(name + ".") for other in selected)]


def summary(stats_: CompileStats) -> str:
    """One line for the run's log: what compiling cost, which units recompiled or run eagerly."""
    parts = [f"compiled {stats_.graphs} graph(s) in {stats_.seconds:.1f} s"]
    recompiled = stats_.recompiled()
    if recompiled:
        parts.append(f"recompiled: {', '.join(recompiled)}")
    if stats_.fallbacks:
        parts.append(f"eager (could not compile): {', '.join(stats_.fallbacks)}")
    return "; ".join(parts)
