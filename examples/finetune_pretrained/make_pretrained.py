"""
Make the "pretrained" model that the example fine-tunes, since nothing can be downloaded: a
byte-level BPE tokenizer trained on the whole book, and a small GPT-2 trained briefly (in this
process, plain PyTorch) on the book's first chapters, saved together with ``save_pretrained`` as a
model from the Hugging Face hub would be: ``config.json``, ``model.safetensors``, the tokenizer's
files.

    python make_pretrained.py                                # ../../workspace/pretrained-gpt2
    python make_pretrained.py OUT_DIR --steps 0              # the random initialisation only

The fine-tuning (``config.jsonnet``) then trains it on the chapters it has not seen.
"""

import argparse
import math
import re
import time
from pathlib import Path
from typing import Any, List, Optional

import torch

HERE = Path(__file__).resolve().parent
BOOK = HERE.parent / "train_gpt2" / "data" / "alice_in_wonderland.txt"
#: Pretraining text: the book up to this line (chapters I to VI); the fine-tuning takes the rest.
PRETRAIN_UNTIL = "CHAPTER VII."
END_OF_TEXT = "<|endoftext|>"


def unwrap(text: str) -> str:
    """
    The book's lines joined into paragraphs: its line breaks are the edition's line wrapping, and a
    small model spends much of what it learns on predicting them. Blank lines stay. The fine-tuning
    (components.py) reads the text the same way.
    """
    return re.sub(r"(?<!\n)\n(?!\n)", " ", text.replace("\r\n", "\n"))


def train_tokenizer(text: str, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (GPT-2's kind) of ``vocab_size`` tokens, learned from ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        # Every byte is a token, so any text can be encoded, even one with characters the book lacks.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(text.splitlines(keepends=True), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT)


def pretrain(
    model: Any, tokens: torch.Tensor, steps: int, batch_size: int, block_size: int, lr: float
) -> List[float]:
    """``steps`` AdamW steps on random blocks of ``tokens``; the loss of each step."""
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps))
    )
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator)
        batch = torch.stack([tokens[s : s + block_size] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "out", type=Path, nargs="?", default=HERE.parent.parent / "workspace" / "pretrained-gpt2"
    )
    parser.add_argument(
        "--steps", type=int, default=400, help="pretraining steps; 0 saves the initialisation"
    )
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=128, help="the model's context (n_positions)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    # One thread: on a small or shared machine more threads than free cores spin against each other
    # (measured on the busy 2-core reference machine: 2.9 s per step with 2 threads, 0.28 s with 1).
    parser.add_argument("--threads", type=int, default=1, help="torch's compute threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import GPT2Config, GPT2LMHeadModel

    start = time.monotonic()
    book = unwrap(BOOK.read_text(encoding="utf-8"))
    tokenizer = train_tokenizer(book, args.vocab_size)
    first_part = book[: book.index("\n" + PRETRAIN_UNTIL)]
    tokens = torch.tensor(tokenizer(first_part)["input_ids"], dtype=torch.long)

    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.block_size,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # Tied: the LM head is the token embedding, as in GPT-2 (saved once, as transformer.wte.weight).
    model = GPT2LMHeadModel(config)
    # transformers finds no loss for GPT2LMHeadModel's class name and warns that it uses the
    # causal-LM loss; name that loss (the same one) instead, as the engine does for its workers.
    model.loss_type = "ForCausalLM"
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"GPT-2: {parameters:.2f} M parameters, vocabulary {len(tokenizer)}, context {args.block_size}")
    if args.steps > 0:
        print(f"Pretraining on chapters I-VI ({len(first_part):,} characters, {len(tokens):,} tokens)...")
        losses = pretrain(model, tokens, args.steps, args.batch_size, args.block_size, args.lr)
        last = sum(losses[-10:]) / len(losses[-10:])
        print(f"loss {losses[0]:.2f} at step 1, {last:.2f} over the last 10 steps")
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    files = ", ".join(sorted(p.name for p in args.out.iterdir()))
    print(f"Saved to {args.out} in {time.monotonic() - start:.0f} s: {files}")


if __name__ == "__main__":
    main()
