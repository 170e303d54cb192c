"""
What an output may replace (:mod:`tango_fairscale.output_paths`): ``export_hf`` (the engine's
option, pre-flight and ``consolidate --format hf``) and ``consolidate --force`` replace only an
earlier output of their own kind; a Tango workspace, a step's work directory, its checkpoints,
``weights.pt``, metrics log and checkpoint link, and any file or directory the package did not
write are refused in one line and left as they were (loaded back). A rerun removes the
temporaries an interrupted export, ``weights.pt`` or ``consolidate`` left, and nothing else.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
from tango.common.exceptions import ConfigurationError

from examples.toy.components import ToyRegressor
from tango_fairscale import checkpointing, output_paths
from tango_fairscale.checkpointing import consolidation
from tango_fairscale.checkpointing.streaming import TensorEntry, stream_save
from tango_fairscale.cli import main
from tango_fairscale.errors import CheckpointError
from tango_fairscale.output_paths import (
    CONSOLIDATED,
    EXPORT_MARKER,
    HF_EXPORT,
    PT_MARKER_RECORD,
    check_output,
)
from tango_fairscale.preflight import check_engine
from tango_fairscale.telemetry.metrics import METRICS_FILE_NAME
from tests import harness
from tests.conftest import ToyTrain
from tests.helpers import (
    REPO,
    one_line_error,
    run_tango,
    tango_env,
    train_config,
    word_tokenizer,
)

pytest.importorskip("transformers")

Snapshot = Dict[str, Any]
#: A small GPT-2 without dropout (tied embedding and head).
GPT2 = {"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 32, "n_positions": 8}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def snapshot(root: Path) -> Snapshot:
    """Every entry under ``root``: a file's bytes, a link's target, a directory's presence."""
    entries: Snapshot = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                entries[key] = ("link", os.readlink(path))
            elif path.is_dir():
                entries[key] = ("dir",)
            else:
                entries[key] = path.read_bytes()
    return entries


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def gpt2_weights(seed: int) -> Dict[str, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**GPT2, **NO_DROPOUT)).state_dict()


def gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(**GPT2, **NO_DROPOUT, architectures=["GPT2LMHeadModel"])


def export(weights_pt: Path, directory: Path, **kwargs: Any) -> Path:
    """The export the engine and ``consolidate --format hf`` run, from a ``weights.pt``."""
    from tango_fairscale.finetune.hf_export import export_hf, weights_file

    return export_hf(weights_file(weights_pt), directory, gpt2_config(), **kwargs)


def load_exported(directory: Path) -> Dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def assert_same_weights(loaded: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)


@pytest.fixture
def workspace(tmp_path: Path) -> Tuple[Path, Path]:
    """
    A Tango workspace (made by Tango) with a step's work directory as a run leaves it: a complete
    checkpoint, the latest link, ``weights.pt`` (a GPT-2's) and the metrics log.
    """
    from tango.workspaces import LocalWorkspace

    ws = tmp_path / "ws"
    LocalWorkspace(ws)
    work = ws / "cache" / "TorchTrainStep-abc123" / "work"
    checkpoint = work / "checkpoint_state_step4"
    checkpoint.mkdir(parents=True)
    for worker in range(2):
        torch.save(
            {"w": torch.full((3,), float(worker))}, checkpointing.worker_file(checkpoint, worker, "model")
        )
    checkpointing.write_marker(checkpoint, world_size=2, extra={"files": ["model"]})
    (work / "checkpoint_state_latest").symlink_to("checkpoint_state_step4")
    torch.save(gpt2_weights(1), work / "weights.pt")
    (work / METRICS_FILE_NAME).write_text('{"step": 1, "loss": 2.0}\n')
    return ws, work


def test_the_metrics_file_name_is_the_metrics_callbacks() -> None:
    assert output_paths.METRICS_FILE_NAME == METRICS_FILE_NAME


# --- export_hf: what it refuses ------------------------------------------------------------------

