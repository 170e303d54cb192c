"""The CPU support changes FairScale's FSDP module only, and only while enabled."""

import importlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp_module

from tango_fairscale import compat
from tango_fairscale.compat import fairscale_cpu_streams as streams
from tango_fairscale.cpu import collectives, memory
from tango_fairscale.launch.teardown import close_process_groups


def test_enable_is_scoped_and_reversible() -> None:
    compat.disable_cpu_fsdp()
    assert fsdp_module.torch is torch
    real_cuda_stream = torch.cuda.Stream
    real_is_available = torch.cuda.is_available
    try:
        compat.enable_cpu_fsdp()
        compat.enable_cpu_fsdp()  # idempotent
        assert compat.cpu_fsdp_enabled()
        # FairScale's module sees CPU streams ...
        assert fsdp_module.torch.cuda.Stream is streams.NullStream
        assert fsdp_module.torch.cuda.is_available()
        assert fsdp_module.torch.zeros is torch.zeros
        # ... the rest of the process does not.
        assert torch.cuda.Stream is real_cuda_stream
        assert torch.cuda.is_available is real_is_available
        # record_stream is a no-op on CPU tensors.
        torch.zeros(2).record_stream(streams.NullStream())
    finally:
        compat.disable_cpu_fsdp()
    assert fsdp_module.torch is torch
    assert not compat.cpu_fsdp_enabled()


def test_stream_context_tracks_the_current_stream() -> None:
    cuda = streams.CudaStreamsOnCpu("torch.cuda")
    side = cuda.Stream()
    before = cuda.current_stream()
    with cuda.stream(side):
        assert cuda.current_stream() is side
    assert cuda.current_stream() is before


def test_heap_limit_respects_the_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sys

    # mallopt is recorded, not called: glibc cannot give back the dynamic threshold it had once one
    # is set, so this process's malloc would stay changed for every later test. Applying it for
    # real is tested in fresh processes (tests/test_cpu_memory.py, where the tensors land).
    applied: list = []
    monkeypatch.setattr(memory, "_set_mmap_threshold", lambda threshold: applied.append(threshold) or True)
    monkeypatch.setattr(memory, "_in_effect", None)
    monkeypatch.setattr(memory, "_blocks", [])
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    with memory.limit_cpu_heap_growth() as limited:
        assert limited is False
    assert applied == [] and memory.current_mmap_threshold() is None
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    on_linux = sys.platform.startswith("linux")
    with memory.limit_cpu_heap_growth() as limited:
        assert limited is on_linux
        assert applied == ([memory.MMAP_THRESHOLD_BYTES] if on_linux else [])
    # Restored when the block ends: glibc's own threshold cannot be, its ceiling is set instead.
    assert applied == (
        [memory.MMAP_THRESHOLD_BYTES, memory.RESTORED_MMAP_THRESHOLD_BYTES] if on_linux else []
    )
    assert memory._blocks == []


