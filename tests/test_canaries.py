"""
Canaries: for every patch of ``tango_fairscale/compat/`` (the table in ``docs/architecture.md``,
"The integration boundary"), a test that the upstream defect the patch works around, or the
upstream behaviour it changes or depends on, is still there on the installed releases, shown
on the upstream code as it is without the patch. When a release of torch, FairScale, Tango,
``transformers`` or setuptools fixes it, the canary fails with a message that says which patch
may be retired.

Each test runs the original code: the function a patch wraps (``__wrapped__``, ``compat``'s
kept originals), the patch disabled where it can be (``disable_cpu_fsdp``,
``disable_cpu_fsdp2``, restored afterwards), or the unpatched condition made again locally (a
fresh copy of a FairScale module, a fresh interpreter that imports nothing of this package).
"""

import importlib
import importlib.util
import inspect
import json
import logging
import os
import random
import re
import signal
import sys
import tempfile
import threading
import types
import warnings
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from fairscale.nn.data_parallel import FullyShardedDataParallel, fully_sharded_data_parallel
from tango.common.exceptions import ConfigurationError

from tango_fairscale import compat
from tests.conftest import TinyPretrained
from tests.helpers import REPO, TINY_LLAMA, Command, ConcurrentProcesses, free_port

#: Every patch ID of the table in docs/architecture.md, in its order: each has one canary here
#: (``test_canary_<ID>_...``), which test_every_patch_in_the_table_has_a_canary checks.
PATCH_IDS = [
    "F1", "F2", "F3", "F4", "F5", "F6", "F7", "F8", "F9", "F10",
    "T1", "T2", "T3", "T4", "W1", "W2", "W3", "W4", "W5", "T6", "T5", "T7", "T8", "T9",
    "D1", "S1", "P1", "H1", "H2",
]  # fmt: skip

CPU = torch.device("cpu")


def _installed() -> str:
    """The releases a canary ran on: torch, FairScale, Tango, and transformers where imported."""
    from importlib.metadata import version

    names = ["torch", "fairscale", "ai2-tango"] + (["transformers"] if "transformers" in sys.modules else [])
    return ", ".join(f"{name} {version(name)}" for name in names)


def _retire(patch: str, what: str) -> None:
    """Fail the canary of ``patch``: ``what`` changed upstream on this installation."""
    pytest.fail(
        f"{patch}: {what} ({_installed()}): the upstream defect patch {patch} works around is gone on "
        f"this release: check, and retire patch {patch} for it (docs/architecture.md, compat.py)"
    )


# --- the table ---------------------------------------------------------------------------------------


