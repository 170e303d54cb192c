"""
The frozen pretrained base of a checkpoint (:mod:`tango_fairscale.checkpointing.pretrained_base`),
in process: which parameters are collected, how the files are checked, and the model source that
reads the left-out tensors back from the files.
"""

from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from tango_fairscale.checkpointing import pretrained_base
from tango_fairscale.checkpointing.streaming import TensorEntry
from tango_fairscale.errors import CheckpointError
from tango_fairscale.finetune.pretrained import SafetensorsFiles, mark_from_files
from tango_fairscale.materialize import mark_pretrained, parameters_on_meta


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.adapter = nn.Linear(3, 3)


@pytest.fixture
def files(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    save_file(
        {
            "embed.weight": torch.randn(5, 3),
            "adapter.weight": torch.randn(3, 3),
            "adapter.bias": torch.randn(3),
        },
        str(tmp_path / "model.safetensors"),
    )
    return tmp_path


def _built(directory: Path, freeze: List[str]) -> nn.Module:
    with parameters_on_meta():
        model = Tied()
    mark_from_files(model, SafetensorsFiles(directory))
    for name, param in model.named_parameters():
        param.requires_grad = name not in freeze
    return model


def test_frozen_pretrained_parameters_are_collected_under_every_name(files: Path) -> None:
    model = _built(files, ["embed.weight"])
    base = pretrained_base.frozen_base(model)
    assert base is not None
    path = str(files / "model.safetensors")
    # The tied head is the embedding's parameter: both names, one tensor of the file.
    assert base.tensors == {"embed.weight": (path, "embed.weight"), "head.weight": (path, "embed.weight")}
    fields = base.marker_fields()
    assert fields["files"][path]["size"] == (files / "model.safetensors").stat().st_size
    assert pretrained_base.frozen_base(_built(files, [])) is None  # nothing frozen


def test_a_pretrained_parameter_written_after_it_was_read_is_not_base(files: Path) -> None:
    with parameters_on_meta():
        model = Tied()
        mark_from_files(model, SafetensorsFiles(files))
        with torch.no_grad():
            model.embed.weight.mul_(2.0)  # no longer the file's value
    model.requires_grad_(False)
    base = pretrained_base.frozen_base(model)
    assert base is not None and set(base.tensors) == {"adapter.weight", "adapter.bias"}


def test_parameters_without_a_file_are_not_base() -> None:
    with parameters_on_meta():
        model = nn.Linear(2, 2)
    mark_pretrained(model.weight, lambda: torch.zeros(2, 2))  # a value, but no file named
    model.requires_grad_(False)
    assert pretrained_base.frozen_base(model) is None


def test_changed_or_missing_files_are_refused_naming_them(files: Path) -> None:
    base = pretrained_base.frozen_base(_built(files, ["embed.weight", "adapter.weight"]))
    assert base is not None
    fields = base.marker_fields()
    pretrained_base.check_files(fields)
    file = files / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))
    pretrained_base.check_files(fields, hashes=False)  # the same size: only the hash sees it
    with pytest.raises(CheckpointError, match=f"The pretrained file {file} changed .*SHA-256 differs"):
        pretrained_base.check_files(fields)
    file.write_bytes(bytes(data[:-4]))
    with pytest.raises(CheckpointError, match="size differs"):
        pretrained_base.check_files(fields, hashes=False)
    file.unlink()
    with pytest.raises(CheckpointError, match=f"read from {file}, which is gone"):
        pretrained_base.check_files(fields)


def test_a_changed_config_beside_the_files_is_refused(files: Path) -> None:
    """The base's config.json is in its digests: a base under another config is not the saved model."""
    config = files / "config.json"
    config.write_text('{"rms_norm_eps": 1e-06}')
    base = pretrained_base.frozen_base(_built(files, ["embed.weight"]))
    assert base is not None
    fields = base.marker_fields()
    assert set(fields["files"]) == {str(files / "model.safetensors"), str(config)}
    pretrained_base.check_files(fields)
    config.write_text('{"rms_norm_eps": 0.125}')  # the same size: the hash sees it
    with pytest.raises(CheckpointError, match=f"The pretrained file {config} changed .*SHA-256 differs"):
        pretrained_base.check_files(fields)


def test_left_out_parameters_must_be_the_same_tensors_of_both_runs(files: Path) -> None:
    base = pretrained_base.frozen_base(_built(files, ["embed.weight"]))
    assert base is not None
    saved = base.marker_fields()
    pretrained_base.check_same_base(saved, base, ["embed.weight", "head.weight"])
    with pytest.raises(CheckpointError, match="holds no value for adapter.weight"):
        pretrained_base.check_same_base(saved, base, ["adapter.weight"])
    with pytest.raises(CheckpointError, match="holds no value for embed.weight"):
        pretrained_base.check_same_base(None, base, ["embed.weight"])


class _Source:
    """A checkpoint's model source holding only the adapter."""

    def __init__(self, state: Dict[str, torch.Tensor]) -> None:
        self.state = state
        self.entries = [TensorEntry(k, tuple(v.shape), v.dtype) for k, v in state.items()]

    def produce(self, entry: TensorEntry) -> torch.Tensor:
        return self.state[entry.name]


def test_the_left_out_base_is_read_back_from_the_files(files: Path) -> None:
    base = pretrained_base.frozen_base(_built(files, ["embed.weight"]))
    assert base is not None
    marker = {pretrained_base.MARKER_FIELD: base.marker_fields()}
    trained = {"adapter.weight": torch.ones(3, 3), "adapter.bias": torch.zeros(3)}
    source = pretrained_base.with_base(_Source(trained), marker)
    entries = {entry.name: entry for entry in source.entries}
    assert entries["head.weight"].alias_of == "embed.weight"  # tied: written once
    state = pretrained_base.materialize(source)
    from safetensors.torch import load_file

    expected = load_file(str(files / "model.safetensors"))["embed.weight"]
    assert torch.equal(state["embed.weight"], expected) and state["head.weight"] is state["embed.weight"]
    assert torch.equal(state["adapter.weight"], trained["adapter.weight"])
    added = pretrained_base.add_base_tensors(dict(trained), marker)
    assert added.keys() == {"adapter.weight", "adapter.bias", "embed.weight", "head.weight"}
    assert pretrained_base.with_base(_Source(trained), {}).entries == _Source(trained).entries


def test_entries_a_source_lists_but_cannot_produce_come_from_the_files_in_place(files: Path) -> None:
    # The fairscale backend lists a left-out flat parameter's tensors where the model has them.
    base = pretrained_base.frozen_base(_built(files, ["embed.weight"]))
    assert base is not None
    marker = {pretrained_base.MARKER_FIELD: base.marker_fields()}
    source = _Source(
        {"adapter.weight": torch.ones(3, 3), "embed.weight": torch.empty(0), "adapter.bias": torch.zeros(3)}
    )
    source.entries.append(TensorEntry("head.weight", (0,), torch.float64, "embed.weight"))
    source.left_out = {"embed.weight"}  # type: ignore[attr-defined]
    entries = pretrained_base.with_base(source, marker).entries
    assert [e.name for e in entries] == ["adapter.weight", "embed.weight", "adapter.bias", "head.weight"]
    assert entries[1] == TensorEntry("embed.weight", (5, 3), torch.float32)
    assert entries[3] == TensorEntry("head.weight", (5, 3), torch.float32, "embed.weight")
    source.left_out = {"adapter.weight"}  # type: ignore[attr-defined]
    with pytest.raises(CheckpointError, match="holds no value for adapter.weight, and names no file"):
        pretrained_base.with_base(source, marker)