def test_the_spawn_grace_is_given_only_inside_the_block_and_its_thread(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    # The module (``torch.multiprocessing.spawn`` as an attribute is the function).
    spawn = importlib.import_module("torch.multiprocessing.spawn")

    # Importing the package (this test process did) leaves every spawn as torch made it.
    assert not getattr(spawn.ProcessContext.join, "_tango_fairscale", False)
    calls: list = []

    def recorder(self, timeout=None, grace_period=None):  # type: ignore[no-untyped-def]
        calls.append((self, timeout, grace_period))
        return True

    monkeypatch.setattr(spawn.ProcessContext, "join", recorder)

    def join_in_another_thread() -> None:
        thread = threading.Thread(target=lambda: spawn.ProcessContext.join("other"))
        thread.start()
        thread.join()

    spawn.ProcessContext.join("before")
    with compat.spawn_grace():
        spawn.ProcessContext.join("step")
        spawn.ProcessContext.join("step, given", 1.0, 2.0)
        join_in_another_thread()
        with compat.spawn_grace():  # nested: one rebinding
            spawn.ProcessContext.join("nested")
    spawn.ProcessContext.join("after")
    assert spawn.ProcessContext.join is recorder
    assert calls == [
        ("before", None, None),
        ("step", None, compat.SPAWN_GRACE_SECONDS),
        ("step, given", 1.0, 2.0),
        ("other", None, None),
        ("nested", None, compat.SPAWN_GRACE_SECONDS),
        ("after", None, None),
    ]


def test_the_spawn_grace_stays_while_another_thread_is_inside(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import threading

    # The module (``torch.multiprocessing.spawn`` as an attribute is the function).
    spawn = importlib.import_module("torch.multiprocessing.spawn")

    original = spawn.ProcessContext.join
    entered, leave = threading.Event(), threading.Event()

    def step_in_another_thread() -> None:
        with compat.spawn_grace():
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=step_in_another_thread)
    thread.start()
    assert entered.wait(30)
    with compat.spawn_grace():
        pass
    # This thread's block ended first: the other's rebinding is still in place ...
    assert getattr(spawn.ProcessContext.join, "_tango_fairscale", False)
    leave.set()
    thread.join(30)
    # ... until it ends too.
    assert spawn.ProcessContext.join is original


def test_ring_takes_only_equal_contiguous_pieces() -> None:
    buffer = torch.arange(12.0)
    assert collectives.ring_compatible(list(buffer.chunk(3)), torch.zeros(4), 3)
    # One piece per worker, no more and no fewer.
    assert not collectives.ring_compatible(list(buffer.chunk(3)), torch.zeros(4), 2)
    # Rows of a partly used 2-D bucket are contiguous each, with gaps between them: fine.
    bucket = torch.zeros(2, 6)
    assert collectives.ring_compatible(list(bucket[:, :4].unbind(0)), torch.zeros(4), 2)
    # Columns are strided; sizes or dtypes that differ from the single tensor are not taken.
    assert not collectives.ring_compatible(list(bucket.unbind(1)), torch.zeros(2), 6)
    assert not collectives.ring_compatible([buffer[:4], buffer[4:10]], torch.zeros(4), 2)
    assert not collectives.ring_compatible(list(buffer.chunk(3)), torch.zeros(4, dtype=torch.float64), 3)
    assert not collectives.ring_compatible(list(buffer.chunk(3)), torch.zeros(8)[::2], 3)


def test_overlaps() -> None:
    buffer = torch.arange(12.0)
    assert collectives.overlaps(buffer[:4], buffer[3:6])
    assert not collectives.overlaps(buffer[:4], buffer[4:8])
    assert not collectives.overlaps(torch.zeros(3), torch.zeros(3))


def test_unsupported_versions_are_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import pytest

    monkeypatch.delenv(compat.SKIP_VERSION_CHECK_VARIABLE, raising=False)
    monkeypatch.setitem(compat.CHECKED_VERSIONS, "fairscale", ("0.4.12",))
    with pytest.raises(compat.IncompatibleVersionError, match=r"supports fairscale 0\.4\.12, but 0\.4\.13"):
        compat.check_version("fairscale")
    monkeypatch.setenv(compat.SKIP_VERSION_CHECK_VARIABLE, "1")
    compat.check_version("fairscale")  # warns only


@pytest.mark.parametrize(
    "found, supported",
    [("2.10.2", False), ("2.11.0", True), ("2.13.0+cpu", True), ("2.15.0+cu132", True), ("2.16.0", False)],
)
def test_every_torch_release_in_the_range_is_supported(found: str, supported: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The range is pyproject.toml's: no release inside it is refused as a whole.
    monkeypatch.delenv(compat.SKIP_VERSION_CHECK_VARIABLE, raising=False)
    monkeypatch.setattr(torch, "__version__", found)
    if supported:
        compat.check_version("torch")
    else:
        with pytest.raises(compat.IncompatibleVersionError, match=r"supports torch >= 2\.11, < 2\.16, but"):
            compat.check_version("torch")
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert f'"torch>={compat.TORCH_RANGE[0]},<{compat.TORCH_RANGE[1]}"' in pyproject


def test_missing_attribute_is_refused_before_patching() -> None:
    import types

    import pytest

    module = types.ModuleType("fairscale.somewhere")
    with pytest.raises(
        compat.IncompatibleVersionError, match=r"patch F9 rebinds fairscale.somewhere.\['dist'\]"
    ):
        compat.checks._require_attributes(module, ["dist"], "F9")


def test_checkpoint_autocast_patch_restores_cpu_bfloat16() -> None:
    from fairscale.nn.checkpoint import checkpoint_activations

    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = checkpoint_activations.is_autocast_enabled()
    assert state == (("cpu", torch.bfloat16),)
    assert not checkpoint_activations.is_autocast_enabled()  # falsy outside autocast
    with checkpoint_activations.autocast(state):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_meta_registration_is_counted_across_threads() -> None:
    import threading

    import torch.nn as nn

    original = nn.Module.register_parameter
    seen = []
    entered, release = threading.Event(), threading.Event()

    def hook(module: nn.Module, name: str, param: nn.Parameter) -> None:
        seen.append(name)

    def other_thread() -> None:
        with compat.meta_parameter_registration(hook):
            entered.set()
            release.wait(5)

    thread = threading.Thread(target=other_thread)
    thread.start()
    entered.wait(5)
    with compat.meta_parameter_registration(hook):
        pass  # this thread leaves first ...
    nn.Linear(2, 2)  # ... and the other thread's registration is still in effect
    assert seen == ["weight", "bias"]
    release.set()
    thread.join()
    assert nn.Module.register_parameter is original


def test_mixed_precision_root_casts_inputs_to_its_compute_dtype() -> None:
    """F6: a bfloat16 root unit without AMP gets bfloat16 inputs, not FairScale's float16."""
    from tango_fairscale.config import FSDPConfig

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        layer = nn.Linear(4, 3)
        weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
        unit = FSDPConfig(mixed_precision=True, compute_dtype="bfloat16").wrap(layer)
        inputs = torch.randn(5, 4, requires_grad=True)
        output = unit(inputs)
        assert output.dtype == torch.bfloat16
        expected = F.linear(inputs.detach().bfloat16(), weight.bfloat16(), bias.bfloat16())
        assert torch.equal(output.detach(), expected)
    finally:
        close_process_groups()
        compat.disable_cpu_fsdp()


def test_p1s_probe_of_the_initialisers_draws_no_random_number(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # sparse_ draws a permutation on the CPU even for a meta tensor: a probe that moved the
    # generator put every init_on_meta build after it out of step with the eager one (torch 2.11).
    monkeypatch.setattr(compat.torch_patches, "_meta_skipping", None)
    torch.manual_seed(3)
    before = torch.random.get_rng_state()
    taken = compat.meta_skipping_initialisers()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert set(taken) <= set(compat.META_SKIPPING_INITIALISERS)
    assert compat.meta_skipping_initialisers() is taken  # probed once per process


def test_a_wrapped_function_whose_parameters_changed_is_refused() -> None:
    # What F9, F10, T4 and S1 check before wrapping: a release that adds or renames a parameter.
    def reduce_scatter_async(self, input_list, group, callback_fn=None, extra=None):  # type: ignore[no-untyped-def]
        return None

    with pytest.raises(
        compat.IncompatibleVersionError, match=r"patch F9 wraps .*'extra'\] on this installation"
    ):
        compat.checks._require_signature(
            reduce_scatter_async, ("self", "input_list", "group", "callback_fn"), "F9"
        )
    compat.checks._require_signature(
        lambda self, input_list, group, callback_fn: None,
        ("self", "input_list", "group", "callback_fn"),
        "F9",
    )
    assert not compat.signature_matches(reduce_scatter_async, ("self",))