#: export_hf's path (relative to the work directory, as the engine resolves it; WS: the
#: workspace), and the refusal's text after the path.
REFUSED = [
    (".", "it is the step's work directory {work}"),
    ("..", "it holds the step's work directory {work}"),
    ("WS", "it is the Tango workspace {ws}"),
    ("weights.pt", "it is the step's weights {work}/weights.pt"),
    (METRICS_FILE_NAME, "it is the step's metrics log {work}/metrics.jsonl"),
    ("checkpoint_state_latest", "it is the step's checkpoint link {work}/checkpoint_state_latest"),
    ("checkpoint_state_step4", "it is the step's checkpoint directory {work}/checkpoint_state_step4"),
    ("checkpoint_state_step4/hf", "inside the checkpoint directory {work}/checkpoint_state_step4"),
    ("../hf", "inside the Tango workspace {ws}, whose directories are Tango's"),
    ("WS/cache", "it holds the step's work directory {work}"),
    ("WS/runs/hf", "inside the Tango workspace {ws}, whose directories are Tango's"),
]


@pytest.mark.parametrize("target, refusal", REFUSED, ids=[case[0] for case in REFUSED])
def test_export_hf_refuses_what_a_run_owns(workspace: Tuple[Path, Path], target: str, refusal: str) -> None:
    ws, work = workspace
    root = ws.parent
    before = snapshot(root)
    path = Path(target.replace("WS", str(ws))) if target.startswith("WS") else work / target
    with pytest.raises(CheckpointError) as raised:
        export(work / "weights.pt", path, work_dir=work, label="training_engine.export_hf")
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"refusing to write {path} (training_engine.export_hf)"), message
    assert refusal.format(work=work, ws=ws) in message, message
    # Nothing removed, nothing added, nothing changed; the step's files load back.
    assert snapshot(root) == before
    assert_same_weights(torch.load(work / "weights.pt", weights_only=True), gpt2_weights(1))
    checkpointing.require_complete(checkpointing.resolve_checkpoint(work))


def test_export_hf_refuses_a_directory_or_file_it_did_not_write(
    workspace: Tuple[Path, Path], tmp_path: Path
) -> None:
    from transformers import GPT2LMHeadModel

    ws, work = workspace
    # The user's own pretrained model (what save_pretrained writes, no marker), a directory of
    # notes, a file, and a link to an export.
    pretrained = tmp_path / "models" / "gpt2"
    model = GPT2LMHeadModel(gpt2_config())
    model.save_pretrained(pretrained)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    a_file = tmp_path / "file"
    a_file.write_text("keep me")
    previous = export(work / "weights.pt", tmp_path / "export")
    link = tmp_path / "link"
    link.symlink_to(previous)
    before = snapshot(tmp_path)
    for path, refusal in [
        (pretrained, "it is a directory this package did not write (no tango_fairscale_export.json)"),
        (notes, "it is a directory this package did not write"),
        (a_file, "it is a file this package did not write"),
        (link, f"it is a symbolic link (to {previous})"),
    ]:
        with pytest.raises(CheckpointError) as raised:
            export(work / "weights.pt", path)
        assert str(raised.value).startswith(f"refusing to replace {path}: {refusal}"), raised.value
        assert "remove it yourself or choose another path" in str(raised.value) or path == link
    assert snapshot(tmp_path) == before
    assert_same_weights(load_exported(pretrained), model.state_dict())


def test_export_hf_replaces_only_an_earlier_export(workspace: Tuple[Path, Path]) -> None:
    ws, work = workspace
    target = work / "hf"
    export(work / "weights.pt", target, work_dir=work)
    assert_same_weights(load_exported(target), gpt2_weights(1))
    marker = json.loads((target / EXPORT_MARKER).read_text())
    assert marker["written_by"] == "tango_fairscale" and marker["output"] == HF_EXPORT
    assert sorted(marker["files"]) == sorted(p.name for p in target.iterdir() if p.name != EXPORT_MARKER)

    # Other weights exported again over it: replaced, nothing left beside it.
    before = {p.name for p in work.iterdir()}
    torch.save(gpt2_weights(2), work / "weights.pt")
    export(work / "weights.pt", target, work_dir=work)
    assert_same_weights(load_exported(target), gpt2_weights(2))
    assert {p.name for p in work.iterdir()} == before

    # A file of the user's in the export: the directory is no longer only an export.
    (target / "README.md").write_text("my notes")
    kept = snapshot(target)
    with pytest.raises(CheckpointError, match=r"it holds README\.md, which no export wrote"):
        export(work / "weights.pt", target, work_dir=work)
    assert snapshot(target) == kept


