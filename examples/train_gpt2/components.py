"""
The pieces of the GPT-2 example: a text data set split into train and validation, byte-level
tokenization into fixed-length blocks, a GPT-2 language model built from a handful of config
numbers, and a callback that logs each validation loss.

Nothing is downloaded: the text ships in ``data/``, the tokenizer is the identity on UTF-8
bytes, and the model starts from random weights.
"""

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from tango import Step
from tango.common.dataset_dict import DatasetDict
from tango.integrations.torch import Model, TrainCallback
from transformers import GPT2Config, GPT2LMHeadModel

#: Token ids 0-255 are the UTF-8 bytes themselves; 256 marks the end of a document.
EOS_TOKEN_ID = 256
#: The number of distinct token ids that :func:`encode` produces.
VOCAB_SIZE = 257


def encode(text: str) -> List[int]:
    """Byte-level tokenization: the UTF-8 bytes of ``text``, one token each."""
    return list(text.encode("utf-8"))


def decode(token_ids: List[int]) -> str:
    """The inverse of :func:`encode`; end-of-document tokens become blank lines."""
    pieces: List[str] = []
    current = bytearray()
    for token_id in token_ids:
        if token_id == EOS_TOKEN_ID:
            pieces.append(current.decode("utf-8", errors="replace"))
            current = bytearray()
        else:
            current.append(token_id)
    pieces.append(current.decode("utf-8", errors="replace"))
    return "\n\n".join(pieces)


def _text_files(path: Path) -> List[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"No *.txt files in {path.resolve()}")
        return files
    if path.is_file():
        return [path]
    raise FileNotFoundError(
        f"{path.resolve()} does not exist. Run `tango run` from examples/train_gpt2, or give "
        "the data step an absolute path."
    )


@Step.register("gpt2::read_text")
class ReadText(Step):
    """
    Read UTF-8 text files and split each one into a ``train`` part and a ``validation`` part.

    Each file is one document. Its last ``validation_fraction`` (cut at a line break) goes to
    validation: a contiguous tail rather than random lines, so that no validation text also
    appears, shifted by a few bytes, in a training block.

    :param path: A ``.txt`` file, or a directory whose ``*.txt`` files are all read.
        Relative paths are relative to the directory ``tango run`` is started in.
    :param validation_fraction: The share of each document held out for validation.
    """

    DETERMINISTIC = True
    CACHEABLE = True
    VERSION = "001"

    @property
    def unique_id(self) -> str:
        # Tango names a step's cached result after its configuration only, so an edited file
        # at the same path would silently reuse the old text (and tokens, and model). Adding
        # the files' contents to the id makes an edit rerun this step and everything after it.
        if self.unique_id_cache is None:
            base = super().unique_id
            digest = hashlib.sha256()
            for file in _text_files(Path(self.kwargs.get("path", "data"))):
                digest.update(file.name.encode("utf-8"))
                digest.update(file.read_bytes())
            self.unique_id_cache = f"{base}-{digest.hexdigest()[:8]}"
        return self.unique_id_cache

    def run(  # type: ignore[override]
        self, path: str = "data", validation_fraction: float = 0.1
    ) -> DatasetDict:
        if not 0.0 < validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be between 0 and 1, got {validation_fraction}")
        train: List[str] = []
        validation: List[str] = []
        for file in _text_files(Path(path)):
            # Normalise Windows line endings: each "\r" would otherwise be a token to learn.
            text = file.read_text(encoding="utf-8").replace("\r\n", "\n")
            cut = int(len(text) * (1.0 - validation_fraction))
            line_break = text.rfind("\n", 0, cut)
            if line_break > 0:
                cut = line_break + 1
            train.append(text[:cut])
            validation.append(text[cut:])
            self.logger.info(
                "%s: %d characters, %d for training, %d for validation",
                file.name,
                len(text),
                cut,
                len(text) - cut,
            )
        return DatasetDict(splits={"train": train, "validation": validation}, metadata={"path": path})


