"""
The text of the fine-tuning example: the chapters of the book the pretrained model has not seen,
read as the pretraining read the book (its wrapped lines joined into paragraphs). The package's
step ``fairscale::tokenize_text`` (config.jsonnet) tokenizes it with the pretrained model's own
tokenizer into blocks of ``input_ids`` and ``labels`` and holds out its end for validation.

The model needs no component: ``fairscale::from_pretrained`` builds it from the directory
``make_pretrained.py`` wrote.
"""

import hashlib
from pathlib import Path
from typing import List, Optional

# The text as the pretraining saw it (make_pretrained.py is beside this file, on Tango's path).
from make_pretrained import unwrap
from tango import Step

#: The files of the pretrained directory that decide the result of training, hashed into the text
#: step's id (see :attr:`BookText.unique_id`).
PRETRAINED_FILES = ("tokenizer.json", "config.json", "model.safetensors")


@Step.register("finetune::book_text")
class BookText(Step):
    """
    The text of ``path`` (its lines joined into paragraphs, :func:`unwrap`) from the first line
    starting with ``start`` (the whole text without it), as one document.

    ``pretrained`` is not read here: its files are hashed into this step's id (see
    :attr:`unique_id`).
    """

    DETERMINISTIC = True
    CACHEABLE = True
    VERSION = "001"

    @property
    def unique_id(self) -> str:
        # Tango names a step's result after its config alone. fairscale::tokenize_text adds the
        # text it reads and the tokenizer's files to its own id, but the training step names the
        # pretrained model by its path alone: a new model at the same path (make_pretrained.py run
        # again) would reuse the old result. Its weights, hashed here, rerun the steps after this one.
        if self.unique_id_cache is None:
            digest = hashlib.sha256()
            pretrained = Path(self.kwargs.get("pretrained") or "")
            for file in [
                Path(self.kwargs.get("path", "")),
                *(pretrained / name for name in PRETRAINED_FILES),
            ]:
                if file.is_file():
                    digest.update(file.name.encode())
                    digest.update(file.read_bytes())
            self.unique_id_cache = f"{super().unique_id}-{digest.hexdigest()[:8]}"
        return self.unique_id_cache

    def run(  # type: ignore[override]
        self, path: str, start: Optional[str] = None, pretrained: Optional[str] = None
    ) -> List[str]:
        if pretrained is not None and not Path(pretrained).is_dir():
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
        self.logger.info("%s: %d characters from %r", path, len(text), start)
        return [text]
