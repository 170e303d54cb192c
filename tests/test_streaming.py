"""
Writing a state dict one tensor at a time (:mod:`tango_fairscale.checkpointing.streaming`), and
consolidation through it (:mod:`tango_fairscale.checkpointing.consolidation`): the files load with
``torch.load(weights_only=True)`` and equal what the in-memory consolidation gives.
"""

from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tango_fairscale import checkpointing
from tango_fairscale.checkpointing import consolidation
from tango_fairscale.checkpointing.streaming import TensorEntry, stream_save
from tango_fairscale.errors import CheckpointError
from tests.conftest import ToyTrain


def _entries(state: Dict[str, torch.Tensor], aliases: Dict[str, str]) -> List[TensorEntry]:
    return [TensorEntry(name, tuple(t.shape), t.dtype, aliases.get(name)) for name, t in state.items()]


def test_stream_save_writes_what_torch_load_reads(tmp_path: Path) -> None:
    state = {
        "weight": torch.randn(3, 4),
        "index": torch.arange(5, dtype=torch.int64),
        "half": torch.randn(6, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    state["tied"] = state["weight"]
    produced: List[str] = []

    def produce(entry: TensorEntry) -> torch.Tensor:
        produced.append(entry.name)
        return state[entry.name]

    path = tmp_path / "weights.pt"
    stream_save(_entries(state, {"tied": "weight"}), produce, path)
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == list(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    # An alias is one storage under two names, as torch.save writes a shared tensor, and is
    # produced once.
    assert loaded["tied"].untyped_storage().data_ptr() == loaded["weight"].untyped_storage().data_ptr()
    assert produced == ["weight", "index", "half", "scalar", "empty"]
    # Memory-mapped loading reads it too.
    assert torch.equal(torch.load(path, weights_only=True, mmap=True)["weight"], state["weight"])


def test_stream_save_writes_only_a_views_own_elements(tmp_path: Path) -> None:
    base = torch.arange(20, dtype=torch.float32)
    view = base[5:11].view(2, 3)
    stream_save([TensorEntry("view", (2, 3), torch.float32)], lambda entry: view, tmp_path / "v.pt")
    loaded = torch.load(tmp_path / "v.pt", weights_only=True)["view"]
    assert torch.equal(loaded, view) and loaded.untyped_storage().nbytes() == 6 * 4


def test_stream_save_is_atomic_and_checks_what_it_is_given(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save({"old": torch.ones(2)}, path)
    entries = [TensorEntry("a", (2,), torch.float32), TensorEntry("b", (3,), torch.float32)]

    def failing(entry: TensorEntry) -> torch.Tensor:
        if entry.name == "b":
            raise OSError(28, "No space left on device")
        return torch.zeros(2)

    # One line naming the file and the OS error, not the serializer's traceback.
    with pytest.raises(
        CheckpointError, match=r"Cannot write .*weights.pt: No space left on device \(ENOSPC\)"
    ):
        stream_save(entries, failing, path)
    # The old file is intact, and nothing else is left in the directory.
    assert torch.equal(torch.load(path, weights_only=True)["old"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.pt"]
    with pytest.raises(ValueError, match=r"b: produced a torch.float32 tensor of shape \[2\], where"):
        stream_save(entries, lambda entry: torch.zeros(2), path)
    with pytest.raises(ValueError, match="is an alias of 'later'"):
        stream_save([TensorEntry("x", (2,), torch.float32, "later")], lambda entry: torch.zeros(2), path)


@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_streamed_consolidation_equals_the_in_memory_one(
    toy_train: ToyTrain, tmp_path: Path, backend: str
) -> None:
    work = toy_train("fairscale", "nested", backend)
    checkpoint = checkpointing.resolve_checkpoint(work)
    whole = consolidation.consolidate(checkpoint)
    streamed_path = tmp_path / "streamed.pt"
    consolidation.save_model(consolidation.model_source(checkpoint), streamed_path)
    streamed = torch.load(streamed_path, weights_only=True)
    assert list(streamed) == list(whole)
    for name in whole:
        assert streamed[name].dtype == whole[name].dtype
        assert (streamed[name] - whole[name]).abs().max().item() == 0.0, name
    # The step's weights.pt is the streamed consolidation of the best checkpoint.
    weights = torch.load(work / "weights.pt", weights_only=True)
    assert weights.keys() == streamed.keys()
    assert max((weights[k] - streamed[k]).abs().max().item() for k in weights) == 0.0
