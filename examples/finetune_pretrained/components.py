"""
The data step of the fine-tuning example: a part of a text, tokenized with the pretrained model's
own tokenizer (``AutoTokenizer`` of its directory) into blocks of ``input_ids`` and ``labels``,
split into ``train`` and a held-out ``validation`` tail.

The model needs no component: ``fairscale::from_pretrained`` builds it from the directory
``make_pretrained.py`` wrote.
"""

import hashlib
from pathlib import Path
from typing import Dict, List, Optional

import torch

# The text as the pretraining saw it (make_pretrained.py is beside this file, on Tango's path).
from make_pretrained import unwrap
from tango import Step
from tango.common.dataset_dict import DatasetDict

#: The files of the pretrained directory that decide the result of training, hashed into the data
#: step's id (see :attr:`TextBlocks.unique_id`).
PRETRAINED_FILES = ("tokenizer.json", "config.json", "model.safetensors")


@Step.register("finetune::text_blocks")
class TextBlocks(Step):
    """
    The text of ``path`` (its lines joined into paragraphs, :func:`unwrap`) from the first line
    starting with ``start`` (the whole text without it), tokenized with the tokenizer of the
    ``pretrained`` directory. Its last
    ``validation_fraction`` (cut at a line break) is held out for validation; the rest is cut into
    training blocks of ``block_size`` tokens starting every ``train_stride`` tokens (overlapping
    blocks: more examples from a short text). Validation blocks do not overlap.
    """

    DETERMINISTIC = True
    CACHEABLE = True
    VERSION = "001"

    @property
    def unique_id(self) -> str:
        # Tango names a step's result after its config alone: an edited text or a new pretrained
        # model at the same paths would reuse the old tokens, and the training step that takes them
        # its old result. Hashing the files into this id reruns this step and the training after it.
        if self.unique_id_cache is None:
            digest = hashlib.sha256()
            pretrained = Path(self.kwargs["pretrained"])
            for file in [Path(self.kwargs["path"]), *(pretrained / name for name in PRETRAINED_FILES)]:
                if file.is_file():
                    digest.update(file.name.encode())
                    digest.update(file.read_bytes())
            self.unique_id_cache = f"{super().unique_id}-{digest.hexdigest()[:8]}"
        return self.unique_id_cache

    def run(  # type: ignore[override]
        self,
        path: str,
        pretrained: str,
        start: Optional[str] = None,
        block_size: int = 128,
        train_stride: Optional[int] = None,
        validation_fraction: float = 0.1,
    ) -> DatasetDict:
        from transformers import AutoTokenizer

        if not Path(pretrained).is_dir():
            raise FileNotFoundError(
                f"No pretrained model in {Path(pretrained).resolve()}: run `python make_pretrained.py` "
                "in examples/finetune_pretrained first."
            )
        text = unwrap(Path(path).read_text(encoding="utf-8"))
        if start is not None:
            at = text.find("\n" + start)
            if at < 0:
                raise ValueError(f"No line of {path} starts with {start!r}")
            text = text[at + 1 :]
        cut = text.rfind("\n", 0, int(len(text) * (1 - validation_fraction))) + 1
        tokenizer = AutoTokenizer.from_pretrained(pretrained)
        splits: Dict[str, List[Dict[str, torch.Tensor]]] = {}
        for split, part, stride in (
            ("train", text[:cut], train_stride or block_size),
            ("validation", text[cut:], block_size),
        ):
            tokens = torch.tensor(tokenizer(part)["input_ids"], dtype=torch.long)
            # clone(): a slice would keep (and pickle) the whole token tensor with every block.
            blocks = [
                tokens[i : i + block_size].clone() for i in range(0, len(tokens) - block_size + 1, stride)
            ]
            if not blocks:
                raise ValueError(f"The {split} text has {len(tokens)} tokens, fewer than one block")
            splits[split] = [{"input_ids": block, "labels": block} for block in blocks]
            self.logger.info(
                "%s: %d characters, %d tokens, %d blocks", split, len(part), len(tokens), len(blocks)
            )
        return DatasetDict(splits=splits, metadata={"pretrained": pretrained, "block_size": block_size})
