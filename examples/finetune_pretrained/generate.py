"""
Generate text from a directory ``save_pretrained`` wrote, such as the ``hf`` directory that the
engine's ``export_hf`` leaves in the training step's work directory, with plain ``transformers``:
``AutoTokenizer`` and ``AutoModelForCausalLM``, nothing of Tango, FairScale or this package. A
LoRA adapter directory (``adapter_config.json``) is loaded onto its base model with peft's
``PeftModel.from_pretrained``.

    python generate.py ../../workspace/finetune_pretrained/latest/train/work/hf --prompt "The Queen"
    python generate.py ../../workspace/finetune_lora/latest/train/work/adapter --prompt "The Queen"
    python generate.py ../../workspace/pretrained-gpt2 --prompt "The Queen"   # before fine-tuning
"""

import argparse
from pathlib import Path
from typing import List, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path, help="a directory from_pretrained loads")
    parser.add_argument("--prompt", default="Alice was beginning to get very tired")
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = load(args.model)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    torch.manual_seed(args.seed)
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=args.max_new_tokens,
            do_sample=True,
            temperature=args.temperature,
            top_k=args.top_k,
            pad_token_id=tokenizer.eos_token_id,
        )
    print(tokenizer.decode(output[0], skip_special_tokens=True))


def load(directory: Path) -> torch.nn.Module:
    """The model of a from_pretrained directory, or a LoRA adapter directory on its base model."""
    if (directory / "adapter_config.json").is_file():
        from peft import PeftConfig, PeftModel

        base = AutoModelForCausalLM.from_pretrained(
            PeftConfig.from_pretrained(directory).base_model_name_or_path
        )
        return PeftModel.from_pretrained(base, directory).eval()
    return AutoModelForCausalLM.from_pretrained(directory).eval()


if __name__ == "__main__":
    main()
