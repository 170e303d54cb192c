"""
The end of a run: the step's result (built in Tango's main process on ``meta``, the weights
assigned, :mod:`tango_fairscale.step_result`) and ``weights.pt`` (streamed from the shards,
:mod:`tango_fairscale.checkpointing.consolidation`), on a model whose output head is tied to its embedding.
"""

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
from tango.common import Params
from tango.workspaces import LocalWorkspace

from tango_fairscale import checkpointing
from tango_fairscale.checkpointing import consolidation
from tango_fairscale.step_result import FinalModelOnMeta, assign_state_dict
from tests import harness
from tests.components import TiedLM
from tests.conftest import TinyPretrained
from tests.helpers import REPO, TINY_LLAMA, run_tango, train_work_dir

BACKENDS = ["fairscale", "torch"]


def _tied_config(backend: str) -> Dict[str, Any]:
    """The run scripts/repeat_run.py repeats: a tied LM, each block a unit, init_on_meta."""
    return Params.from_file(
        REPO / "scripts" / "configs" / "tied_lm.jsonnet", ext_vars={"backend": backend}
    ).as_dict()


def _check_weights(work: Path) -> Dict[str, torch.Tensor]:
    """``weights.pt`` of a tied model's run: the head still the embedding, and equal to the
    in-memory consolidation of the same checkpoint."""
    weights = torch.load(work / "weights.pt", weights_only=True)
    assert torch.equal(weights["head.weight"], weights["embed.weight"])
    whole = consolidation.consolidate(checkpointing.resolve_checkpoint(work))
    assert list(whole) == list(weights)
    assert max((whole[k] - weights[k]).abs().max().item() for k in weights) == 0.0
    return weights


