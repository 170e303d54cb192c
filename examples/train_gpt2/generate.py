"""
Generate text with the GPT-2 that ``config.jsonnet`` trained, loaded into a plain
:class:`transformers.GPT2LMHeadModel`: the ``weights.pt`` that ``torch::train`` writes is an
ordinary state dict, usable without Tango, FairScale or this example's code.

    python generate.py workspace                      # the newest finished run in the workspace
    python generate.py workspace --run my-run --prompt "The Queen said"
    python generate.py path/to/weights.pt --size tiny # model numbers from config.jsonnet

With a workspace, the model's numbers (layers, width, heads, ...) come from the configuration
Tango recorded for the run; with a weights file, from ``config.jsonnet`` with ``--size``.
"""

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

# The tokenizer and the GPT2Config must be the training ones; components.py is beside this file.
from components import EOS_TOKEN_ID, decode, encode, gpt2_config
from transformers import GPT2LMHeadModel

HERE = Path(__file__).resolve().parent
MODEL_TYPE = "gpt2::from_config"
MODEL_ARGUMENTS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")


def find_model_config(config: Any) -> Optional[Dict[str, Any]]:
    """The ``{"type": "gpt2::from_config", ...}`` object inside a step's configuration."""
    if isinstance(config, dict):
        if config.get("type") == MODEL_TYPE:
            return config
        children = config.values()
    elif isinstance(config, list):
        children = config  # type: ignore[assignment]
    else:
        return None
    for child in children:
        found = find_model_config(child)
        if found is not None:
            return found
    return None


def from_workspace(workspace_dir: Path, run: Optional[str], step: str) -> Tuple[Path, Dict[str, Any]]:
    """The weights file and the model configuration of ``step`` in a run of a local workspace."""
    from tango.step_info import StepState
    from tango.workspace import RunSort
    from tango.workspaces import LocalWorkspace

    workspace = LocalWorkspace(workspace_dir)
    if run is not None:
        candidates = [run]
    else:
        runs = workspace.search_registered_runs(sort_by=RunSort.START_DATE, sort_descending=True)
        candidates = [info.name for info in runs]
    for name in candidates:
        info = workspace.registered_run(name).steps.get(step)
        if info is None or info.state != StepState.COMPLETED or info.result_location is None:
            continue
        model_config = find_model_config(info.config)
        if model_config is None:
            sys.exit(f"Step {step!r} of run {name!r} has no {MODEL_TYPE!r} model in its configuration.")
        # A local workspace keeps a step's work directory, with the consolidated weights, next
        # to its cached result.
        return Path(info.result_location) / "work" / "weights.pt", model_config
    where = f"run {run!r}" if run else f"any run in {workspace_dir}"
    sys.exit(
        f"No finished {step!r} step in {where}. Train first: tango run config.jsonnet -w {workspace_dir}"
    )


def from_config_file(config_file: Path, size: str) -> Dict[str, Any]:
    """The model configuration in ``config_file`` for the size preset ``size``."""
    from tango.common import Params

    params = Params.from_file(config_file, ext_vars={"size": size}).as_dict(quiet=True)
    model_config = find_model_config(params)
    if model_config is None:
        sys.exit(f"{config_file} has no {MODEL_TYPE!r} model.")
    return model_config


def load_model(weights: Path, model_config: Dict[str, Any]) -> GPT2LMHeadModel:
    """A plain GPT2LMHeadModel with the trained weights, in evaluation mode."""
    numbers = {key: int(model_config[key]) for key in MODEL_ARGUMENTS if key in model_config}
    model = GPT2LMHeadModel(gpt2_config(**numbers))
    # weights_only: a state dict needs nothing but tensors, so refuse anything else in the file.
    state = torch.load(weights, map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()


@torch.no_grad()
def generate(
    model: GPT2LMHeadModel,
    prompt: str,
    max_new_tokens: int = 300,
    temperature: float = 0.8,
    top_k: Optional[int] = 20,
    generator: Optional[torch.Generator] = None,
) -> str:
    """
    Sample a continuation of ``prompt`` byte by byte, stopping early at an end-of-document token.

    Only the last ``n_positions`` tokens are fed back in, so the text can be longer than the
    model's context (``model.generate`` would run out of position embeddings instead).
    """
    context = model.config.n_positions
    tokens = torch.tensor([encode(prompt) or [EOS_TOKEN_ID]], dtype=torch.long)
    new: list = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=tokens[:, -context:]).logits[0, -1].float()
        if temperature <= 0:
            next_token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                threshold = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            next_token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        if next_token == EOS_TOKEN_ID:
            break
        new.append(next_token)
        tokens = torch.cat([tokens, torch.tensor([[next_token]])], dim=1)
    return decode(new)


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path, help="a Tango workspace directory, or a weights.pt file")
    parser.add_argument("--run", help="the run in the workspace (default: the newest finished one)")
    parser.add_argument("--step", default="train", help="the training step's name (default: train)")
    parser.add_argument("--config", type=Path, default=HERE / "config.jsonnet", help="for a weights file")
    parser.add_argument("--size", default="default", help="the size preset of --config (default: default)")
    parser.add_argument("--prompt", default="Alice was beginning to get very tired")
    parser.add_argument("--max-new-tokens", type=int, default=300, help="bytes to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 always picks the likeliest byte")
    parser.add_argument("--top-k", type=int, default=20, help="sample from the k likeliest bytes only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.source.is_dir():
        weights, model_config = from_workspace(args.source, args.run, args.step)
    elif args.source.is_file():
        weights, model_config = args.source, from_config_file(args.config, args.size)
    else:
        sys.exit(f"{args.source} is neither a workspace directory nor a weights file.")

    model = load_model(weights, model_config)
    generator = torch.Generator().manual_seed(args.seed)
    text = generate(model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, generator)
    print(args.prompt + text)


if __name__ == "__main__":
    main()
