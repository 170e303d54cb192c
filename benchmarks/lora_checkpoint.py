"""
Checkpoint bytes of LoRA against a full fine-tune of the same pretrained model, both backends.

A Llama-style causal LM of about 110 M parameters (width 768, 12 layers, MLP 2048, vocabulary
32,000, tied embedding) is saved as ``save_pretrained`` writes it; each configuration is one
``tango run`` of ``torch::train`` on 2 CPU workers (``init_on_meta``, one unit per decoder
layer, AdamW, 1 step, one checkpoint) fine-tuning it from the files: all parameters, or LoRA of
r=8 on the four attention projections (``fairscale::with_lora``). The table is the bytes of the
step's checkpoint directory. A LoRA checkpoint holds the adapters, their optimizer state, the
random and trainer states and the base files' digests; the frozen base is read from the files.

    python benchmarks/lora_checkpoint.py [--json PATH] [--markdown PATH] [--layers 12]

The published run: ``--json benchmarks/results/lora-checkpoint.json`` (docs/checkpoints.md quotes it).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import free_port, host_environment  # noqa: E402

SHAPE = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "vocab_size": 32000,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA: Dict[str, Any] = {"r": 8, "lora_alpha": 16, "target_modules": TARGETS}


def save_pretrained(directory: Path, layers: int) -> int:
    """The pretrained model's files; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, num_hidden_layers=layers))
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def config(pretrained: Path, backend: str, lora: bool) -> Dict[str, Any]:
    model: Dict[str, Any] = {
        "type": "fairscale::from_pretrained",
        "pretrained_model_name_or_path": str(pretrained),
    }
    if lora:
        model = {"type": "fairscale::with_lora", "model": model, **LORA}
    return {
        "steps": {
            "data": {
                "type": "benchmark::random_tokens",
                "vocab_size": SHAPE["vocab_size"],
                "sequence_length": 32,
                "count": 4,
            },
            "train": {
                "type": "torch::train",
                "model": {
                    "type": "fairscale::with_wrapped_modules",
                    "model": model,
                    "wrap_module_classes": ["LlamaDecoderLayer"],
                    "fsdp_config": {},
                },
                "training_engine": {
                    "type": "fairscale",
                    "backend": backend,
                    "init_on_meta": True,
                    "optimizer": {"type": "torch::AdamW", "lr": 1e-4},
                },
                "dataset_dict": {"type": "ref", "ref": "data"},
                "train_dataloader": {
                    "batch_size": 2,
                    "sampler": {"type": "torch::DistributedSampler", "shuffle": False, "drop_last": True},
                },
                "train_steps": 1,
                "checkpoint_every": 1,
                "device_count": 2,
            },
        }
    }


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def run(pretrained: Path, backend: str, lora: bool, scratch: Path) -> int:
    """One ``tango run``; returns its checkpoint's bytes."""
    name = f"{backend}-{'lora' if lora else 'full'}"
    config_path = scratch / f"{name}.json"
    config_path.write_text(json.dumps(config(pretrained, backend, lora)))
    workspace = scratch / f"{name}-workspace"
    # Outside the repository (Tango records the git remote of the working directory, if any).
    env = {
        **os.environ,
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    command = [
        str(Path(sys.executable).parent / "tango"),
        "--log-level",
        "warning",
        "run",
        str(config_path),
        "-w",
        str(workspace),
        "-i",
        "tango_fairscale",
        "-i",
        "benchmarks.components",
    ]
    completed = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    (checkpoint,) = [p for p in workspace.glob("cache/*/work/checkpoint_state_step1")] or list(
        workspace.rglob("checkpoint_state_step1")
    )
    return directory_bytes(checkpoint)


def markdown(data: Dict[str, Any]) -> str:
    lines = [
        f"Llama-style model of {data['parameters'] / 1e6:.1f} M parameters, 2 workers, LoRA r={LORA['r']} on "
        f"{', '.join(TARGETS)}. Reproduce: `python benchmarks/lora_checkpoint.py`",
        "",
        "| backend | full fine-tune | LoRA | LoRA / full |",
        "|---|---:|---:|---:|",
    ]
    for row in data["rows"]:
        lines.append(
            f"| `{row['backend']}` | {row['full'] / 2**20:,.1f} MiB | {row['lora'] / 2**20:,.2f} MiB | "
            f"{100 * row['lora'] / row['full']:.2f} % |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument(
        "--json", type=Path, help="write the sizes here (e.g. benchmarks/results/lora-checkpoint.json)"
    )
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lora-checkpoint-") as scratch_name:
        scratch = Path(scratch_name)
        pretrained = scratch / "pretrained"
        parameters = save_pretrained(pretrained, args.layers)
        rows = []
        for backend in ("fairscale", "torch"):
            sizes = {kind: run(pretrained, backend, kind == "lora", scratch) for kind in ("full", "lora")}
            rows.append({"backend": backend, **sizes})
            print(
                f"{backend}: full {sizes['full']:,} bytes, LoRA {sizes['lora']:,} bytes, "
                f"{100 * sizes['lora'] / sizes['full']:.2f} %",
                flush=True,
            )
    data = {"environment": host_environment(), "parameters": parameters, "lora": LORA, "rows": rows}
    text = markdown(data)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
