"""The checkpoint file protocol and the shard arithmetic, without training (fast unit tests)."""

import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from tango_fairscale import CheckpointError, checkpointing
from tango_fairscale.backends.fairscale_fsdp import resharding
from tests.helpers import REPO

# What a model file holds: this package's (with the keys resharding needs) and the bundled
# integration's (FairScale's local state dict and shard metadata only).
OWN_MODEL_FILE = {"weights": {}, "metadata": {}, "optimizer_keys": [], "module_aliases": []}
BUNDLED_MODEL_FILE = {"weights": {"flat_param_0": torch.zeros(4)}, "metadata": {"param_metadata": []}}


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda d: None, "is not a tango-fairscale checkpoint"),
        (lambda d: torch.save(OWN_MODEL_FILE, d / "worker0_model.pt"), "is an incomplete checkpoint"),
        # The torch backend's: its DCP files and per-worker states, no worker*_model.pt.
        (lambda d: torch.save({}, d / "worker0_trainer.pt"), "is an incomplete checkpoint"),
        (
            lambda d: (d / "dcp").mkdir() or (d / "dcp" / "__0_0.distcp").write_bytes(b""),
            "is an incomplete checkpoint",
        ),
        (
            lambda d: torch.save(BUNDLED_MODEL_FILE, d / "worker0_model.pt"),
            "bundled tango.integrations.fairscale",
        ),
    ],
    ids=["empty", "interrupted", "interrupted-torch", "interrupted-torch-dcp-only", "bundled-integration"],
)
def test_consolidate_refuses_foreign_or_incomplete_dirs(make: Any, fragment: str, tmp_path: Path) -> None:
    make(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "tango_fairscale", "consolidate", str(tmp_path), str(tmp_path / "out.pt")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert fragment in result.stderr
    assert not (tmp_path / "out.pt").exists()


def test_reshard_takes_each_workers_chunk_of_the_unpadded_whole() -> None:
    # Ten elements saved by 3 workers in FairScale's layout (chunks of 4, the last padded by 2),
    # resharded onto 1 to 7 workers: each chunk of the whole, the last padded with zeros.
    whole = torch.arange(1.0, 11.0)
    saved = [torch.tensor([1.0, 2, 3, 4]), torch.tensor([5.0, 6, 7, 8]), torch.tensor([9.0, 10, 0, 0])]
    paddings = [{"p": 0}, {"p": 0}, {"p": 2}]
    for world_size in range(1, 8):
        shard_numel = -(-whole.numel() // world_size)
        for rank in range(world_size):
            expected = torch.zeros(shard_numel)
            piece = whole[rank * shard_numel : (rank + 1) * shard_numel]
            expected[: piece.numel()] = piece
            got = resharding._reshard("p", saved, paddings, shard_numel, rank)
            assert torch.equal(got, expected), (world_size, rank)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_safe_load_can_map_the_file(tmp_path: Path) -> None:
    path = tmp_path / "worker0_model.pt"
    torch.save({"weights": {"w": torch.arange(1000.0)}}, path)
    mapped = checkpointing.safe_load(path, mmap=True)
    assert torch.equal(mapped["weights"]["w"], torch.arange(1000.0))
    assert str(path) in Path("/proc/self/maps").read_text()


def test_marker_lists_every_file_a_worker_must_have(tmp_path: Path) -> None:
    for worker in range(2):
        for name in ("model", "optimizer", "trainer"):
            torch.save({}, checkpointing.worker_file(tmp_path, worker, name))
    checkpointing.write_marker(tmp_path, world_size=2, extra={"files": ["model", "optimizer", "trainer"]})
    assert checkpointing.is_complete(tmp_path)
    assert checkpointing.require_complete(tmp_path)["world_size"] == 2
    checkpointing.worker_file(tmp_path, 1, "optimizer").unlink()
    assert not checkpointing.is_complete(tmp_path)
    with pytest.raises(CheckpointError, match=r"incomplete: missing \['worker1_optimizer.pt'\]"):
        checkpointing.require_complete(tmp_path)


def write_checkpoint(directory: Path, world_size: int = 2, step: int = 4) -> None:
    """A complete checkpoint of format 2 holding small model files, as the engine writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    digests = {}
    for rank in range(world_size):
        state = {**OWN_MODEL_FILE, "weights": {"flat_param_0": torch.full((4,), float(rank))}}
        path = checkpointing.worker_file(directory, rank, "model")
        wrapped = checkpointing.with_header(state, kind="model", rank=rank, world_size=world_size, step=step)
        digests[path.name] = checkpointing.atomic_save(wrapped, path)
    checkpointing.write_marker(
        directory, world_size, extra={"training_steps": step, "files": ["model"], "digests": digests}
    )


def test_digest_is_computed_while_writing(tmp_path: Path) -> None:
    digest = checkpointing.atomic_save({"w": torch.arange(10_000.0)}, tmp_path / "f.pt")
    assert digest == checkpointing.file_digest(tmp_path / "f.pt")
    assert digest["size"] == (tmp_path / "f.pt").stat().st_size


def test_untouched_checkpoint_loads(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    shards = resharding.load_model_shards(tmp_path)
    assert [float(s["weights"]["flat_param_0"][0]) for s in shards] == [0.0, 1.0]


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    # In the middle of the file: inside the tensor data, not the zip directory.
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, fragment",
    [
        (flip_one_byte, "its contents changed after the checkpoint was written"),
        (lambda p: p.write_bytes(p.read_bytes()[:-10]), "it was changed or truncated"),
    ],
    ids=["flipped-byte", "truncated"],
)
def test_changed_file_is_refused(damage: Any, fragment: str, tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    damage(tmp_path / "worker1_model.pt")
    with pytest.raises(CheckpointError, match=rf"worker1_model.pt .*{fragment}"):
        resharding.load_model_shards(tmp_path)


def test_swapped_files_are_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    zero, one = tmp_path / "worker0_model.pt", tmp_path / "worker1_model.pt"
    swap = tmp_path / "swap"
    zero.rename(swap)
    one.rename(zero)
    swap.rename(one)
    # Even with the marker's digests rewritten to match, the headers give the swap away.
    marker = checkpointing.read_marker(tmp_path)
    assert marker is not None
    marker["digests"] = {name: checkpointing.file_digest(tmp_path / name) for name in marker["digests"]}
    checkpointing.write_marker(tmp_path, 2, extra={k: v for k, v in marker.items() if k != "world_size"})
    with pytest.raises(
        CheckpointError, match=r"worker0_model.pt does not belong .* rank 1 where 0 was expected"
    ):
        resharding.load_model_shards(tmp_path)


def test_symlinked_shard_is_not_followed(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "a")
    write_checkpoint(tmp_path / "b")
    (tmp_path / "a" / "worker1_model.pt").unlink()
    (tmp_path / "a" / "worker1_model.pt").symlink_to(tmp_path / "b" / "worker1_model.pt")
    with pytest.raises(CheckpointError, match="worker1_model.pt is a symbolic link .* not followed"):
        resharding.load_model_shards(tmp_path / "a")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{not json", "is malformed"),
        ('{"world_size": "2"}', "world_size must be a positive whole number, got '2'"),
        ('{"world_size": 2, "files": "model"}', "files must be a list of names"),
    ],
)
def test_malformed_marker_is_not_called_interrupted(text: str, fragment: str, tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / checkpointing.MARKER).write_text(text)
    assert not checkpointing.is_complete(tmp_path)
    with pytest.raises(CheckpointError, match=fragment):
        checkpointing.require_complete(tmp_path)


def test_wrong_world_size_in_marker_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    marker = checkpointing.read_marker(tmp_path)
    assert marker is not None
    checkpointing.write_marker(tmp_path, 1, extra={k: v for k, v in marker.items() if k != "world_size"})
    with pytest.raises(CheckpointError, match="world_size 2 where 1 was expected"):
        resharding.load_model_shards(tmp_path)


def test_newest_complete_checkpoint_without_the_latest_link(tmp_path: Path) -> None:
    for step in (3, 6, 9):
        write_checkpoint(tmp_path / f"checkpoint_state_step{step}", step=step)
    (tmp_path / "checkpoint_state_step9" / checkpointing.MARKER).unlink()  # interrupted
    (tmp_path / "checkpoint_state_latest").symlink_to("checkpoint_state_step12")  # dangling
    assert checkpointing.newest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint_state_step6"
    assert checkpointing.newest_complete_checkpoint(tmp_path / "checkpoint_state_step3") is None


def unit_metadata(width: int) -> Dict[str, Any]:
    return {
        "param_metadata": [
            {
                "fsdp_path": "blocks.0",
                "params": {
                    "flat_param_0": {
                        "names": ["linear.weight", "linear.bias"],
                        "shapes": [[width, width], [width]],
                        "numels": [width * width, width],
                        "padding": 0,
                    }
                },
            }
        ]
    }


def test_parameters_of_another_size_are_refused() -> None:
    resharding.check_same_parameter_shapes(unit_metadata(32), unit_metadata(32))
    with pytest.raises(
        CheckpointError, match=r"blocks.0.linear.weight: saved \[64, 64\], this model \[32, 32\]"
    ):
        resharding.check_same_parameter_shapes(unit_metadata(64), unit_metadata(32))


def test_random_state_round_trips_through_a_weights_only_file(tmp_path: Path) -> None:
    import random

    import numpy as np

    from tango_fairscale.checkpointing import random_state

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state
    saved = random_state.capture()
    expected = (random.random(), np.random.rand(), torch.rand(3), torch.nn.functional.dropout(torch.ones(8)))
    checkpointing.atomic_save(saved, tmp_path / "rng.pt")
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    random_state.restore(checkpointing.safe_load(tmp_path / "rng.pt"))
    again = (random.random(), np.random.rand(), torch.rand(3), torch.nn.functional.dropout(torch.ones(8)))
    assert expected[:2] == again[:2]
    assert torch.equal(expected[2], again[2]) and torch.equal(expected[3], again[3])
