"""
LoRA checkpoints hold what trains: under ``init_on_meta`` the frozen base read from the pretrained
files is named in the checkpoint's marker (files' SHA-256, each parameter's tensor), not saved.
A run with ``lora_dropout: 0.1`` killed (SIGKILL) after a checkpoint and run again ends as the
uninterrupted run, on both backends; a pretrained file changed in between is refused on resume,
naming it; ``weights.pt`` and ``consolidate`` read the base from the files.
"""

import json
import math
import shlex
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

from tango_fairscale import cli
from tango_fairscale.checkpointing import consolidation, pretrained_base
from tests import harness
from tests.conftest import TinyPretrained, TinyPretrainedCopy
from tests.helpers import (
    TINY_LLAMA,
    max_abs_difference,
    pretrained_name,
    readme_command_lines,
    train_config,
)

pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

LLAMA = TINY_LLAMA
#: Checkpoints after steps 3 and 6; the killed run dies before step index 5 and resumes from step 3.
STEPS, CHECKPOINT_EVERY, KILL_AT = 8, 3, 5


def experiment(directory: Path, backend: str, kill_at: Optional[int] = None) -> Dict[str, Any]:
    lora = {
        "type": "fairscale::with_lora",
        "model": {"type": "fairscale::from_pretrained", "pretrained_model_name_or_path": str(directory)},
        "r": 4,
        "lora_dropout": 0.1,
        "target_modules": ["q_proj", "v_proj"],
    }
    callbacks = [] if kill_at is None else [{"type": "test::kill_once", "step": kill_at}]
    return _llama_run(lora, backend, STEPS, CHECKPOINT_EVERY, callbacks)


def _llama_run(
    model: Dict[str, Any], backend: str, steps: int, checkpoint_every: int, callbacks: List[Any]
) -> Dict[str, Any]:
    """``model``, one unit per decoder layer, fine-tuned under init_on_meta on the LM data."""
    wrapped = {
        "type": "fairscale::with_wrapped_modules",
        "model": model,
        "wrap_module_classes": ["LlamaDecoderLayer"],
        "fsdp_config": {},
    }
    config = train_config(
        engine="fairscale",
        model=wrapped,
        train_steps=steps,
        checkpoint_every=checkpoint_every,
        callbacks=callbacks,
        engine_extra={"backend": backend, "init_on_meta": True},
    )
    config["steps"]["train"]["training_engine"]["optimizer"] = {"type": "torch::AdamW", "lr": 0.01}
    config["steps"]["data"] = {"type": "test::lm_data", "vocab_size": LLAMA["vocab_size"], "size": 64}
    return config