@pytest.fixture(scope="module")
def in_process_runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """The tied run of each backend, in the test's own workers (tests.harness, Tango's worker loop)."""
    root = tmp_path_factory.mktemp("tied")
    jobs = {backend: harness.Train(_tied_config(backend), root / backend) for backend in BACKENDS}
    for result in harness.run(list(jobs.values()), out=root / "harness"):
        result.check()
    return {backend: job.work_dir for backend, job in jobs.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_model_weights(in_process_runs: Dict[str, Path], backend: str) -> None:
    weights = _check_weights(in_process_runs[backend])
    TiedLM().load_state_dict(weights, strict=True)


#: Through the CLI, where the main process builds the step's result: extended. make test builds a
#: step's result through the CLI in tests/test_equivalence.py::test_step_result_is_the_trained_model
#: and keeps ties at library level (test_assign_state_dict_adopts_the_tensors_and_keeps_ties below);
#: the tied model's weights.pt is test_tied_model_weights's.
@pytest.mark.extended
@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_tied_model_result_and_weights(tmp_path: Path, backend: str) -> None:
    run_tango(_tied_config(backend), tmp_path / "ws", cwd=tmp_path / "cwd")
    work = train_work_dir(tmp_path / "ws")
    weights = _check_weights(work)
    workspace = LocalWorkspace(tmp_path / "ws")
    (run_name,) = workspace.registered_runs().keys()
    model = workspace.step_result_for_run(run_name, "train")
    # The result is the trained model: weights.pt's values, its head still tied to its embedding.
    assert isinstance(model, TiedLM)
    assert model.head.weight is model.embed.weight
    assert not any(p.is_meta for p in model.parameters())
    state = model.state_dict()
    assert state.keys() == weights.keys()
    assert max((state[k] - weights[k]).abs().max().item() for k in weights) == 0.0


def test_assign_state_dict_adopts_the_tensors_and_keeps_ties() -> None:
    trained = TiedLM()
    state = {name: tensor.clone() for name, tensor in trained.state_dict().items()}
    state["head.weight"] = state["embed.weight"]  # as torch.load gives a tied pair: one storage
    from tango_fairscale.materialize import parameters_on_meta

    with parameters_on_meta():
        model = TiedLM()
    assert all(p.is_meta for p in model.parameters())
    assign_state_dict(model, state)
    assert model.head.weight is model.embed.weight
    # Adopted, not copied: the parameter's memory is the loaded tensor's.
    assert model.embed.weight.data_ptr() == state["embed.weight"].data_ptr()
    assert model.blocks[0][1].weight.data_ptr() == state["blocks.0.1.weight"].data_ptr()
    assert all(p.requires_grad for p in model.parameters())


def test_a_parameter_missing_from_the_weights_is_initialised_not_left_on_meta(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tango_fairscale.materialize import parameters_on_meta

    state = {k: v for k, v in TiedLM().state_dict().items() if k != "blocks.2.1.bias"}
    with parameters_on_meta():
        model = TiedLM()
    assign_state_dict(model, state)
    assert not any(p.is_meta for p in model.parameters())
    assert "blocks.2.1.bias" in caplog.text


def test_final_model_on_meta_pickles_as_the_lazy_it_wraps() -> None:
    import pickle

    from tango.common import Lazy

    lazy = Lazy(nn.Linear, in_features=3, out_features=2)
    wrapped = FinalModelOnMeta(lazy)
    again = pickle.loads(pickle.dumps(wrapped))
    assert type(again) is Lazy and again.construct().weight.shape == (2, 3)
    built = wrapped.construct()
    assert built.weight.is_meta
    built.load_state_dict({"weight": torch.ones(2, 3), "bias": torch.zeros(2)})
    assert torch.equal(built.weight, torch.ones(2, 3)) and "load_state_dict" not in vars(built)


#: Builds of Tango's main process whose parameters go to meta, each in a fresh process (malloc's
#: thresholds are process-wide), printing VmData's growth over the build and the weights' bytes:
#: ``result``, the step's result of 64 blocks of two 2 MiB weights (a freed 32 MiB tensor first
#: raises glibc's dynamic mmap threshold, as in a process that has run); ``preflight``,
#: pre-flight's init_on_meta check of LoRA on the pretrained Llama in argv[2] (a tiny Llama's build
#: first imports transformers' and peft's modules: argv[3]).
_BUILD_ON_META = """
import sys
import torch
import torch.nn as nn
from tango.common import Lazy, Params
from tango.integrations.torch import Model
import tango_fairscale
from tango_fairscale.preflight import check_init_on_meta
from tango_fairscale.step_result import FinalModelOnMeta

class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(512), nn.Linear(512, 1024), nn.Linear(1024, 512)) for _ in range(64)
        )

def lora_on(path):
    pretrained = {"type": "fairscale::from_pretrained", "pretrained_model_name_or_path": path}
    lora = {"type": "fairscale::with_lora", "model": pretrained, "target_modules": ["q_proj", "v_proj"]}
    return Lazy(Model, Params(lora))

def vm_data():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))

if sys.argv[1] == "result":
    scratch = torch.empty(8 << 20)
    del scratch
    before = vm_data()
    model = FinalModelOnMeta(Lazy(Blocks)).construct()
    assert all(p.is_meta for p in model.parameters())
    weights = sum(p.numel() * 4 for p in model.parameters())
else:
    FinalModelOnMeta(lora_on(sys.argv[3])).construct()
    before = vm_data()
    check_init_on_meta(lora_on(sys.argv[2]))
    weights = int(sys.argv[4])
print(vm_data() - before, weights)
"""


def _growth_over_build(*args: str) -> Tuple[int, int]:
    result = subprocess.run(
        [sys.executable, "-c", _BUILD_ON_META, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    growth, weights = map(int, result.stdout.split()[-2:])
    return growth, weights


# Each parameter is allocated on the CPU and moved to meta at once (or, recorded, initialised on a
# scratch tensor); freed into the heap, its holes stayed and VmData kept them (docs/capacity.md,
# LoRA). Without the fix: 252 of 256 MiB (result); 43 to 275 MiB of 385 MiB in 4 runs (preflight).


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmData and glibc's malloc: Linux")
def test_building_the_step_result_on_meta_leaves_no_heap_behind() -> None:
    growth, weights = _growth_over_build("result")
    assert weights == 64 * 2 * (512 * 1024 * 4) + 64 * (1024 + 512 + 2 * 512) * 4
    assert growth < weights / 20, (growth, weights)


@pytest.mark.extended
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmData and glibc's malloc: Linux")
def test_preflight_init_on_meta_check_leaves_no_heap_behind(tiny_pretrained: TinyPretrained) -> None:
    # 16 layers of the capacity benchmark's Llama (385 MiB of weights): a smaller one did not
    # always leave its holes behind without the fix.
    shape = {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
    }
    wide = tiny_pretrained({**TINY_LLAMA, **shape, "num_hidden_layers": 16}, seed=0)
    tiny = tiny_pretrained(TINY_LLAMA, seed=0)
    weights = (wide / "model.safetensors").stat().st_size
    growth, _ = _growth_over_build("preflight", str(wide), str(tiny), str(weights))
    assert growth < weights / 20, (growth, weights)


# In a fresh process: VmData growth of loading a 256 MiB state dict the step result's way
# (load_final_weights) and torch's; then an in-place write to a loaded tensor.
_LOAD_FINAL = """
import sys
from pathlib import Path
import torch
from tango_fairscale.step_result import load_final_weights

def vm_data():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))

path = Path(sys.argv[1])
before = vm_data()
mapped = load_final_weights(torch.load, path, map_location="cpu")
grown_mapped = vm_data() - before
before = vm_data()
private = torch.load(path, map_location="cpu")
grown_private = vm_data() - before
assert all(torch.equal(mapped[k], private[k]) for k in private)
mapped["w0"].add_(1.0)  # written through the mapping: into its private copy, not the file
left = sorted(p.name for p in path.parent.iterdir())
print(grown_mapped, grown_private, ",".join(left))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="shared mappings and VmData: Linux")
def test_the_step_result_takes_its_weights_from_the_disk_not_memory(tmp_path: Path) -> None:
    """
    T7's load (step_result.load_final_weights): weights.pt's tensors as views of a shared mapping
    of a private copy of the file: the same values, none of them in the process's private memory
    (what RLIMIT_DATA counts), written without changing weights.pt, the copy gone from the directory.
    """
    from tango_fairscale.step_result import _on_tmpfs

    if _on_tmpfs(tmp_path):
        pytest.skip("the test's directory is on tmpfs, where the load reads into memory")
    weights = {f"w{i}": torch.randn(1 << 20) for i in range(64)}  # 256 MiB
    path = tmp_path / "work" / "weights.pt"
    path.parent.mkdir()
    torch.save(weights, path)
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_FINAL, str(path)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    grown_mapped, grown_private, left = result.stdout.split()
    mapped_mib, read_mib = int(grown_mapped) >> 20, int(grown_private) >> 20
    print(f"VmData growth loading 256 MiB: {mapped_mib} MiB mapped, {read_mib} MiB read")
    assert int(grown_private) >= 256 << 20
    assert int(grown_mapped) < 8 << 20
    assert left == "weights.pt"  # the copy was unlinked once mapped
    assert all(torch.equal(v, weights[k]) for k, v in torch.load(path, weights_only=True).items())


def test_on_tmpfs_the_step_result_reads_its_weights_into_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy on tmpfs would be memory as well: the load reads the file as torch does, and copies nothing."""
    from tango_fairscale import step_result

    path = tmp_path / "weights.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    loads = []

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        loads.append((Path(f), kwargs.get("mmap")))
        return torch.load(f, *args, **kwargs)

    monkeypatch.setattr(step_result, "_on_tmpfs", lambda directory: True)
    loaded = step_result.load_final_weights(load, path, map_location="cpu")
    assert torch.equal(loaded["w"], torch.arange(4.0))
    assert loads == [(path, None)] and sorted(p.name for p in tmp_path.iterdir()) == ["weights.pt"]


def _mapped_copies() -> List[str]:
    """This process's mappings of a deleted copy of weights.pt (T7's)."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if ".weights.pt." in line]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="shared mappings: Linux")
def test_t7_routes_tangos_load_of_the_final_weights_only(tmp_path: Path) -> None:
    """
    compat.final_weights_from_disk: Tango's load of its TrainConfig's final_weights_path, by this
    thread, is mapped from a deleted copy; another thread's load, a load asking for mmap itself and
    a load of another file are torch's; torch.load is itself again after the block.
    """
    import threading

    from tango.integrations.torch import TrainConfig

    from tango_fairscale import compat
    from tango_fairscale.step_result import _on_tmpfs, load_final_weights

    if _on_tmpfs(tmp_path):
        pytest.skip("the test's directory is on tmpfs, where the load reads into memory")
    config = TrainConfig("step", tmp_path)
    weights = {"w": torch.arange(1 << 20, dtype=torch.float32)}
    torch.save(weights, config.final_weights_path)
    torch.save(weights, tmp_path / "other.pt")
    original = torch.load
    from_thread: List[Any] = []
    with compat.final_weights_from_disk(tmp_path / "weights.pt", load_final_weights):
        assert torch.load is not original
        thread = threading.Thread(target=lambda: from_thread.append(torch.load(config.final_weights_path)))
        thread.start()
        thread.join()
        assert not _mapped_copies()
        passed = [
            torch.load(config.final_weights_path, map_location="cpu", mmap=True),
            torch.load(tmp_path / "other.pt", map_location="cpu"),
        ]
        assert not _mapped_copies()
        routed = torch.load(config.final_weights_path, map_location="cpu")
        mapped = _mapped_copies()
        assert mapped and all(line.endswith("(deleted)") for line in mapped), mapped
    assert torch.load is original
    for loaded in [*from_thread, *passed, routed]:
        assert torch.equal(loaded["w"], weights["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.pt", "weights.pt"]