def test_outputs_of_the_other_kind_are_refused(workspace: Tuple[Path, Path], tmp_path: Path) -> None:
    _, work = workspace
    directory = export(work / "weights.pt", tmp_path / "hf")
    with pytest.raises(
        CheckpointError, match="it is a from_pretrained directory, not a consolidated .pt file"
    ):
        check_output(directory, CONSOLIDATED)
    pt = tmp_path / "full.pt"
    entries = [TensorEntry("w", (3,), torch.float32)]
    stream_save(
        entries, lambda _: torch.ones(3), pt, records={PT_MARKER_RECORD: output_paths.marker(CONSOLIDATED)}
    )
    assert output_paths.is_consolidated_file(pt)
    check_output(pt, CONSOLIDATED)  # replaceable
    with pytest.raises(
        CheckpointError, match="it is a consolidated .pt file, not a from_pretrained directory"
    ):
        check_output(pt, HF_EXPORT)
    # The marker record changes nothing torch.load reads.
    assert torch.equal(torch.load(pt, weights_only=True, mmap=True)["w"], torch.ones(3))


# --- pre-flight ----------------------------------------------------------------------------------


def test_preflight_checks_export_hf_where_the_engine_writes_it(tmp_path: Path) -> None:
    from tango.workspaces import LocalWorkspace

    # A fresh run: Tango made the workspace and the step's (still empty) work directory.
    ws = tmp_path / "ws"
    LocalWorkspace(ws)
    work = ws / "cache" / "TorchTrainStep-abc123" / "work"
    work.mkdir(parents=True)
    engine = {"type": "fairscale"}
    before = snapshot(tmp_path)
    for allowed in ("hf", "exports/hf", str(tmp_path / "elsewhere" / "hf")):
        check_engine({**engine, "export_hf": allowed}, 2, work)
    for target, refusal in [
        ("weights.pt", f"it is the step's weights {work}/weights.pt"),
        (".", f"it is the step's work directory {work}"),
        (str(ws), f"it is the Tango workspace {ws}"),
        ("../hf", f"inside the Tango workspace {ws}"),
        (
            "checkpoint_state_step2/hf",
            f"inside the step's checkpoint directory {work}/checkpoint_state_step2",
        ),
    ]:
        with pytest.raises(ConfigurationError) as raised:
            check_engine({**engine, "export_hf": target}, 2, work)
        assert str(raised.value).startswith("training_engine.export_hf: refusing to write "), raised.value
        assert refusal in str(raised.value), raised.value
    with pytest.raises(
        ConfigurationError, match="training_engine.export_hf: expected a directory path, got 3"
    ):
        check_engine({**engine, "export_hf": 3}, 2, work)
    # Two outputs of one run never share a path: the merged export apart from the adapter's.
    check_engine({**engine, "export_hf": "adapter", "export_hf_merged": "merged"}, 2, work)
    for merged in ("adapter", "./adapter/", "adapter/merged"):
        with pytest.raises(ConfigurationError, match=r"export_hf_merged: .* overlaps export_hf 'adapter'"):
            check_engine({**engine, "export_hf": "adapter", "export_hf_merged": merged}, 2, work)
    assert snapshot(tmp_path) == before


def test_export_hf_at_the_workspace_is_refused_by_tango_run_before_training(tmp_path: Path) -> None:
    """The one end-to-end proof: before, this run deleted the whole workspace at its end."""
    ws = tmp_path / "ws"
    config = train_config(
        train_steps=2, checkpoint_every=2, callbacks=[], engine_extra={"export_hf": str(ws)}
    )
    result = run_tango(config, ws, cwd=tmp_path / "cwd", check=False, timeout=180)
    assert result.returncode != 0
    error = one_line_error(result.stdout + result.stderr)
    assert error.startswith(
        "ConfigurationError: training_engine.export_hf: refusing to write "
        f"{ws}: it is the Tango workspace {ws};"
    ), error
    # Refused before anything trained: the workspace is whole, no checkpoint was written.
    assert {"cache", "runs", "settings.json"} <= {p.name for p in ws.iterdir()}
    assert not list(ws.glob("cache/*/work/checkpoint_state_*"))


# --- temporaries ---------------------------------------------------------------------------------


def hide(path: Path, pid: int, suffix: str = "tmp", host: bool = True) -> Path:
    """The name a writer of ``path`` in process ``pid`` gives its temporary."""
    middle = f"{output_paths._host()}.{pid}" if host else str(pid)
    return path.with_name(f".{path.name}.{middle}.0123abcd.{suffix}")