def _table_ids() -> List[str]:
    """The first column of the patch table in docs/architecture.md ("The integration boundary")."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## The integration boundary", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| ([A-Z]\d+) \|", section, re.M)


def test_every_patch_in_the_table_has_a_canary() -> None:
    table = _table_ids()
    assert table, "no patch table found in docs/architecture.md"
    canaries: Dict[str, List[str]] = {}
    for name in globals():
        if name.startswith("test_canary_"):
            canaries.setdefault(name[len("test_canary_") :].split("_")[0], []).append(name)
    assert sorted(table) == sorted(PATCH_IDS), "PATCH_IDS differs from the table in docs/architecture.md"
    missing = [patch for patch in table if patch not in canaries]
    assert not missing, f"patches without a canary test (test_canary_<ID>_...): {missing}"
    several = {patch: names for patch, names in canaries.items() if len(names) > 1}
    assert not several, f"one canary per patch: {several}"
    assert not set(canaries) - set(table), f"canaries of no patch in the table: {set(canaries) - set(table)}"


# --- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture
def without_cpu_fsdp() -> Iterator[None]:
    """F1-F4 and F9 not in effect (FairScale's FSDP module as FairScale has it), restored after."""
    enabled = compat.cpu_fsdp_enabled()
    compat.disable_cpu_fsdp()
    try:
        yield
    finally:
        if enabled:
            compat.enable_cpu_fsdp()


@pytest.fixture
def cpu_fsdp() -> Iterator[None]:
    """F1-F4 and F9 in effect, as on a CPU worker (for canaries of other patches), restored after."""
    enabled = compat.cpu_fsdp_enabled()
    compat.enable_cpu_fsdp()
    try:
        yield
    finally:
        if not enabled:
            compat.disable_cpu_fsdp()


@pytest.fixture
def without_s1() -> Iterator[None]:
    """S1 not in effect (FSDP2's own allocation functions), restored after."""
    enabled = compat.cpu_fsdp2_enabled()
    compat.disable_cpu_fsdp2()
    try:
        yield
    finally:
        if enabled:
            compat.enable_cpu_fsdp2()


@contextmanager
def _restored_random_state() -> Iterator[None]:
    """Python's, NumPy's and torch's generators restored (conftest does it per test, not per module)."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


# --- a fresh interpreter that imports nothing of this package (W3, T3, H1) -------------------------------

FRESH_SCRIPT = r"""
import json, sys, warnings

def report(patch, **values):
    print(patch, json.dumps(values), flush=True)

# W3: Tango's step_info imports pkg_resources when it records a step's packages.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from tango.step_info import get_pip_packages
    imported_before = "pkg_resources" in sys.modules
    get_pip_packages()
import setuptools
report(
    "W3",
    warnings=[
        [str(w.message), w.category.__name__, w.filename] for w in caught if "pkg_resources" in str(w.message)
    ],
    imported_before=imported_before,
    setuptools=setuptools.__version__,
)

# T3: Tango's registry search for a misspelt name where `datasets` is not installed.
sys.modules["datasets"] = None
from tango import Step
try:
    Step.by_name("transformers::no_such_step")
    report("T3", error=None)
except BaseException as error:
    report("T3", error=type(error).__name__, name=getattr(error, "name", None), message=str(error)[:300])

# H1: the name Tango's ia3 module imports.
try:
    from transformers.modeling_utils import Conv1D
    report("H1", error=None)
except ImportError as error:
    report("H1", error=str(error))
report("ours", imported=sorted(m for m in sys.modules if m.startswith("tango_fairscale")))
"""

#: The tests that read the fresh interpreter's report.
_FRESH_USERS = ("test_canary_W3_", "test_canary_T3_", "test_canary_H1_")


@pytest.fixture(scope="module", autouse=True)
def _fresh(request: pytest.FixtureRequest) -> Iterator[Any]:
    """
    The fresh interpreter, started before this module's first test when any of its users is
    selected, so that its seconds of imports overlap the other canaries.
    """
    selected = any(
        getattr(item, "module", None) is sys.modules[__name__] and item.name.startswith(_FRESH_USERS)
        for item in request.session.items
    )
    if not selected:
        yield None
        return
    with tempfile.TemporaryDirectory() as empty:
        # Tango's registry search imports the modules of its working directory: an empty one.
        processes = ConcurrentProcesses({"fresh": Command([sys.executable, "-c", FRESH_SCRIPT], Path(empty))})
        try:
            yield processes
        finally:
            processes.close()


@pytest.fixture
def fresh_report(_fresh: Any) -> Dict[str, Any]:
    """What the fresh interpreter reported, by patch ID."""
    assert _fresh is not None
    result = _fresh.result("fresh", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = {}
    for line in result.stdout.splitlines():
        patch, _, values = line.partition(" ")
        if values.startswith("{"):
            report[patch] = json.loads(values)
    assert report["ours"]["imported"] == [], "the fresh interpreter imported tango_fairscale"
    return report


# --- F: FairScale ----------------------------------------------------------------------------------------


def test_canary_F1_fsdp_on_a_cpu_compute_device_reaches_for_cuda_streams(
    without_cpu_fsdp: None, one_worker: Any
) -> None:
    """F1: FairScale's FSDP calls CUDA's stream API unconditionally, so it fails with a CPU compute
    device on a host without CUDA (as PyTorch's FSDP needed no-op streams, pytorch/pytorch#106099)."""
    if torch.cuda.is_available():
        pytest.skip(
            "F1: this host has CUDA, where FairScale makes its streams; the defect shows without CUDA"
        )
    assert fully_sharded_data_parallel.torch is torch  # F1 not in effect
    unit = FullyShardedDataParallel(nn.Linear(4, 4), compute_device=CPU)
    try:
        unit(torch.randn(2, 4)).sum().backward()
    except KeyError as error:  # its streams, made only where torch.cuda.is_available()
        assert error.args[0] in ("all_gather", "fp32_to_fp16", "post_backward"), error
        return
    except (RuntimeError, AssertionError) as error:
        assert "cuda" in str(error).lower() or "nvidia" in str(error).lower(), error
        return
    _retire("F1", "FairScale's FSDP now runs a forward and backward on a CPU compute device without CUDA")


def test_canary_F2_record_stream_has_no_cpu_kernel(without_cpu_fsdp: None) -> None:
    """F2: ``aten::record_stream`` has no CPU kernel, and FairScale's FSDP calls it on every tensor."""
    try:
        torch.zeros(2).record_stream(torch.Stream(device="cpu"))
    except NotImplementedError as error:
        assert "record_stream" in str(error) and "CPU" in str(error), error
        return
    _retire("F2", "Tensor.record_stream now has a CPU kernel")


def test_canary_F3_gloos_single_tensor_reduce_scatter_refuses_fairscales_layout(
    without_cpu_fsdp: None, one_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F3: gloo's single-tensor reduce-scatter expects its input flat, FairScale's bucket gives it
    (world size, shard): FairScale's default (``ENABLE_NCCL_BASE_COLLECTIVES`` unset) fails on gloo."""
    from fairscale.internal import reduce_scatter_bucketer

    if not hasattr(dist, "_reduce_scatter_base"):
        _retire(
            "F3", "torch.distributed has no _reduce_scatter_base, so FairScale takes the list forms itself"
        )
    # FairScale's default, whatever the environment says.
    monkeypatch.setattr(reduce_scatter_bucketer, "enable_nccl_base_collectives", True)
    monkeypatch.setattr(fully_sharded_data_parallel, "enable_nccl_base_collectives", True)
    bucketer = reduce_scatter_bucketer.ReduceScatterBucketer(bucket_cap_mb=1)
    results: List[torch.Tensor] = []
    with warnings.catch_warnings():
        # FairScale's Tensor.storage() (W1) and torch's deprecation of _reduce_scatter_base.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        bucketer.reduce_scatter_async([torch.ones(4)], dist.group.WORLD, results.append)
        try:
            bucketer.flush()
        except RuntimeError as error:
            assert "inputShape" in str(error) or "shape" in str(error).lower(), error
            return
    assert results and torch.equal(results[0], torch.ones(4)), results
    _retire("F3", "gloo's single-tensor reduce-scatter now takes FairScale's (world size, shard) bucket")


def _proc_io_written() -> int:
    """Bytes this process has passed to write() and its kind, sockets included (/proc/self/io)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))


def test_canary_F4_gloos_reduce_scatter_moves_an_all_reduces_bytes() -> None:
    """F4: gloo's reduce-scatter sends as many bytes as an all-reduce of the buffer (one all-reduce
    per rank's chunk, pytorch/pytorch#149869), twice the ring's; two gloo ranks in this process's
    threads, bytes counted from /proc/self/io (gloo's all-gather time, the other half, is not timed)."""
    if not Path("/proc/self/io").exists():
        pytest.skip("F4: /proc/self/io (the bytes written to gloo's sockets) is not available here")
    store = dist.HashStore()
    groups: Dict[int, Any] = {}

    def on_both_ranks(work: Any) -> int:
        threads = [threading.Thread(target=work, args=(rank,)) for rank in range(2)]
        before = _proc_io_written()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        return _proc_io_written() - before

    def connect(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))

    chunk = 1 << 18  # floats: a 2 MiB buffer per rank, 1 MiB chunks
    results: Dict[int, torch.Tensor] = {}

    def ring_step(rank: int) -> None:  # what F4's ring sends for 2 workers: one chunk each way
        sending = groups[rank].send([torch.ones(chunk)], 1 - rank, 0)
        receiving = groups[rank].recv([torch.zeros(chunk)], 1 - rank, 0)
        sending.wait()
        receiving.wait()

    def reduce_scatter(rank: int) -> None:
        output = torch.zeros(chunk)
        groups[rank].reduce_scatter([output], [[torch.full((chunk,), 1.0 + i) for i in range(2)]]).wait()
        results[rank] = output

    on_both_ranks(connect)
    try:
        ring = on_both_ranks(ring_step)
        gloo = on_both_ranks(reduce_scatter)
    finally:
        groups.clear()  # their threads joined now, while the interpreter is alive
    assert all(torch.equal(results[rank], torch.full((chunk,), 2.0 * (1 + rank))) for rank in range(2))
    assert ring >= 2 * chunk * 4, ring  # the count sees the sockets' bytes
    print(f"bytes written: ring {ring}, gloo's reduce-scatter {gloo}")
    if gloo < 1.5 * ring:
        _retire(
            "F4", f"gloo's reduce-scatter now sends {gloo} bytes where the ring sends {ring} (no all-reduce)"
        )


def _fresh_module_copy(name: str) -> types.ModuleType:
    """A new copy of module ``name`` executed from its source: none of our rebindings in it."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    copy_spec = importlib.util.spec_from_file_location(name.rsplit(".", 1)[0] + "._canary_copy", spec.origin)
    assert copy_spec is not None and copy_spec.loader is not None
    module = importlib.util.module_from_spec(copy_spec)
    copy_spec.loader.exec_module(module)
    return module


def test_canary_F5_fairscale_recomputes_without_cpu_autocast() -> None:
    """F5: FairScale's checkpoint records and restores only CUDA autocast (facebookresearch/fairscale#1199,
    as torch's own did, pytorch/pytorch#71124): the recompute of a checkpointed unit runs without CPU
    bfloat16 autocast. (Its CUDA half, bfloat16 re-entered as float16, needs a GPU: not shown here.)"""
    # The installed module's two functions are F5's: a fresh copy of FairScale's module has its own.
    fairscale_checkpoint = _fresh_module_copy("fairscale.nn.checkpoint.checkpoint_activations")
    assert fairscale_checkpoint.is_autocast_enabled is not compat.fairscale_patches._autocast_state
    seen: List[Tuple[bool, bool]] = []

    class Recording(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()))
            return super().forward(x)

    block = fairscale_checkpoint.checkpoint_wrapper(Recording(4, 4))
    inputs = torch.randn(2, 4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp.autocast(args...) is deprecated
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = block(inputs)
        output.float().sum().backward()
    forward, recompute = seen  # the forward (no grad) and the recompute in backward (grad)
    assert forward == (True, False) and recompute[1], seen
    if recompute[0]:
        _retire("F5", "FairScale's checkpoint now recomputes under the forward's CPU autocast")


def _fairscale_forward() -> Any:
    """FairScale's own ``FullyShardedDataParallel.forward``, under F7's and F6's wrappers."""
    forward = FullyShardedDataParallel.forward
    while getattr(forward, "__tango_fairscale_patch__", None) is not None:
        forward = forward.__wrapped__
    assert forward.__module__ == fully_sharded_data_parallel.__name__, forward
    return forward


def test_canary_F6_mixed_precision_root_casts_inputs_to_float16(cpu_fsdp: None, one_worker: Any) -> None:
    """F6: under ``mixed_precision`` FairScale casts the root's float32 inputs to float16 whatever its
    ``compute_dtype``: with bfloat16 and no autocast the first layer fails on the dtypes."""
    unit = FullyShardedDataParallel(
        nn.Linear(4, 3), mixed_precision=True, compute_dtype=torch.bfloat16, compute_device=CPU
    )
    try:
        output = _fairscale_forward()(unit, torch.randn(5, 4))
    except RuntimeError as error:
        assert "dtype" in str(error) and "Half" in str(error), error
        return
    if output.dtype != torch.bfloat16:
        pytest.fail(f"F6: FairScale's forward gave {output.dtype} without an error: look at what changed")
    _retire("F6", "FairScale now casts a mixed-precision root's inputs to its compute_dtype")


def test_canary_F7_flatten_params_wrapper_refuses_frozen_and_trainable_together() -> None:
    """F7: FairScale's FlattenParamsWrapper makes one flat parameter of a unit, which must be all frozen
    or all trainable: a LoRA layer or a partly frozen block is refused."""
    # FairScale's class: F7 rebinds only the name in FairScale's FSDP module.
    from fairscale.nn.misc import FlattenParamsWrapper

    layer = nn.Linear(4, 4)
    layer.weight.requires_grad_(False)
    try:
        FlattenParamsWrapper(layer)
    except (AssertionError, ValueError) as error:
        assert "requires_grad" in str(error), error
        return
    _retire("F7", "FairScale's FlattenParamsWrapper now flattens frozen and trainable parameters together")


def test_canary_F8_fairscale_frees_gathered_parameters_after_the_flat_gradient(
    cpu_fsdp: None, one_worker: Any
) -> None:
    """F8: FairScale frees a unit's gathered flat parameter in its post-backward hook, on the gradient
    accumulator, so only after autograd has assembled the views' gradients into the flat gradient."""
    from tango_fairscale.compat.fairscale_flat_groups import FlattenTrainableApart

    unit = FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), compute_device=CPU)
    wrappers = [m for m in unit.modules() if isinstance(m, FlattenTrainableApart)]
    assert wrappers and all(w._early_release_unit is None for w in wrappers)  # F8 not in effect
    frees: List[List[bool]] = []
    free = unit._free_full_params

    def recording_free(params: Any = None) -> None:
        if params is not None:  # the post-backward hook's call, for its parameter
            frees.append([p.grad is not None and p.grad.numel() == p.numel() for p in params])
        free(params)

    unit._free_full_params = recording_free  # type: ignore[method-assign]
    unit(torch.randn(3, 4)).sum().backward()
    assert frees, "FairScale's post-backward hook freed no parameter"
    if not all(all(assembled) for assembled in frees):
        _retire("F8", "FairScale now frees a gathered parameter before its flat gradient is assembled")


def test_canary_F9_the_bucket_is_filled_from_a_stacked_copy(cpu_fsdp: None, one_worker: Any) -> None:
    """F9: FairScale's reduce-scatter bucketer stacks a gradient that fits its bucket (``torch.stack``, a
    copy of the whole gradient) before copying it into the bucket."""
    from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer
    from torch.profiler import ProfilerActivity, profile

    from tests.helpers import peak_allocated_bytes

    method = ReduceScatterBucketer.reduce_scatter_async
    assert getattr(method, "__tango_fairscale_patch__", None) == "F9"
    fairscales = method.__wrapped__
    bucketer = ReduceScatterBucketer(bucket_cap_mb=4)
    results: List[torch.Tensor] = []
    gradient = torch.ones(1 << 18)  # 1 MiB: fits the bucket
    peak = 0
    for _ in range(2):  # the bucket exists before the measured call
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Profiler clears events")  # torch 2.11's
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
                fairscales(bucketer, [gradient], dist.group.WORLD, results.append)
        peak = peak_allocated_bytes(profiled)
    bucketer.flush()
    assert len(results) == 2 and all(torch.equal(r, gradient) for r in results)
    if peak < gradient.numel() * gradient.element_size():
        _retire(
            "F9",
            f"FairScale's bucketer now fills its bucket without a copy of the gradient (peak {peak} bytes)",
        )


def test_canary_F10_one_workers_mixed_precision_gradient_stays_low_precision(
    cpu_fsdp: None, one_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F10: with one worker FairScale does not shard and casts only an alias of a mixed-precision
    gradient to float32, never ``param.grad`` (as Lightning-AI/pytorch-lightning#16303 reported)."""
    hook = FullyShardedDataParallel._post_reduction_hook
    assert getattr(hook, "__tango_fairscale_patch__", None) == "F10"
    monkeypatch.setattr(FullyShardedDataParallel, "_post_reduction_hook", hook.__wrapped__)
    unit = FullyShardedDataParallel(
        nn.Linear(4, 3), mixed_precision=True, compute_dtype=torch.bfloat16, compute_device=CPU
    )
    unit(torch.randn(5, 4).bfloat16()).float().sum().backward()
    (parameter,) = unit.parameters()
    assert parameter.dtype == torch.float32 and parameter.grad is not None
    if parameter.grad.dtype == torch.float32:
        _retire("F10", "FairScale's one-worker post-reduction hook now gives param.grad float32")
    assert parameter.grad.dtype == torch.bfloat16, parameter.grad.dtype


# --- T: Tango --------------------------------------------------------------------------------------------


def _step_like(work_dir: Path) -> Any:
    """What Tango's ``TorchTrainStep._train`` reads of its step."""
    from tango.workspaces import LocalWorkspace

    work_dir.mkdir(parents=True, exist_ok=True)
    return types.SimpleNamespace(
        unique_id="canary",
        name="canary",
        work_dir=work_dir,
        workspace=LocalWorkspace(work_dir.parent / "workspace"),
        logger=logging.getLogger("tango_fairscale.canary"),
    )


def _tangos_train_arguments() -> Tuple[Any, ...]:
    """A toy model, Tango's own ``torch`` engine, 8 examples and a data loader of 4."""
    from tango.common import Lazy, Params
    from tango.common.dataset_dict import DatasetDict
    from tango.integrations.torch import DataLoader, TrainingEngine

    from examples.toy.components import ToyRegressor

    generator = torch.Generator().manual_seed(0)
    examples = [
        {"x": torch.randn(8, generator=generator), "y": torch.randn((), generator=generator)}
        for _ in range(8)
    ]
    return (
        Lazy(ToyRegressor, Params({"in_features": 8, "width": 8, "num_blocks": 1})),
        Lazy(TrainingEngine, Params({"type": "torch", "optimizer": {"type": "torch::SGD", "lr": 0.1}})),
        DatasetDict(splits={"train": examples}),
        Lazy(DataLoader, Params({"batch_size": 4})),
    )


def _tangos_step_function() -> Any:
    """Tango's ``TorchTrainStep._train``, under T1's wrapper."""
    from tango.integrations.torch import train as tango_train

    function = tango_train.TorchTrainStep._train
    if getattr(function, "_tango_fairscale", False):
        function = function.__wrapped__
    assert function.__module__ == tango_train.__name__, function
    return function


class _Spawned(Exception):
    """Raised by the stand-in for ``mp.spawn``: nothing is started."""


def test_canary_T1_tangos_workers_reimport_only_the_included_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T1 (a, e): Tango's step spawns its workers with only ``get_extra_imported_modules()`` to import
    again (a plain ``import tango_fairscale`` is not among them) and no handling of SIGINT/SIGTERM."""
    import torch.multiprocessing as mp
    from tango.common import util as tango_util
    from tango.integrations.torch import train as tango_train

    original_worker = compat.tango_patches._original_train_worker
    assert original_worker is not None
    monkeypatch.setattr(tango_train, "_train", original_worker)  # T2 not in effect
    # As in a process that imported the package with a plain import (no `-i tango_fairscale`).
    monkeypatch.setattr(tango_util, "_extra_imported_modules", set())
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    spawned: Dict[str, Any] = {}

    def spawn(fn: Any, args: Tuple[Any, ...] = (), nprocs: int = 1, **kwargs: Any) -> None:
        spawned.update(fn=fn, args=args, nprocs=nprocs)
        spawned["handlers"] = {signum: signal.getsignal(signum) for signum in handlers}
        raise _Spawned

    monkeypatch.setattr(mp, "spawn", spawn)
    with pytest.raises(_Spawned):
        _tangos_step_function()(
            _step_like(tmp_path / "work"), *_tangos_train_arguments(), train_steps=1, devices=[-1, -1]
        )
    assert spawned["fn"] is original_worker and spawned["nprocs"] == 2
    include_package = spawned["args"][-1]
    assert isinstance(include_package, set), spawned["args"]
    if include_package != tango_util.get_extra_imported_modules():
        _retire("T1", f"Tango's workers now import {include_package} again, not only the included modules")
    if spawned["handlers"] != handlers:
        _retire("T1", "Tango's step now handles SIGINT/SIGTERM around its workers")


@pytest.fixture(scope="module")
def tangos_one_device_run(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """
    Tango's ``TorchTrainStep._train`` (T1's original) of one device, one step of a toy model on
    Tango's own ``torch`` engine, with Tango's worker function (T2's original): the processes its
    worker function ran in, and the ``torch.load`` calls of the step.
    """
    from tango.integrations.torch import train as tango_train

    original_worker = compat.tango_patches._original_train_worker
    assert original_worker is not None
    calls: Dict[str, List[Any]] = {"workers": [], "loads": []}

    def worker(process_index: int, workspace: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        calls["workers"].append((process_index, os.getpid(), config.is_distributed))
        return original_worker(process_index, workspace, config, *args, **kwargs)

    load = torch.load

    def recording_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        calls["loads"].append((f, threading.get_ident(), kwargs))
        return load(f, *args, **kwargs)

    with pytest.MonkeyPatch.context() as monkeypatch, _restored_random_state():
        monkeypatch.setattr(tango_train, "_train", worker)
        monkeypatch.setattr(torch, "load", recording_load)
        step = _step_like(tmp_path_factory.mktemp("tango_run") / "work")
        model = _tangos_step_function()(
            step, *_tangos_train_arguments(), train_steps=1, checkpoint_every=1, devices=[-1]
        )
    return {
        **calls,
        "model": model,
        "work_dir": step.work_dir,
        "pid": os.getpid(),
        "thread": threading.get_ident(),
    }


def test_canary_T2_tango_trains_a_one_device_step_in_its_main_process(
    tangos_one_device_run: Dict[str, Any],
) -> None:
    """T2: Tango's step of one device calls its worker function in its own (main) process, without a
    process group, where the engine needs a spawned worker with one."""
    workers = tangos_one_device_run["workers"]
    if workers != [(0, tangos_one_device_run["pid"], False)]:
        _retire("T2", f"Tango's one-device step no longer trains in its main process ({workers})")


def test_canary_T3_registry_search_fails_on_an_integrations_absent_dependency(
    fresh_report: Dict[str, Any],
) -> None:
    """T3: where ``datasets`` is absent, Tango's search for a misspelt name stops at its ``transformers``
    integration's ``No module named 'datasets'`` instead of "not a registered name" (fresh interpreter)."""
    t3 = fresh_report["T3"]
    if t3["error"] not in ("ModuleNotFoundError", "ImportError") or t3["name"] != "datasets":
        _retire(
            "T3", f"Tango's registry search now treats the absent datasets as a missing integration ({t3})"
        )


class _FakeProcess:
    """A worker for ``ProcessContext``: exited with ``exitcode``, or alive and ignoring SIGTERM."""

    def __init__(self, exitcode: Any, alive: bool) -> None:
        self.sentinel, write_end = os.pipe()  # readable (the process ended) once the write end is closed
        self._fds = [self.sentinel]
        if alive:
            self._fds.append(write_end)
        else:
            os.close(write_end)
        self.exitcode, self.alive, self.pid = exitcode, alive, 0
        self.calls: List[Any] = []

    def join(self, timeout: Any = None) -> None:
        self.calls.append(("join", timeout))

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.calls.append("SIGTERM")

    def kill(self) -> None:
        self.calls.append("SIGKILL")
        self.alive = False

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)


def test_canary_T4_spawn_join_gives_a_worker_that_ignores_sigterm_30_seconds(tmp_path: Path) -> None:
    """T4: ``mp.spawn`` takes no grace period and ``ProcessContext.join`` without one (Tango's call)
    waits 30 s after SIGTERM before SIGKILL; run on stand-in processes (one failed, one hung)."""
    spawn = importlib.import_module("torch.multiprocessing.spawn")
    join = spawn.ProcessContext.join
    assert not getattr(join, "_tango_fairscale", False)  # T4 not in effect outside spawn_grace()
    parameters = inspect.signature(join).parameters
    if "grace_period" in parameters and parameters["grace_period"].default is not None:
        _retire("T4", f"ProcessContext.join now has a grace period by default ({parameters['grace_period']})")
    if "grace_period" in inspect.signature(spawn.spawn).parameters:
        pytest.fail("T4: mp.spawn now takes a grace period: Tango's step still passes none; check T4")
    failed, hung = _FakeProcess(exitcode=1, alive=False), _FakeProcess(exitcode=None, alive=True)
    context = spawn.ProcessContext([failed, hung], [str(tmp_path / "no-error-file")] * 2)
    try:
        with pytest.raises(spawn.ProcessExitedException):
            context.join()
    finally:
        failed.close()
        hung.close()
    calls = hung.calls
    assert "SIGTERM" in calls and calls[-2:] == ["SIGKILL", ("join", None)], calls
    if calls.index("SIGTERM") != 0:
        _retire("T4", f"ProcessContext.join without a grace period now waits before SIGTERM ({calls})")
    waits = [call[1] for call in calls[calls.index("SIGTERM") + 1 : calls.index("SIGKILL")]]
    if not waits or max(waits) < 29:
        _retire("T4", f"ProcessContext.join now waits {waits} s after SIGTERM without a grace period, not 30")


def test_canary_W1_storage_warns_that_typed_storage_is_deprecated() -> None:
    """W1: torch warns "TypedStorage is deprecated" when FairScale's FSDP calls ``Tensor.storage()``
    (attributed to FairScale's module, which the filter names)."""
    storage = importlib.import_module("torch.storage")
    always = storage._get_always_warn_typed_storage_removal()
    storage._set_always_warn_typed_storage_removal(True)  # torch warns once per process otherwise
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fully_sharded_data_parallel.free_storage_(torch.zeros(4))
    finally:
        storage._set_always_warn_typed_storage_removal(always)
    ours = [w for w in caught if "TypedStorage is deprecated" in str(w.message)]
    if not ours:
        _retire("W1", "Tensor.storage() no longer warns that TypedStorage is deprecated")
    assert all(w.category is UserWarning for w in ours), ours
    assert any(Path(w.filename) == Path(fully_sharded_data_parallel.__file__) for w in ours), ours


def test_canary_W2_checkpoint_wrapper_warns_that_no_input_requires_grad() -> None:
    """W2: torch's "None of the inputs have requires_grad=True" from FairScale's checkpoint wrapper,
    false there (the wrapper feeds a tensor that requires grad into every checkpointed call)."""
    from fairscale.nn.checkpoint import checkpoint_activations, checkpoint_wrapper

    block = checkpoint_wrapper(nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block(torch.randn(2, 4)).sum().backward()
    ours = [w for w in caught if "None of the inputs have requires_grad=True" in str(w.message)]
    assert block.weight.grad is not None  # the warning is false: the gradients are there
    if not ours:
        _retire("W2", "FairScale's checkpoint wrapper no longer draws torch's requires_grad warning")
    assert any(Path(w.filename) == Path(checkpoint_activations.__file__) for w in ours), ours


def test_canary_W3_tangos_step_info_draws_setuptools_pkg_resources_warning(
    fresh_report: Dict[str, Any],
) -> None:
    """W3: setuptools warns "pkg_resources is deprecated" (since 67.5) where Tango's ``tango.step_info``
    imports it to record a step's packages (fresh interpreter, no filter)."""
    w3 = fresh_report["W3"]
    if not w3["warnings"]:
        from packaging.version import Version

        if Version(w3["setuptools"]) < Version("67.5"):
            pytest.skip(
                f"W3: setuptools {w3['setuptools']} predates its pkg_resources warning (67.5): "
                "nothing for W3 to silence on this installation"
            )
        _retire("W3", f"importing pkg_resources no longer warns (setuptools {w3['setuptools']})")
    assert not w3["imported_before"], "pkg_resources was imported before Tango's step_info imported it"
    assert any(
        Path(filename).as_posix().endswith("tango/step_info.py") for _, _, filename in w3["warnings"]
    ), w3


def test_canary_W4_sharded_grad_scaler_warns_that_its_base_is_deprecated() -> None:
    """W4: FairScale's ShardedGradScaler subclasses ``torch.cuda.amp.GradScaler``, whose constructor warns
    FutureWarning that it is deprecated (on CPU-only torch too, before it disables itself)."""
    from fairscale.optim import grad_scaler

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad_scaler.ShardedGradScaler()
    ours = [
        w
        for w in caught
        if re.search(r"`torch\.cuda\.amp\.GradScaler\(args\.\.\.\)` is deprecated", str(w.message))
    ]
    if not ours:
        _retire(
            "W4", "constructing FairScale's ShardedGradScaler no longer warns about torch.cuda.amp.GradScaler"
        )
    assert all(w.category is FutureWarning for w in ours), ours
    assert any(Path(w.filename) == Path(grad_scaler.__file__) for w in ours), ours


def test_canary_W5_tango_stamps_a_step_with_the_deprecated_utcnow() -> None:
    """W5: Tango's ``utc_now_datetime`` (a step's start time) calls ``datetime.utcnow()``, which
    Python 3.12 and later deprecate (DeprecationWarning from Tango's file)."""
    from tango.common import util

    if sys.version_info < (3, 12):
        pytest.skip(
            f"Python {sys.version.split()[0]} does not deprecate datetime.utcnow(): W5 filters nothing"
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        util.utc_now_datetime()
    ours = [w for w in caught if "datetime.datetime.utcnow() is deprecated" in str(w.message)]
    if not ours:
        _retire("W5", "Tango's utc_now_datetime no longer calls the deprecated datetime.utcnow()")
    assert all(w.category is DeprecationWarning and Path(w.filename) == Path(util.__file__) for w in ours)


def test_canary_T6_tango_logs_a_stopped_step_as_an_uncaught_exception() -> None:
    """T6: Tango's ``Step.log_failure`` logs a ``SystemExit`` (the package's ``TrainingStopped``) as
    "Uncaught exception" with its traceback, after the handler already said what stopped the run."""
    from tango.common import logging as tango_logging
    from tango.step import Step

    from tango_fairscale.launch.signals import TrainingStopped

    log_failure = Step.log_failure
    if getattr(log_failure, "_tango_fairscale", False):
        log_failure = log_failure.__wrapped__
    records: List[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    step_logger = logging.getLogger("tango_fairscale.canary.T6")
    step_logger.addHandler(handler)
    step_logger.propagate = False
    step_logger.setLevel(logging.INFO)
    stopped = TrainingStopped(signal.SIGTERM)
    try:
        raise stopped
    except TrainingStopped:
        pass
    try:
        log_failure(types.SimpleNamespace(logger=step_logger, name="canary"), stopped)
    finally:
        step_logger.removeHandler(handler)
        if stopped in tango_logging._EXCEPTIONS_LOGGED:
            tango_logging._EXCEPTIONS_LOGGED.remove(stopped)
    uncaught = [r for r in records if "Uncaught exception" in r.getMessage() and r.exc_info]
    if not uncaught:
        _retire("T6", f"Tango's Step.log_failure no longer logs a SystemExit as uncaught ({records})")


def test_canary_T9_tangos_bar_redraws_with_carriage_returns_where_stderr_is_a_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """T9: Tango's ``Tqdm.tqdm``, given ``disable=False`` as its training loop gives it, writes its bar
    to a standard error that is no terminal as carriage-return redraws, whatever tqdm's
    ``TQDM_DISABLE`` says."""
    import io

    from tango.common.tqdm import Tqdm

    function = Tqdm.__dict__["tqdm"].__func__
    function = getattr(function, "__wrapped__", function)
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    for _ in function(range(3), desc="Training", disable=False, mininterval=0):
        pass
    if stderr.getvalue().count("\r") < 2:
        _retire("T9", f"Tango's progress bar no longer redraws with carriage returns: {stderr.getvalue()!r}")


def test_canary_T8_tango_raises_a_steps_config_mistake_inside_a_traceback() -> None:
    """T8: Tango's ``Step.from_params`` raises a misspelt option or a value of the wrong type as a
    ``ConfigurationError`` or ``TypeError`` that is not a ``CliRunError``: ``tango run`` prints it
    as "Uncaught exception" with a 38-42-line traceback, without the nearest option."""
    from tango.common.exceptions import CliRunError
    from tango.step import Step

    from_params = inspect.getattr_static(Step, "from_params").__func__
    original = getattr(from_params, "__wrapped__", from_params)
    base = {"type": "fairscale::tokenize_text", "tokenizer": "x", "documents": ["a b"]}
    for change in ({"block_sise": 8}, {"block_size": "8"}):
        try:
            original(Step, dict(base, **change))
        except (TypeError, ConfigurationError) as error:
            if isinstance(error, CliRunError) or "did you mean" in str(error):
                _retire("T8", f"Tango's Step.from_params now raises {error!r} for {change}")
        else:
            _retire("T8", f"Tango's Step.from_params now accepts {change}")


def test_canary_T5_tangos_engine_starts_a_second_process_group(one_worker: Any, tmp_path: Path) -> None:
    """T5: Tango's ``TorchTrainingEngine`` constructor starts the process group whenever the config is
    distributed, whether or not one is started (the engine's, with a timeout): a second start fails."""
    from tango.common import Lazy
    from tango.integrations.torch import Optimizer, TorchTrainingEngine, TrainConfig

    from examples.toy.components import ToyRegressor

    config = TrainConfig(
        "canary", tmp_path, is_distributed=True, devices=[-1], world_size=1, distributed_port=free_port()
    )
    assert dist.is_initialized()  # the engine's group, as it starts it before the constructor
    try:
        TorchTrainingEngine(
            config,
            Lazy(ToyRegressor, constructor_extras={"in_features": 8, "width": 8}),  # type: ignore[arg-type]
            Lazy(Optimizer.by_name("torch::SGD"), constructor_extras={"lr": 0.1}),  # type: ignore[arg-type]
        )
    except (ValueError, RuntimeError) as error:
        assert "twice" in str(error) or "already" in str(error), error
        return
    _retire("T5", "Tango's engine constructor no longer starts a process group where one is started")


def test_canary_T7_tango_loads_the_final_weights_into_its_main_process(
    tangos_one_device_run: Dict[str, Any],
) -> None:
    """T7: Tango's ``_train`` reads ``weights.pt`` with ``torch.load`` into private memory of its main
    process (the step's result), no ``mmap``."""
    loads = [
        (f, thread, kwargs)
        for f, thread, kwargs in tangos_one_device_run["loads"]
        if isinstance(f, (str, os.PathLike)) and Path(f).name == "weights.pt"
    ]
    if not loads:
        _retire("T7", "Tango's _train no longer loads weights.pt with torch.load")
    (path, thread, kwargs) = loads[-1]
    assert Path(path).parent == tangos_one_device_run["work_dir"], path
    assert thread == tangos_one_device_run["thread"]
    if kwargs.get("mmap"):
        _retire("T7", "Tango's _train now maps weights.pt (torch.load(mmap=True))")


# --- D, S, P: torch ---------------------------------------------------------------------------------------


def test_canary_D1_dcp_deduplicates_each_value_to_one_worker_of_all() -> None:
    """D1: DCP's DefaultSavePlanner writes each replicated value from one worker of all (through the
    private ``_dedup_save_plans`` and ``_create_global_plan`` the per-host planner overrides), so across
    hosts some host's files lack it."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    called: List[str] = []

    class Recording(DefaultSavePlanner):
        def _dedup_save_plans(self, all_plans: Any) -> Any:
            called.append("_dedup_save_plans")
            return super()._dedup_save_plans(all_plans)

        def _create_global_plan(self, all_plans: Any) -> Any:
            called.append("_create_global_plan")
            return super()._create_global_plan(all_plans)

    state = {"weight": torch.ones(4), "bias": torch.zeros(2)}  # the same on both workers
    plans = []
    for rank in range(2):
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=rank == 0)
        plans.append(planner.create_local_plan())
    coordinator = Recording()
    coordinator.set_up_planner(state, is_coordinator=True)
    global_plans, metadata = coordinator.create_global_plan(plans)
    assert sorted(metadata.state_dict_metadata) == ["bias", "weight"]
    if set(called) != {"_dedup_save_plans", "_create_global_plan"}:
        pytest.fail(
            f"D1: DCP's save planner no longer calls the methods the per-host planner overrides ({called})"
        )
    writers = {
        name: [r for r, p in enumerate(global_plans) for i in p.items if i.index.fqn == name]
        for name in state
    }
    if any(len(ranks) != 1 for ranks in writers.values()):
        _retire("D1", f"DCP no longer writes each replicated value from one worker of all ({writers})")


def test_canary_S1_fsdp2_gathers_into_torchs_cpu_allocator(without_s1: None, one_worker: Any) -> None:
    """S1: FSDP2 gathers each parameter of a CPU unit through torch's allocator: one under the mmap
    threshold comes from glibc's heap, between the tensors a step keeps."""
    if not compat.cpu_fsdp2_available():
        pytest.skip(
            f"S1: torch {torch.__version__} lacks torch.UntypedStorage._swap_data_ptr_, S1's target: "
            "the package turns S1 off there (compat.cpu_fsdp2_available())"
        )
    from torch.distributed.fsdp import fully_shard

    from tests.test_gathered_memory import _fsdp2s_own, _in_heap

    assert _fsdp2s_own()  # S1 not in effect
    if not Path("/proc/self/maps").exists():
        pytest.skip("S1: /proc/self/maps (where glibc's heap is) is not available here")
    block, head = nn.Linear(160, 160), nn.Linear(160, 1)  # a 100 KiB weight: S1 maps those of 64 KiB up
    model = nn.Sequential(block, nn.ReLU(), head)
    fully_shard(block, mesh=one_worker)
    fully_shard(model, mesh=one_worker)
    seen: List[bool] = []
    block.register_forward_pre_hook(lambda module, args: seen.append(_in_heap(module.weight.data_ptr())))
    model(torch.randn(4, 160)).sum().backward()
    assert seen, "the unit's forward did not run"
    if not all(seen):
        _retire("S1", "FSDP2's gathered parameter of 100 KiB is no longer in glibc's heap")


def _dispatched_on_meta(function: Any, *args: Any) -> List[str]:
    """The aten operators ``function(*args)`` dispatches (on meta tensors)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.operators: List[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.operators.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recording() as recording:
        function(*args)
    return recording.operators


def _meta_arguments(name: str) -> Tuple[Any, ...]:
    """Arguments for ``torch.nn.init``'s function ``name``, on a meta tensor."""
    if name == "dirac_":
        return (torch.empty(4, 4, 3, device="meta"),)
    tensor = torch.empty(4, 4, device="meta")
    extra = {"_no_grad_trunc_normal_": (0.0, 1.0, -2.0, 2.0), "sparse_": (0.5,), "constant_": (1.0,)}
    return (tensor, *extra.get(name, ()))


def test_canary_P1_nn_init_functions_return_at_once_on_meta() -> None:
    """P1: ``nn.Module`` registers every parameter through ``register_parameter`` (where P1 moves it
    to meta), and, where ``torch.nn.init``'s ``_no_grad_trunc_normal_``, ``orthogonal_``, ``dirac_``
    and ``sparse_`` return at once on a meta tensor (2.13, 2.15), a build on meta without P1's
    stand-ins differs from the eager one; on 2.11 they run on meta, and P1 takes over none."""
    init = torch.nn.init
    # P1 not in effect:
    assert nn.Module.register_parameter is compat.torch_patches._original_register_parameter
    assert not any(hasattr(getattr(init, name), "__wrapped__") for name in compat.META_SKIPPING_INITIALISERS)
    registered: List[str] = []
    original = nn.Module.register_parameter

    def recording(self: nn.Module, name: str, param: Any) -> None:
        registered.append(name)
        original(self, name, param)

    nn.Module.register_parameter = recording  # type: ignore[method-assign]
    try:
        nn.Linear(2, 2)
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
    if registered != ["weight", "bias"]:
        pytest.fail(f"P1: nn.Linear's parameters no longer pass through register_parameter ({registered})")

    # The initialiser half: built on meta without P1's stand-ins, parameters these functions
    # initialise differ from the eager build (2.13, 2.15: they return at once on meta and are
    # never recorded; 2.11: they run on meta, and the build still differs).
    from tango_fairscale.materialize import materialize_module
    from tests.helpers import build_both

    class ByTheFour(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rotation = nn.Parameter(torch.empty(6, 4))
            nn.init.orthogonal_(self.rotation)
            self.truncated = nn.Parameter(torch.empty(5, 5))
            nn.init.trunc_normal_(self.truncated, std=0.02)
            self.kernel = nn.Parameter(torch.empty(4, 4, 3))
            nn.init.dirac_(self.kernel)
            self.sparse = nn.Parameter(torch.empty(6, 4))
            nn.init.sparse_(self.sparse, 0.5)

    taken = compat.meta_skipping_initialisers()  # what P1 takes over on this release
    saved = compat.torch_patches._meta_skipping
    compat.torch_patches._meta_skipping = ()
    try:
        eager, built = build_both(ByTheFour, lambda model: materialize_module(model, CPU))
    except (AssertionError, ConfigurationError):
        differs = True  # refused as unknowable, or the generator out of step: the defect as well
    else:
        expected = eager.state_dict()
        differs = any(not torch.equal(value, expected[name]) for name, value in built.state_dict().items())
    finally:
        compat.torch_patches._meta_skipping = saved
    if differs:
        assert taken, (
            f"P1 takes over none of {compat.META_SKIPPING_INITIALISERS}, and a build without differs"
        )
    elif taken:  # the stand-ins still installed where the build is exact without them
        _retire("P1", f"torch.nn.init's {list(taken)} build on meta to the eager values without stand-ins")
    # Else the initialiser half is retired on this release already (torch 2.11: none taken over).
    # Every other public initialiser runs on meta, where P1's recording sees its operators.
    public = [
        n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))
    ]
    others = {name: _dispatched_on_meta(getattr(init, name), *_meta_arguments(name)) for name in public}
    newly_skipping = [
        name
        for name, operators in others.items()
        if not operators and name not in (*compat.META_SKIPPING_INITIALISERS, "trunc_normal_")
    ]
    assert not newly_skipping, (
        f"P1: torch.nn.init's {newly_skipping} now return at once on meta tensors too: "
        "add them to compat.META_SKIPPING_INITIALISERS"
    )


# --- H: transformers ---------------------------------------------------------------------------------------


def test_canary_H1_transformers_modeling_utils_lacks_conv1d(fresh_report: Dict[str, Any]) -> None:
    """H1: ``transformers.modeling_utils`` has no ``Conv1D`` (4.57), which Tango's ``ia3`` module imports
    from there (fresh interpreter, so that H1's alias is not what is seen)."""
    tango_ia3 = importlib.util.find_spec(compat.TANGO_IA3_MODULE)
    assert tango_ia3 is not None and tango_ia3.origin is not None
    if not re.search(
        r"from transformers\.modeling_utils import .*\bConv1D\b", Path(tango_ia3.origin).read_text()
    ):
        _retire("H1", "Tango's ia3 module no longer imports Conv1D from transformers.modeling_utils")
    h1 = fresh_report["H1"]
    if h1["error"] is None:
        _retire("H1", "transformers.modeling_utils has Conv1D again")
    assert "Conv1D" in h1["error"], h1


def test_canary_H2_from_pretrained_on_meta_parameters_loses_the_weights(
    tiny_pretrained: TinyPretrained,
) -> None:
    """H2: unrouted, ``transformers``' ``from_pretrained`` in a build on meta (P1 active) does not give the
    pretrained weights (the table: lost to parameters on meta; on 4.57.6 a TypeError where its empty-weights
    ``register_empty_parameter`` re-creates a meta parameter with P1's attribute as a keyword)."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM, PreTrainedModel

    from tango_fairscale.materialize import materialize_module, parameters_on_meta

    from_pretrained = PreTrainedModel.__dict__["from_pretrained"].__func__
    if getattr(from_pretrained, "_tango_fairscale", False):
        from_pretrained = from_pretrained.__wrapped__
    directory = tiny_pretrained(TINY_LLAMA, seed=3)
    saved = load_file(str(directory / "model.safetensors"))
    # Outside a build on meta, transformers' own loads the saved weights exactly.
    loaded = from_pretrained(LlamaForCausalLM, directory).state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in saved.items())
    try:
        with parameters_on_meta():
            model = from_pretrained(LlamaForCausalLM, directory)
        materialize_module(model, CPU)
    except (TypeError, RuntimeError, ValueError, NotImplementedError) as error:
        print(f"H2: unrouted from_pretrained on meta: {type(error).__name__}: {error}")
        return
    state = model.state_dict()
    if all(name in state and torch.equal(state[name], tensor) for name, tensor in saved.items()):
        _retire("H2", "transformers' own from_pretrained now keeps the pretrained weights in a build on meta")