def _file_tensor(files: Dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """The pretrained file's tensor of a PeftModel state-dict key (the LM head is tied to the embedding)."""
    name = pretrained_name(key)
    return files[name] if name in files else files["model.embed_tokens.weight"]


def _checkpoint_bytes(checkpoint: Path) -> int:
    return sum(path.stat().st_size for path in checkpoint.rglob("*") if path.is_file())


def _stored_model_elements(checkpoint: Path, marker: Dict[str, Any]) -> int:
    """How many model tensor elements the checkpoint's files hold (either backend's format)."""
    from tango_fairscale.backends.torch_fsdp2.checkpoint import read_metadata
    from tango_fairscale.checkpointing import read_worker_state

    if (checkpoint / "dcp").is_dir():
        metadata = read_metadata(checkpoint / "dcp" / ".metadata").state_dict_metadata
        return sum(math.prod(item.size) for key, item in metadata.items() if key.startswith("model."))
    return sum(
        tensor.numel()
        for worker in range(marker["world_size"])
        for tensor in read_worker_state(checkpoint, marker, worker, "model")["weights"].values()
    )


# The torch backend's run is the same proof on DCP's files: in the extended suite, for make test's time.
@pytest.mark.parametrize("backend", ["fairscale", pytest.param("torch", marks=pytest.mark.extended)])
def test_a_lora_run_killed_after_a_checkpoint_resumes_exactly_from_adapters_and_the_files(
    backend: str, tmp_path: Path, tiny_pretrained: TinyPretrained, tiny_pretrained_copy: TinyPretrainedCopy
) -> None:
    pretrained = tiny_pretrained(LLAMA, seed=3)
    tampered = tiny_pretrained_copy(LLAMA, seed=3, name="llama-tampered")  # one of its files changed below
    plain = harness.Train(experiment(pretrained, backend), tmp_path / "plain")
    killed = harness.Train(experiment(pretrained, backend, KILL_AT), tmp_path / "killed")
    doomed = harness.Train(experiment(tampered, backend, KILL_AT), tmp_path / "doomed")
    # A killed job ends its workers: each starts the next run of jobs, which reruns it first.
    first = harness.run([plain, killed], out=tmp_path / "first")
    first[0].check(exited=False)
    second = harness.run([killed, doomed], out=tmp_path / "second")
    second[0].check(exited=False)
    # A byte of a frozen base tensor's value changed between the kill and the rerun.
    file = tampered / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x10
    file.write_bytes(bytes(data))
    (third,) = harness.run([doomed], out=tmp_path / "third")
    assert (
        "Recovering from previous run at " + str(killed.work_dir / "checkpoint_state_step3") in second[0].logs
    )

    # The resumed run ends as the uninterrupted one, dropout and all; the base is the pretrained files'.
    uninterrupted = torch.load(plain.work_dir / "weights.pt", weights_only=True)
    resumed = torch.load(killed.work_dir / "weights.pt", weights_only=True)
    assert uninterrupted.keys() == resumed.keys()
    assert max_abs_difference(resumed, uninterrupted) == 0.0
    files = load_file(pretrained / "model.safetensors")
    base = {k: v for k, v in resumed.items() if ".lora_" not in k}
    for key, value in base.items():
        assert torch.equal(value, _file_tensor(files, key)), key
    assert all(resumed[k].abs().max() > 0 for k in resumed if ".lora_B." in k)  # the adapters trained

    # The checkpoint names the base instead of holding it: adapters and their optimizer state only.
    checkpoint = plain.work_dir / f"checkpoint_state_step{STEPS}"
    marker = json.loads((checkpoint / "COMPLETE.json").read_text())
    saved = pretrained_base.saved_base(marker)
    assert saved is not None
    # The weights and, beside them, the config they are computed with.
    assert set(saved["files"]) == {str(pretrained / "model.safetensors"), str(pretrained / "config.json")}
    assert set(saved["tensors"]) == set(base)
    # The resumed run, of the same config, still leaves the whole base to the files.
    resumed_marker = json.loads(
        (killed.work_dir / f"checkpoint_state_step{STEPS}" / "COMPLETE.json").read_text()
    )
    assert pretrained_base.saved_base(resumed_marker)["tensors"] == saved["tensors"]  # type: ignore[index]
    adapters = sum(v.numel() for k, v in resumed.items() if ".lora_" in k)
    stored = _stored_model_elements(checkpoint, marker)
    print(
        f"[{backend}] checkpoint {_checkpoint_bytes(checkpoint)} bytes; "
        f"model elements stored {stored}, adapters {adapters}"
    )
    # Only the adapters (a flat shard may add a few padding zeros), none of the base.
    assert adapters <= stored <= adapters + 16

    # consolidate reads the base from the files, checked: weights.pt's state dict (the last checkpoint).
    consolidated = consolidation.consolidate(checkpoint)
    assert consolidated.keys() == uninterrupted.keys()
    assert max_abs_difference(consolidated, uninterrupted) == 0.0
    source = consolidation.model_source(checkpoint)
    streamed = pretrained_base.materialize(source)
    for key in base:
        assert torch.equal(consolidated[key], _file_tensor(files, key))
        assert torch.equal(streamed[key], consolidated[key])

    # consolidate --format hf of the LoRA checkpoint: the adapter directory peft loads onto the
    # base, the trained state exactly; with --merge, the merged model, the same logits.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # The commands of docs/pretrained.md, as written there.
    adapter_line, merged_line = readme_command_lines(
        "bash", "--hf-config /models/my-llama --merge", doc="docs/pretrained.md"
    )
    outputs = []
    for line in (adapter_line, merged_line):
        command = shlex.split(
            line.replace("/models/my-llama", str(pretrained)).replace("WORK_DIR", str(plain.work_dir))
        )
        assert command[:4] == ["python", "-m", "tango_fairscale", "consolidate"], command
        outputs.append(tmp_path / command[5])
        assert cli.main([*command[3:5], str(outputs[-1]), *command[6:]]) == 0
    adapter_dir, merged_dir = outputs
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), adapter_dir).eval()
    assert max_abs_difference(dict(loaded.state_dict()), uninterrupted) == 0.0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    tokens = torch.randint(LLAMA["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (loaded(input_ids=tokens).logits - merged(input_ids=tokens).logits).abs().max().item()
    print(f"[{backend}] |adapter - merged| logits {difference:.2e}")
    assert difference <= 1e-5

    # The rerun over changed files is refused, naming the file, before anything trains.
    error = next(e for e in third.errors if e)
    assert f"The pretrained file {file} changed since the checkpoint was saved (SHA-256 differs)" in error
    assert not (doomed.work_dir / "weights.pt").exists()
    with pytest.raises(Exception, match="changed since the checkpoint was saved"):
        consolidation.consolidate(doomed.work_dir / "checkpoint_state_step3")


@pytest.mark.extended
@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_a_lora_checkpoint_resumes_on_another_number_of_workers(
    backend: str, tmp_path: Path, tiny_pretrained: TinyPretrained
) -> None:
    # Only the adapters are in the checkpoint: 3 workers reshard them and read the base from the files.
    pretrained = tiny_pretrained(LLAMA, seed=3)
    two = experiment(pretrained, backend)
    two["steps"]["train"].update(train_steps=4, checkpoint_every=2)
    harness.train(two, tmp_path / "two")
    three = experiment(pretrained, backend)
    three["steps"]["train"].update(device_count=3, train_steps=6)
    three["steps"]["train"]["training_engine"]["resume_from_checkpoint"] = str(
        tmp_path / "two" / "checkpoint_state_step4"
    )
    result = harness.train(three, tmp_path / "three", world_size=3)
    assert "from 2 to 3 workers" in result.logs
    saved = torch.load(tmp_path / "two" / "weights.pt", weights_only=True)
    resumed = torch.load(tmp_path / "three" / "weights.pt", weights_only=True)
    files = load_file(pretrained / "model.safetensors")
    assert saved.keys() == resumed.keys()
    for key in resumed:
        if ".lora_" in key:
            assert not torch.equal(resumed[key], saved[key]), key  # two more steps trained them
        else:
            assert torch.equal(resumed[key], _file_tensor(files, key)), key


def _frozen_below(pretrained: Path, backend: str, layers: int, steps: int) -> Dict[str, Any]:
    model = {"type": "test::llama_frozen_below", "pretrained": str(pretrained), "layers": layers}
    return _llama_run(model, backend, steps, 2, [])


@pytest.mark.parametrize("backend", ["fairscale", pytest.param("torch", marks=pytest.mark.extended)])
def test_resuming_with_more_of_the_model_frozen_keeps_what_the_checkpoint_trained(
    backend: str, tmp_path: Path, tiny_pretrained: TinyPretrained
) -> None:
    """
    Staged freezing: a run trains layers 1 and 2 (layer 0 and the embeddings frozen, read from the
    pretrained files), and a second resumes its checkpoint with layer 1 frozen too. Layer 1 keeps
    the first run's trained values in the second's weights.pt and checkpoints; before, they were
    left to the pretrained files (frozen and read from them), and weights.pt reverted it silently.
    """
    pretrained = tiny_pretrained({**LLAMA, "num_hidden_layers": 3}, seed=2)
    harness.train(_frozen_below(pretrained, backend, layers=1, steps=2), tmp_path / "first")
    second = _frozen_below(pretrained, backend, layers=2, steps=4)
    second["steps"]["train"]["training_engine"]["resume_from_checkpoint"] = str(
        tmp_path / "first" / "checkpoint_state_step2"
    )
    harness.train(second, tmp_path / "second")
    first = torch.load(tmp_path / "first" / "weights.pt", weights_only=True)
    resumed = torch.load(tmp_path / "second" / "weights.pt", weights_only=True)
    files = load_file(pretrained / "model.safetensors")
    layer = [key for key in resumed if key.startswith("model.layers.1.") and key.endswith(".weight")]
    assert layer
    for key in layer:
        assert torch.equal(resumed[key], first[key]), key  # frozen since the checkpoint
        assert not torch.equal(resumed[key], files[key]), key  # trained before it
    for key in [key for key in resumed if key.startswith("model.layers.0.")] + ["model.embed_tokens.weight"]:
        assert torch.equal(resumed[key], files[key]), key  # frozen all along: the pretrained tensors
    for key in [key for key in resumed if key.startswith("model.layers.2.")]:
        assert not torch.equal(resumed[key], first[key]), key  # two more steps trained it
    # The second run's checkpoints hold layer 1: its marker leaves only layer 0 and the
    # embeddings to the pretrained files.
    marker = json.loads((tmp_path / "second" / "checkpoint_state_step4" / "COMPLETE.json").read_text())
    named = set(marker[pretrained_base.MARKER_FIELD]["tensors"])
    assert not [name for name in named if name.startswith("model.layers.1.")]
    assert [name for name in named if name.startswith("model.layers.0.")]


@pytest.mark.parametrize("backend", ["torch", "fairscale"])
def test_a_marker_whose_model_records_were_removed_or_edited_is_refused_in_one_line(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture, tiny_pretrained: TinyPretrained
) -> None:
    """
    Removed, the pretrained_base record left a torch-backend checkpoint that consolidated to the
    adapters alone (exit 0); an edited peft_adapter record failed in a traceback inside peft.
    """
    import shutil

    pretrained = tiny_pretrained(LLAMA, seed=3)
    run = experiment(pretrained, backend)
    run["steps"]["train"].update(train_steps=2, checkpoint_every=2)
    harness.train(run, tmp_path / "run")
    saved = tmp_path / "run" / "checkpoint_state_step2"
    records = {
        pretrained_base.MARKER_FIELD: lambda marker: marker.pop(pretrained_base.MARKER_FIELD),
        "peft_adapter": lambda marker: marker["peft_adapter"].update(r=8),
    }
    for record, edit in records.items():
        checkpoint = tmp_path / record
        shutil.copytree(saved, checkpoint)
        marker = json.loads((checkpoint / "COMPLETE.json").read_text())
        edit(marker)
        (checkpoint / "COMPLETE.json").write_text(json.dumps(marker))
        for argv in (
            ["consolidate", str(checkpoint), str(tmp_path / f"{record}.pt")],
            ["consolidate", str(checkpoint), str(tmp_path / f"{record}-hf"), "--format", "hf"]
            + ["--hf-config", str(pretrained)],
        ):
            status = cli.main(argv)
            err = capsys.readouterr().err
            with capsys.disabled():
                print(f"[{backend}] {' '.join(argv[:2] + argv[3:4])}: exit {status}: {err.strip()}")
            how = "removed" if record == pretrained_base.MARKER_FIELD else "changed"
            expected = (
                f"error: {checkpoint / 'COMPLETE.json'}: its record {record!r} was {how} since the "
                "checkpoint was saved"
            )
            assert status == 2 and err.startswith(expected) and err.count("\n") == 1, err
            assert "Traceback" not in err
    # The intact checkpoint with --hf-config of another model (a GPT-2 for the Llama's adapters):
    # peft's NoMatchingPeftModuleError was a 29-line traceback.
    from transformers import GPT2Config

    other = tmp_path / "other-model"
    GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=16, architectures=["GPT2LMHeadModel"]
    ).save_pretrained(other)
    status = cli.main(
        ["consolidate", str(saved), str(tmp_path / "other-hf"), "--format", "hf", "--hf-config", str(other)]
    )
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: --hf-config {other} is not the model the checkpoint trained ("), err
    assert not (tmp_path / "other-hf").exists()