def stale_export_temporaries(target: Path) -> Tuple[List[Path], List[Path]]:
    """Beside an export ``target``: what interrupted exports left, and entries that look alike but are not."""
    dead = dead_pid()
    stale_tmp = hide(target, dead)  # killed while writing: the token its name carries, inside
    stale_tmp.mkdir()
    (stale_tmp / output_paths.TEMPORARY_TOKEN).write_text("0123abcd")
    (stale_tmp / "config.json").write_text("{}")
    (stale_tmp / "model.safetensors").write_bytes(b"\0" * 4096)
    # Same host, this process's id reused by a writer that died before this process started.
    reused = hide(target, os.getpid())
    reused.mkdir()
    (reused / output_paths.TEMPORARY_TOKEN).write_text("0123abcd")
    (reused / "model.safetensors").write_bytes(b"\0" * 16)
    long_ago = time.time() - 10 * 24 * 3600
    os.utime(reused, (long_ago, long_ago))
    stale = [stale_tmp, reused]

    alive = hide(target, os.getpid(), "tmp")  # a writer that is still running (this process)
    alive = alive.with_name(alive.name.replace("0123abcd", "4567cdef"))
    alive.mkdir()
    (alive / output_paths.TEMPORARY_TOKEN).write_text("4567cdef")
    other_host = target.with_name(f".{target.name}.another-host.{dead}.89abcdef.tmp")
    other_host.mkdir()
    foreign_contents = target.with_name(f".{target.name}.{output_paths._host()}.{dead}.fedcba98.tmp")
    foreign_contents.mkdir()
    (foreign_contents / output_paths.TEMPORARY_TOKEN).write_text("fedcba98")
    (foreign_contents / "notes.txt").write_text("keep me")
    # A user's directory whose name matches, holding export-like files but no token (the sweep
    # decided by name and contents alone, and deleted it).
    users = target.with_name(f".{target.name}.{output_paths._host()}.{dead}.76543210.tmp")
    users.mkdir()
    (users / "config.json").write_text('{"mine": true}')
    (users / "model.safetensors").write_bytes(b"\1" * 64)
    # A token that is not the name's (copied from another temporary).
    wrong_token = target.with_name(f".{target.name}.{output_paths._host()}.{dead}.aaaabbbb.tmp")
    wrong_token.mkdir()
    (wrong_token / output_paths.TEMPORARY_TOKEN).write_text("0123abcd")
    (wrong_token / "config.json").write_text("{}")
    unrecognised = target.with_name(f".{target.name}.notes.tmp")
    unrecognised.write_text("keep me")
    legacy_old = target.with_name(f".{target.name}.0a1b2c3d.old")  # an earlier release's: whose?
    legacy_old.mkdir()
    old_without_token = hide(target, dead, "old")  # an earlier release's, no token: not known to be ours
    old_without_token.mkdir()
    (old_without_token / "config.json").write_text("{}")
    kept = [
        alive,
        other_host,
        foreign_contents,
        users,
        wrong_token,
        unrecognised,
        legacy_old,
        old_without_token,
    ]
    return stale, kept


def test_an_export_removes_its_own_stale_temporaries_only(workspace: Tuple[Path, Path]) -> None:
    _, work = workspace
    target = work / "hf"
    stale, kept = stale_export_temporaries(target)
    before = {path: snapshot(path) if path.is_dir() else path.read_bytes() for path in kept}
    export(work / "weights.pt", target, work_dir=work)
    assert [path for path in stale if os.path.lexists(path)] == []
    assert {path: snapshot(path) if path.is_dir() else path.read_bytes() for path in kept} == before
    assert_same_weights(load_exported(target), gpt2_weights(1))


def test_writing_weights_removes_a_killed_writes_temporary_only(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    dead = dead_pid()
    stale = hide(path, dead, host=False)
    stale.write_bytes(b"PK\x03\x04" + b"\0" * 1000)  # a torch.save archive cut short
    kept = [
        hide(path, os.getpid(), host=False),  # a live writer
        path.with_name(f".weights.pt.{dead}.not-hex!.tmp"),
        path.with_name(f".{path.name}.{dead}.0123abcd.tmp.keep"),
        hide(tmp_path / "other.pt", dead, host=False),  # another file's
    ]
    foreign = path.with_name(f".weights.pt.{dead}.fedcba98.tmp")  # that name, but not an archive
    foreign.write_text("my notes")
    for each in kept:
        each.write_bytes(b"PK")
    stream_save([TensorEntry("w", (2,), torch.float32)], lambda _: torch.ones(2), path)
    assert not stale.exists()
    assert all(each.read_bytes() == b"PK" for each in kept) and foreign.read_text() == "my notes"
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(2))