@Step.register("gpt2::tokenize_bytes")
class TokenizeBytes(Step):
    """
    Byte-level tokenization of every split into blocks of ``block_size`` token ids, as
    ``{"input_ids": LongTensor, "labels": LongTensor}`` items (the labels are the inputs: the
    model shifts them by one position itself, as Hugging Face causal language models do).

    The documents of a split are joined with an end-of-document token
    (:data:`EOS_TOKEN_ID`) and cut into blocks; the incomplete tail is dropped.

    :param dataset_dict: Splits of raw text, e.g. from ``gpt2::read_text``.
    :param block_size: Tokens per block: at most the model's ``n_positions``.
    :param train_stride: How far apart training blocks start. Less than ``block_size`` makes
        overlapping blocks, i.e. more (correlated) training examples from a small text.
        Validation blocks never overlap.
    """

    DETERMINISTIC = True
    CACHEABLE = True
    VERSION = "001"

    def run(  # type: ignore[override]
        self, dataset_dict: DatasetDict, block_size: int = 128, train_stride: Optional[int] = None
    ) -> DatasetDict:
        if block_size < 2:
            raise ValueError(f"block_size must be at least 2 (one input and one target), got {block_size}")
        train_stride = train_stride or block_size
        splits: Dict[str, List[Dict[str, torch.Tensor]]] = {}
        for split, documents in dataset_dict.splits.items():
            token_ids: List[int] = []
            for document in documents:
                token_ids.extend(encode(document))
                token_ids.append(EOS_TOKEN_ID)
            tokens = torch.tensor(token_ids, dtype=torch.long)
            stride = train_stride if split == "train" else block_size
            blocks = [
                tokens[start : start + block_size] for start in range(0, len(tokens) - block_size + 1, stride)
            ]
            if not blocks:
                raise ValueError(
                    f"The {split!r} split has {len(tokens)} tokens, fewer than one block of {block_size}."
                )
            # clone(): a slice would keep (and pickle) the whole token tensor with every block.
            splits[split] = [{"input_ids": block.clone(), "labels": block.clone()} for block in blocks]
            self.logger.info("%s: %d tokens, %d blocks of %d", split, len(tokens), len(blocks), block_size)
        return DatasetDict(
            splits=splits,
            metadata={"vocab_size": VOCAB_SIZE, "eos_token_id": EOS_TOKEN_ID, "block_size": block_size},
        )


def gpt2_config(
    vocab_size: int = VOCAB_SIZE,
    n_positions: int = 128,
    n_embd: int = 128,
    n_layer: int = 4,
    n_head: int = 4,
    dropout: float = 0.1,
) -> GPT2Config:
    """
    The :class:`~transformers.GPT2Config` that both training (:class:`GPT2LanguageModel`) and
    ``generate.py`` build the model from. No key-value cache: training never uses one, and
    with it every batch's outputs would carry all the layers' keys and values.
    """
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        use_cache=False,
    )


@Model.register("gpt2::from_config")
class GPT2LanguageModel(Model):
    """
    A randomly initialised GPT-2 language model as a Tango :class:`~tango.integrations.torch.Model`.

    It holds the ``transformer`` and ``lm_head`` of a :class:`~transformers.GPT2LMHeadModel`
    under the same attribute names, so its ``state_dict()`` (and the ``weights.pt`` that
    ``torch::train`` writes) has exactly the keys of a plain ``GPT2LMHeadModel`` built from
    :func:`gpt2_config` with the same numbers: load it there with ``strict=True``.

    The transformer blocks are ``transformer.h.0``, ``transformer.h.1``, ...: the names that
    ``modules_to_wrap`` in the config matches.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        n_positions: int = 128,
        n_embd: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.config = gpt2_config(vocab_size, n_positions, n_embd, n_layer, n_head, dropout)
        # Built through GPT2LMHeadModel for its weight initialisation and its tied input and
        # output embeddings (lm_head.weight is transformer.wte.weight).
        plain = GPT2LMHeadModel(self.config)
        self.transformer = plain.transformer
        self.lm_head = plain.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> Dict[str, torch.Tensor]:
        """
        :returns: ``{"loss": ...}`` (next-token cross-entropy) when ``labels`` are given,
            else ``{"logits": ...}``. The logits are left out of training outputs: Tango keeps
            each batch's outputs until the next batch, and they are the largest tensor here.
        """
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden)
        if labels is None:
            return {"logits": logits}
        # Position t predicts token t + 1, as in GPT2LMHeadModel; -100 labels are ignored.
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)).float(),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
        )
        return {"loss": loss}


@TrainCallback.register("gpt2::log_validation")
class LogValidation(TrainCallback):
    """
    Logs every validation loss on the main process and appends it, as a JSON line
    ``{"step": ..., "loss": ..., "best_loss": ...}``, to ``validation.jsonl`` in the training
    step's work directory, where scripts and tests can read the learning curve.
    """

    def post_val_loop(self, step: int, epoch: int, val_metric: float, best_val_metric: float) -> None:
        if not self.is_local_main_process:
            return
        # Tango's step counter is 0-based and validation runs after the optimizer step.
        record: Dict[str, Any] = {"step": step + 1, "loss": val_metric, "best_loss": best_val_metric}
        self.logger.info(
            "Validation after step %d: loss %.4f (best %.4f)", step + 1, val_metric, best_val_metric
        )
        with open(self.work_dir / "validation.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