#: A writer killed in the middle: ``weights.pt`` (stream_save) or an export (export_hf) of
#: ``sys.argv[2]``, stopping for good at its second tensor, after saying so.
KILLED_WRITER = """
import json, sys, time
from pathlib import Path
import torch
from tango_fairscale.checkpointing.streaming import TensorEntry, stream_save

def produce(name):
    if name in ("b", "transformer.h.0.ln_1.weight"):
        print("writing", flush=True)
        time.sleep(600)
    return torch.zeros(shapes[name][0], dtype=shapes[name][1])

kind, path = sys.argv[1], Path(sys.argv[2])
if kind == "weights":
    shapes = {"a": ((4096,), torch.float32), "b": ((4096,), torch.float32)}
    stream_save([TensorEntry(n, *shapes[n]) for n in shapes], lambda entry: produce(entry.name), path)
else:
    from transformers import GPT2Config
    from tango_fairscale.finetune.hf_export import export_hf, weights_file
    shapes, _ = weights_file(path.parent / "weights.pt")
    config = GPT2Config(**json.loads(sys.argv[3]), architectures=["GPT2LMHeadModel"])
    export_hf((shapes, produce), path, config, work_dir=path.parent)  # as the engine's export
"""


def test_what_killed_writes_left_is_removed_by_the_next_write(workspace: Tuple[Path, Path]) -> None:
    _, work = workspace
    weights, target = work / "weights.pt", work / "hf"
    export(weights, target, work_dir=work)  # an earlier export, which the killed one was replacing
    before = snapshot(work)
    processes = {
        kind: subprocess.Popen(
            [sys.executable, "-c", KILLED_WRITER, kind, str(path), json.dumps({**GPT2, **NO_DROPOUT})],
            cwd=REPO,
            env=tango_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        for kind, path in [("weights", weights), ("export", target)]
    }
    for process in processes.values():
        assert process.stdout is not None and process.stdout.readline() == "writing\n"
        process.kill()
        process.wait()
        process.stdout.close()
    # What they left: a temporary file the size of the tensors written, and a directory.
    (left_file,) = work.glob(f".weights.pt.{processes['weights'].pid}.*.tmp")
    assert left_file.stat().st_size > 4096 * 4
    (left_dir,) = work.glob(f".hf.*.{processes['export'].pid}.*.tmp")
    assert {"config.json", "model.safetensors"} <= {p.name for p in left_dir.iterdir()}
    # The writes again (as a rerun makes them): those gone, the outputs whole, nothing else changed.
    stream_save([TensorEntry("w", (2,), torch.float32)], lambda _: torch.ones(2), work / "other.pt")
    assert left_file.exists()  # another file's write leaves it
    stream_save([TensorEntry("w", (2,), torch.float32)], lambda _: torch.ones(2), weights)
    assert not left_file.exists()
    torch.save(gpt2_weights(1), weights)  # the weights the export reads, as before
    export(weights, target, work_dir=work)
    assert not left_dir.exists()
    (work / "other.pt").unlink()
    assert snapshot(work).keys() == before.keys()
    assert_same_weights(load_exported(target), gpt2_weights(1))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")
def test_another_users_temporary_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    theirs = hide(path, dead_pid(), host=False)
    theirs.write_bytes(b"PK")
    os.chown(theirs, 65534, 65534)
    stream_save([TensorEntry("w", (2,), torch.float32)], lambda _: torch.ones(2), path)
    assert theirs.read_bytes() == b"PK"


# --- consolidate ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf_config")
    gpt2_config().save_pretrained(directory)
    return directory


def test_consolidate_refuses_the_work_directory_and_its_parent_through_the_command_line(
    toy_train: ToyTrain, hf_config: Path, capsys: pytest.CaptureFixture
) -> None:
    work = toy_train("fairscale", "nested")
    before = snapshot(work.parent)
    # The reported case, as a user types it (before: "Wrote ...", exit 0, the work directory gone).
    module = [sys.executable, "-m", "tango_fairscale", "consolidate", str(work)]
    argv = [*module, str(work), "--format", "hf", "--hf-config", str(hf_config), "--force"]
    result = subprocess.run(argv, cwd=REPO, env=tango_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(
        f"error: refusing to write {work}: it is the step's work directory {work};"
    )
    assert "Wrote" not in result.stdout
    # The step's cache directory (the work directory's parent) and weights.pt, in-process.
    for output, refusal in [
        (work.parent, f"it holds the step's work directory {work}"),
        (work / "weights.pt", f"it is the step's weights {work / 'weights.pt'}"),
    ]:
        assert main(["consolidate", str(work), str(output), "--force"]) == 2
        assert capsys.readouterr().err.startswith(f"error: refusing to write {output}: {refusal};")
    assert snapshot(work.parent) == before
    # What the run owns still loads: weights.pt, and the checkpoint consolidates to it.
    weights = torch.load(work / "weights.pt", weights_only=True)
    full = consolidation.consolidate(checkpointing.resolve_checkpoint(work))
    assert weights.keys() == full.keys() and all(torch.equal(weights[k], full[k]) for k in weights)


def test_consolidate_force_replaces_only_its_own_output(
    toy_train: ToyTrain, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    work = toy_train("fairscale", "nested")
    output = tmp_path / "full.pt"
    # An earlier consolidate's output (with the optimizer state, so that replacing it shows).
    assert main(["consolidate", str(work), str(output), "--optimizer"]) == 0
    assert set(torch.load(output, weights_only=True)) == {"model", "optimizer"}
    capsys.readouterr()
    assert main(["consolidate", str(work), str(output)]) == 2
    assert f"error: output {output} already exists: pass --force to replace it" in capsys.readouterr().err
    assert main(["consolidate", str(work), str(output), "--force"]) == 0
    full = torch.load(output, weights_only=True)
    ToyRegressor(in_features=8, width=32, num_blocks=4).load_state_dict(full, strict=True)
    weights = torch.load(work / "weights.pt", weights_only=True)
    assert all(torch.equal(full[key], weights[key]) for key in weights)
    capsys.readouterr()

    # A file of the user's, with or without --force; and a from_pretrained directory of ours.
    mine = tmp_path / "mine.pt"
    torch.save({"w": torch.ones(2)}, mine)
    exported = tmp_path / "hf"
    exported.mkdir()
    (exported / EXPORT_MARKER).write_bytes(output_paths.marker(HF_EXPORT, ["config.json"]))
    (exported / "config.json").write_text("{}")
    before = snapshot(tmp_path)
    for path, refusal in [
        (mine, "it is a file this package did not write"),
        (exported, "it is a from_pretrained directory, not a consolidated .pt file"),
    ]:
        for force in ([], ["--force"]):
            assert main(["consolidate", str(work), str(path), *force]) == 2
            assert f"error: refusing to replace {path}: {refusal}" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
    assert torch.equal(torch.load(mine, weights_only=True)["w"], torch.ones(2))


def test_consolidate_removes_a_killed_consolidates_temporary(toy_train: ToyTrain, tmp_path: Path) -> None:
    work = toy_train("fairscale", "nested")
    output = tmp_path / "full.pt"
    stale = hide(output, dead_pid(), host=False)
    stale.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    live = hide(output, os.getpid(), host=False)
    live.write_bytes(b"PK")
    assert main(["consolidate", str(work), str(output)]) == 0
    assert not stale.exists() and live.read_bytes() == b"PK"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([output.name, live.name])


# --- the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(5)
    directory = tmp_path_factory.mktemp("pretrained") / "gpt2"
    GPT2LMHeadModel(gpt2_config()).save_pretrained(directory)
    tokenizer().save_pretrained(directory)
    return directory


def tokenizer() -> Any:
    """A word-level tokenizer of the model's vocabulary (nothing to download)."""
    return word_tokenizer(GPT2["vocab_size"])


def fine_tuning(pretrained: Path, export_hf: str) -> Dict[str, Any]:
    """One step at learning rate 0 from ``pretrained`` (a unit per block), exported to ``export_hf``."""
    model = {"type": "fairscale::from_pretrained", "pretrained_model_name_or_path": str(pretrained)}
    wrapped = {
        "type": "fairscale::with_wrapped_modules",
        "model": model,
        "modules_to_wrap": ["transformer\\.h\\.[0-9]+"],
        "fsdp_config": {},
    }
    extra = {"init_on_meta": True, "export_hf": export_hf}
    config = train_config(model=wrapped, train_steps=1, checkpoint_every=1, callbacks=[], engine_extra=extra)
    config["steps"]["train"]["training_engine"]["optimizer"] = {"type": "torch::SGD", "lr": 0.0}
    config["steps"]["data"] = {
        "type": "test::lm_data",
        "vocab_size": GPT2["vocab_size"],
        "length": GPT2["n_positions"],
    }
    return config


def test_the_engines_export_refuses_weights_pt_and_replaces_an_earlier_export(
    pretrained: Path, tmp_path: Path
) -> None:
    refused, replaced = tmp_path / "refused", tmp_path / "replaced"
    # An earlier export of other weights where the run exports, and what killed writes left.
    replaced.mkdir()
    torch.save(gpt2_weights(3), tmp_path / "earlier.pt")
    export(tmp_path / "earlier.pt", replaced / "hf")
    stale, kept = stale_export_temporaries(replaced / "hf")
    stale_weights = hide(replaced / "weights.pt", dead_pid(), host=False)
    stale_weights.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    kept_before = {path: snapshot(path) if path.is_dir() else path.read_bytes() for path in kept}

    jobs = []
    for work, export_hf in [(refused, "weights.pt"), (replaced, "hf")]:
        jobs.append(harness.Train(fine_tuning(pretrained, export_hf), work))
    refusal, replacement = harness.run(jobs, out=tmp_path / "harness")

    # export_hf: "weights.pt": one line on the exporting worker; weights.pt is the run's, whole.
    error = refusal.errors[0]
    assert error is not None and refusal.errors[1] is None, refusal.describe()
    assert error == (
        f"CheckpointError: refusing to write {refused / 'weights.pt'} (training_engine.export_hf): it is the "
        f"step's weights {refused / 'weights.pt'}; choose a new path (or one this package wrote a "
        "from_pretrained directory to before)"
    )
    weights = torch.load(refused / "weights.pt", weights_only=True)
    from safetensors.torch import load_file

    saved = load_file(str(pretrained / "model.safetensors"))
    assert all(torch.equal(weights[name], saved[name]) for name in saved)  # lr 0: the pretrained weights
    assert not list(refused.glob(".weights.pt.*"))

    # export_hf: "hf" over the earlier export: replaced by this run's weights; only stale temporaries went.
    replacement.check()
    weights = torch.load(replaced / "weights.pt", weights_only=True)
    exported = load_exported(replaced / "hf")
    assert all(torch.equal(exported[name], weights[name]) for name in exported)
    assert not torch.equal(exported["transformer.wte.weight"], gpt2_weights(3)["transformer.wte.weight"])
    assert [path for path in [*stale, stale_weights] if os.path.lexists(path)] == []
    assert {path: snapshot(path) if path.is_dir() else path.read_bytes() for path in kept} == kept_before


def test_no_output_goes_into_another_steps_work_directory(
    workspace: Tuple[Path, Path], toy_train: ToyTrain, capsys: pytest.CaptureFixture
) -> None:
    """
    A cached step's outputs stay as Tango keeps them: another step's export (the engine's, with
    its own work directory), ``consolidate --force`` (any work directory: it runs no step) and
    ``plan --json`` are refused inside a step's work directory, and its export is byte-identical.
    """
    ws, first = workspace
    export(first / "weights.pt", first / "hf", work_dir=first)  # the first step's own export
    second = ws / "cache" / "TorchTrainStep-def456" / "work"
    second.mkdir(parents=True)
    before = snapshot(ws)
    for target in (first / "hf", first / "hf2"):
        with pytest.raises(
            CheckpointError, match=rf"inside the work directory {first}, which holds another step's"
        ):
            export(first / "weights.pt", target, work_dir=second)
    source = toy_train("fairscale", "nested")
    for target, kind in (
        (first / "hf", ["--format", "hf", "--hf-config", str(first / "hf")]),
        (first / "x.pt", []),
    ):
        assert main(["consolidate", str(source), str(target), *kind, "--force"]) == 2
        assert f"inside the work directory {first}, which holds a step's outputs" in capsys.readouterr().err
    # Not into the work directory it reads either: a finished step's outputs too.
    assert main(["consolidate", str(source), str(source / "full.pt")]) == 2
    assert f"inside the work directory {source}, which holds a step's outputs" in capsys.readouterr().err
    assert snapshot(ws) == before and not (source / "full.pt").exists()
    # The engine's own step still writes into its own work directory.
    export(first / "weights.pt", second / "hf", work_dir=second)
    assert (second / "hf" / EXPORT_MARKER).is_file()


def _intruding_during_the_write(monkeypatch: pytest.MonkeyPatch, intrude: Any) -> None:
    """Run ``intrude()`` while the export's weights are being written (after its target was checked)."""
    from tango_fairscale.finetune import hf_export

    write = hf_export._write_weights

    def writing(*args: Any, **kwargs: Any) -> None:
        write(*args, **kwargs)
        intrude()

    monkeypatch.setattr(hf_export, "_write_weights", writing)


@pytest.mark.parametrize("earlier_export", [False, True], ids=["new path", "over an earlier export"])
def test_what_appears_at_the_target_during_an_export_is_never_replaced(
    workspace: Tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, earlier_export: bool
) -> None:
    """
    The race: the target is checked when the export starts (new, or an earlier export); a user's
    directory made there during the write (in the earlier export's place, moved away) is left byte
    for byte, the export stops in one line, and no temporary stays. The earlier export, moved by
    the user, is untouched too.
    """
    _, work = workspace
    target = work / "hf"
    if earlier_export:
        export(work / "weights.pt", target, work_dir=work)
    moved = work / "earlier-export-moved-by-the-user"

    def intrude() -> None:
        if target.exists():
            target.rename(moved)
        target.mkdir()
        (target / "thesis.txt").write_text("two years of work")

    _intruding_during_the_write(monkeypatch, intrude)
    moved_before = None
    with pytest.raises(
        CheckpointError, match=r"something else was put there while it was being written"
    ) as error:
        export(work / "weights.pt", target, work_dir=work)
    assert "\n" not in str(error.value)
    assert snapshot(target) == {"thesis.txt": b"two years of work"}
    if earlier_export:
        moved_before = snapshot(moved)
        assert_same_weights(load_exported(moved), gpt2_weights(1))
        assert snapshot(moved) == moved_before
    assert [p.name for p in work.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_rename_noreplace_refuses_a_file_and_a_directory_that_exist(tmp_path: Path) -> None:
    from tango_fairscale.checkpointing.placing import rename_noreplace

    for kind in ("file", "directory"):
        source, target = tmp_path / f"new-{kind}", tmp_path / f"target-{kind}"
        if kind == "file":
            source.write_text("new")
            target.write_text("theirs")
        else:
            source.mkdir()
            target.mkdir()  # empty: a plain rename would replace it
        with pytest.raises(FileExistsError):
            rename_noreplace(source, target)
        assert source.exists() and (
            target.read_text() == "theirs" if kind == "file" else not any(target.iterdir())
        )
        fresh = tmp_path / f"fresh-{kind}"
        rename_noreplace(source, fresh)
        assert fresh.exists() and not source.exists()


class _IntrudingSource:
    """A model source whose one tensor is produced while ``intrude()`` puts something at the target."""

    def __init__(self, intrude: Any) -> None:
        self.entries = [TensorEntry("w", (2,), torch.float32)]
        self._intrude = intrude

    def produce(self, entry: TensorEntry) -> torch.Tensor:
        self._intrude()
        return torch.ones(2)


@pytest.mark.parametrize("earlier_output", [False, True], ids=["new path", "over an earlier output"])
def test_what_appears_at_a_consolidated_file_during_its_write_is_never_replaced(
    tmp_path: Path, earlier_output: bool
) -> None:
    from tango_fairscale.checkpointing.placing import identity

    target, moved = tmp_path / "model.pt", tmp_path / "earlier-moved-by-the-user.pt"
    if earlier_output:
        consolidation.save_model(_IntrudingSource(lambda: None), target)
        assert output_paths.is_consolidated_file(target)
    checked = identity(target)

    def intrude() -> None:
        if target.exists():
            target.rename(moved)
        target.write_text("the user's own file")

    with pytest.raises(CheckpointError, match=r"something else was put there while it was being written"):
        consolidation.save_model(_IntrudingSource(intrude), target, checked=checked)
    assert target.read_text() == "the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["model.pt"] + (["earlier-moved-by-the-user.pt"] if earlier_output else [])
    )
    if earlier_output:
        assert output_paths.is_consolidated_file(moved)
        # The earlier output itself, checked and still there, is replaced as before.
        consolidation.save_model(_IntrudingSource(lambda: None), moved, checked=identity(moved))
        assert torch.equal(torch.load(moved, weights_only=True)["w"], torch.ones(2))
