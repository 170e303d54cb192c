"""
Text in, examples for a causal language model out: the data step ``"fairscale::tokenize_text"``.

Every fine-tuning run puts the same step before ``torch::train``: read the text, tokenize it with
the model's own tokenizer, cut the tokens into blocks of ``input_ids`` and ``labels`` (the labels
are the inputs: a Hugging Face causal LM shifts them itself) and hold some text out for
validation. The step reads text files, a directory of them, a Hugging Face dataset saved with
``save_to_disk``, or strings from another step, and returns a Tango
:class:`~tango.common.dataset_dict.DatasetDict` whose splits (:class:`TokenBlocks`) Tango's
``DataLoader`` and its default collator batch as they are.

Its result depends on its inputs only, so Tango's cache and a resumed run see the same examples:
the validation documents are chosen by hashing ``(seed, index)`` (no random generator whose
stream could change between releases), and the step's id covers the contents of the files it
reads (Tango hashes a step's config only), so an edited file tokenizes again.

``transformers`` and ``datasets`` are imported when the step runs: importing the package
(``-i tango_fairscale``) costs nothing more.
"""

import hashlib
import logging
import math
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
    overload,
)

import torch
from tango import Step
from tango.common.dataset_dict import DatasetDict

from .text_options import (
    STEP_NAME,
    TextDataError,
    TextNotFoundError,
    check_options,
    check_text_options,
    check_types,
    glob_error,
    input_name,
    path_entries_error,
)

logger = logging.getLogger(__name__)

#: What a label of a padding position is: Hugging Face's (and torch's cross entropy's) ignore index.
IGNORE_INDEX = -100
#: Files of a tokenizer's directory that are not hashed into the step's id: a model's weights,
#: which the tokenizer never reads (a model directory is usually also its tokenizer's), and which
#: would cost a read of gigabytes at every ``tango run``.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
#: Documents tokenized in one call (the fast tokenizers encode a batch on several threads).
_BATCH_DOCUMENTS = 64
_BATCH_CHARACTERS = 1 << 20

_T = TypeVar("_T")
#: ``Optional[X]`` with None first, for the options whose type ``run`` checks itself: Tango's
#: FromParams tries a Union's types in order and its ``int`` and ``bool`` convert (``true`` to 1,
#: ``0`` to false); None first passes the config's value as written, so a boolean where a number
#: is meant (or a number where true or false is) is refused in one line naming the option.
_AsWritten = Union[None, _T]


class TokenBlocks(SequenceABC):
    """
    One split's examples: item ``i`` is ``{"input_ids": ..., "labels": ...}`` (int64 tensors of
    ``block_size`` tokens) for the block starting at ``starts[i]`` of ``tokens``. Overlapping
    blocks share their tokens here, so a split costs its text's tokens (int32), not one tensor per
    example, in memory and in Tango's cache.

    With ``lengths`` (``pack: false``), block ``i`` has ``lengths[i]`` tokens and is padded to
    ``block_size``: ``input_ids`` with ``pad_token_id``, ``labels`` with -100 (no loss there),
    and an ``attention_mask`` (1 on the tokens, 0 on the padding) in every item.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        starts: torch.Tensor,
        block_size: int,
        lengths: Optional[torch.Tensor] = None,
        pad_token_id: int = 0,
    ) -> None:
        self.tokens = tokens
        self.starts = starts
        self.block_size = block_size
        self.lengths = lengths
        self.pad_token_id = pad_token_id

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]: ...

    @overload
    def __getitem__(self, index: slice) -> List[Dict[str, torch.Tensor]]: ...

    def __getitem__(
        self, index: Union[int, slice]
    ) -> Union[Dict[str, torch.Tensor], List[Dict[str, torch.Tensor]]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        start = int(self.starts[index])
        if self.lengths is None:
            # A copy (a new dtype): an item never keeps the whole split's tokens alive.
            block = self.tokens[start : start + self.block_size].to(torch.long)
            return {"input_ids": block, "labels": block}
        length = int(self.lengths[index])
        input_ids = torch.full((self.block_size,), self.pad_token_id, dtype=torch.long)
        input_ids[:length] = self.tokens[start : start + length]
        labels = torch.full((self.block_size,), IGNORE_INDEX, dtype=torch.long)
        labels[:length] = input_ids[:length]
        attention_mask = torch.zeros(self.block_size, dtype=torch.long)
        attention_mask[:length] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}

    def __repr__(self) -> str:
        padded = "" if self.lengths is None else ", padded"
        return f"TokenBlocks({len(self)} blocks of {self.block_size} tokens{padded})"


# --- The documents ------------------------------------------------------------------------------------


class _Corpus:
    """Documents by index, read when asked for, in the order asked."""

    def __init__(self, names: List[str], read: Callable[[Sequence[int]], Iterator[str]]) -> None:
        self.names = names
        self._read = read

    def __len__(self) -> int:
        return len(self.names)

    def texts(self, indices: Optional[Sequence[int]] = None) -> Iterator[str]:
        return self._read(range(len(self)) if indices is None else indices)


def _listed_files(path: Union[str, Sequence[str]], glob: str) -> List[Tuple[str, Optional[Path]]]:
    """
    ``(name, file)`` for each file ``path`` names: a file, a directory's files matching ``glob``
    (sorted by their path in it), or a list of either; ``file`` is None for a missing entry.
    """
    entries = [path] if isinstance(path, str) else list(path)
    found: List[Tuple[str, Optional[Path]]] = []
    for entry in entries:
        root = Path(entry)
        if root.is_dir():
            files = sorted(
                (p for p in root.glob(glob) if p.is_file()), key=lambda p: p.relative_to(root).as_posix()
            )
            found += [(f"{entry}/{p.relative_to(root).as_posix()}", p) for p in files]
        else:
            found.append((str(entry), root if root.is_file() else None))
    return found


def _file_corpus(path: Union[str, Sequence[str]], glob: str) -> _Corpus:
    if not isinstance(path, str) and len(path) == 0:
        raise TextDataError(f"{STEP_NAME}: path is an empty list: name a file or a directory of text files")
    for entry in [path] if isinstance(path, str) else path:
        root = Path(entry)
        if not root.exists():
            raise TextNotFoundError(
                f"{STEP_NAME}: path {entry} does not exist ({root.resolve()}); relative paths are "
                "relative to the directory tango runs in"
            )
        if root.is_dir() and not any(p.is_file() for p in root.glob(glob)):
            raise TextDataError(
                f"{STEP_NAME}: no file in the directory {entry} matches glob {glob!r}: set glob "
                "(e.g. '**/*.txt' for subdirectories too)"
            )
    files = [(name, file) for name, file in _listed_files(path, glob) if file is not None]
    seen: Dict[Path, str] = {}
    for name, file in files:
        first = seen.get(file.resolve())
        seen.setdefault(file.resolve(), name)
        if first is not None:
            # Each file is one document: a second copy landed in the other split, so the run
            # trained on the documents it held out.
            raise TextDataError(
                f"{STEP_NAME}: path names {file.resolve()} twice (as {first} and as {name}): list each "
                "file once, or a copy of a held-out document would be trained on"
            )
    if all(file.stat().st_size == 0 for _, file in files):
        raise TextDataError(f"{STEP_NAME}: every file of path {path} is empty: no text to tokenize")

    def read(indices: Sequence[int]) -> Iterator[str]:
        for index in indices:
            name, file = files[index]
            try:
                # Text mode reads \r\n and \r as \n: a Windows file tokenizes as its Unix copy.
                text = file.read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise TextDataError(
                    f"{STEP_NAME}: {name} is not UTF-8 text (byte {error.start}: {error.reason})"
                ) from None
            if "\x00" in text:
                # Valid UTF-8, but no text holds NUL: a binary file (an image, a tensor) read as words.
                raise TextDataError(
                    f"{STEP_NAME}: {name} holds NUL bytes (at character {text.index(chr(0))}): it is not "
                    "text; leave it out of path (or narrow glob)"
                )
            yield text

    return _Corpus([name for name, _ in files], read)


def _dataset_corpora(dataset: str, text_column: str, splits: Sequence[str]) -> List[_Corpus]:
    """The rows of each of ``splits`` of the dataset saved at ``dataset`` (one corpus each)."""
    directory = Path(dataset)
    if not directory.is_dir():
        raise TextNotFoundError(
            f"{STEP_NAME}: dataset {dataset} is not a directory ({directory.resolve()}): give the "
            "directory a Hugging Face dataset's save_to_disk wrote"
        )
    if not any((directory / name).is_file() for name in ("dataset_dict.json", "state.json")):
        raise TextDataError(
            f"{STEP_NAME}: dataset {dataset} has no dataset_dict.json or state.json: it is not a "
            "directory datasets' save_to_disk wrote"
        )
    try:
        import datasets
    except ImportError:
        raise TextDataError(
            f"{STEP_NAME}: dataset needs the datasets package: pip install 'tango-fairscale[hf]'"
        ) from None
    loaded = datasets.load_from_disk(str(directory))
    corpora = []
    for split in splits:
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise TextDataError(
                    f"{STEP_NAME}: dataset {dataset} has no split {split!r}: its splits are "
                    f"{sorted(loaded)} (set dataset_split / dataset_validation_split)"
                )
            rows = loaded[split]
        else:
            # A saved Dataset, not a DatasetDict: it is the one split there is, read as "train".
            # Any other split named (dataset_split, or a validation split) would silently be the
            # same rows.
            if splits[0] != "train" or len(splits) > 1:
                field, named = (
                    ("dataset_split", splits[0])
                    if splits[0] != "train"
                    else (
                        "dataset_validation_split",
                        splits[1],
                    )
                )
                raise TextDataError(
                    f"{STEP_NAME}: dataset {dataset} is a saved Dataset (one split, no names), so "
                    f"{field} {named!r} names nothing in it: remove {field}, or save a DatasetDict "
                    "with the splits (datasets.DatasetDict({...}).save_to_disk)"
                )
            rows = loaded
        if text_column not in rows.column_names:
            raise TextDataError(
                f"{STEP_NAME}: dataset {dataset} has no column {text_column!r}: its columns are "
                f"{rows.column_names} (set text_column)"
            )
        feature = rows.features[text_column]
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            raise TextDataError(
                f"{STEP_NAME}: column {text_column!r} of dataset {dataset} holds {feature}, not text "
                "(set text_column to a column of strings)"
            )
        corpora.append(_rows_corpus(rows.select_columns([text_column]), text_column))
    return corpora


def _rows_corpus(rows: Any, column: str) -> _Corpus:
    def read(indices: Sequence[int]) -> Iterator[str]:
        for at in range(0, len(indices), 1024):
            batch = indices[at : at + 1024]
            if isinstance(batch, range) and batch.step == 1:
                values = rows[batch.start : batch.stop][column]  # a slice: one read of the table
            else:
                values = rows[list(batch)][column]
            for value in values:
                yield value or ""  # a null row is an empty document

    return _Corpus([str(i) for i in range(len(rows))], read)


def _chosen_for_validation(count: int, documents: int, seed: int) -> List[int]:
    """
    The ``count`` documents (indices) with the smallest SHA-256 of ``seed:index``: the same
    choice on every machine and every release of Python, NumPy and torch, in index order.
    """
    keys = sorted(range(documents), key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).digest())
    return sorted(keys[:count])


def _cut_tail(text: str, fraction: float) -> int:
    """Where the last ``fraction`` of ``text`` starts: after the last line break before it, if any."""
    at = int(len(text) * (1.0 - fraction))
    line_break = text.rfind("\n", 0, at)
    return line_break + 1 if line_break >= 0 else at


# --- Tokens into blocks -------------------------------------------------------------------------------


def _batches(texts: Iterable[str]) -> Iterator[List[str]]:
    batch: List[str] = []
    characters = 0
    for text in texts:
        if not text:
            continue  # an empty document adds nothing, not even a separator
        batch.append(text)
        characters += len(text)
        if len(batch) >= _BATCH_DOCUMENTS or characters >= _BATCH_CHARACTERS:
            yield batch
            batch, characters = [], 0
    if batch:
        yield batch


def _tokenize_split(
    texts: Iterable[str],
    tokenizer: Any,
    *,
    block_size: int,
    stride: int,
    pack: bool,
    max_examples: Optional[int],
    add_special_tokens: bool,
) -> Tuple[TokenBlocks, Dict[str, int]]:
    """
    The blocks of ``texts``: packed (the documents' tokens joined with the tokenizer's EOS token
    between them, every ``stride`` tokens a block of ``block_size``, the incomplete end dropped),
    or each document on its own (its blocks every ``stride`` tokens, the last one padded; a block
    of fewer than 2 tokens has nothing to predict and is dropped). Tokenizing stops as soon as
    ``max_examples`` blocks are certain.
    """
    eos = tokenizer.eos_token_id
    pieces: List[torch.Tensor] = []
    starts: List[int] = []
    lengths: List[int] = []
    size = 0  # tokens in ``pieces``
    documents = 0
    # Packed: the tokens that make max_examples blocks.
    enough = 0 if max_examples is None else (max_examples - 1) * stride + block_size
    done = False
    for batch in _batches(texts):
        encoded = tokenizer(
            batch,
            add_special_tokens=add_special_tokens,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,  # no "longer than the maximum sequence length" warning: blocks cut them
        )["input_ids"]
        for ids in encoded:
            if not ids:
                continue
            if pack:
                # EOS between documents, unless the tokenizer ended the previous one with it.
                if documents and int(pieces[-1][-1]) != eos:
                    pieces.append(torch.tensor([eos], dtype=torch.int64))
                    size += 1
            else:
                start = 0
                while True:
                    end = min(start + block_size, len(ids))
                    if end - start >= 2:
                        starts.append(size + start)
                        lengths.append(end - start)
                    if end == len(ids) or (max_examples is not None and len(starts) >= max_examples):
                        break
                    start += stride
            pieces.append(torch.tensor(ids, dtype=torch.int64))
            size += len(ids)
            documents += 1
            done = max_examples is not None and (size >= enough if pack else len(starts) >= max_examples)
            if done:
                break
        if done:
            break
    tokens = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    if pack:
        starts = list(range(0, len(tokens) - block_size + 1, stride))
    if max_examples is not None:
        starts, lengths = starts[:max_examples], lengths[:max_examples]
    if pack:
        end = starts[-1] + block_size if starts else 0
    else:
        end = max((s + n for s, n in zip(starts, lengths)), default=0)
    # int32 holds any vocabulary there is, in half the memory and cache of int64.
    kept = tokens[:end]
    if len(kept) == 0 or int(kept.max()) < 2**31:
        kept = kept.to(torch.int32)
    else:
        kept = kept.clone()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    blocks = TokenBlocks(
        kept,
        torch.tensor(starts, dtype=torch.int64),
        block_size,
        lengths=None if pack else torch.tensor(lengths, dtype=torch.int32),
        pad_token_id=pad,
    )
    return blocks, {"documents": documents, "tokens": size}


# --- The step's id: the contents of what it reads -----------------------------------------------------


def _hash_file(digest: Any, name: str, file: Path) -> None:
    digest.update(f"{name}\0{file.stat().st_size}\0".encode())
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)


def content_digest(kwargs: Dict[str, Any]) -> str:
    """
    The SHA-256 (hex, 16 characters) of what the step's ``kwargs`` name on disk: each text file
    (``path``), every file of the saved ``dataset``, and the ``tokenizer`` directory's files but a
    model's weights (:data:`WEIGHT_SUFFIXES`). What is missing counts as missing: the step itself
    then says what.
    """
    digest = hashlib.sha256()
    path, glob = kwargs.get("path"), kwargs.get("glob", "*.txt")
    # A path or glob the step refuses is not listed (a glob of '' raised here, before the step said why).
    if path is not None and path_entries_error(path) is None and glob_error(glob) is None:
        for name, file in _listed_files(path, glob):
            if file is None:
                digest.update(f"missing\0{name}\0".encode())
            else:
                _hash_file(digest, f"path\0{name}", file)
    for key, recursive in (("dataset", True), ("tokenizer", False)):
        value = kwargs.get(key)
        if not isinstance(value, str):
            continue
        root = Path(value)
        files = sorted(root.rglob("*") if recursive else root.glob("*"), key=lambda p: p.as_posix())
        for file in files:
            if file.is_file() and (recursive or not file.name.endswith(WEIGHT_SUFFIXES)):
                _hash_file(digest, f"{key}\0{file.relative_to(root).as_posix()}", file)
    return digest.hexdigest()[:16]


# --- The step -------------------------------------------------------------------------------------


@Step.register(STEP_NAME)
class TokenizeText(Step):
    """
    Text tokenized into examples for a causal language model: a Tango ``DatasetDict`` with a
    ``train`` split and, when asked for, a ``validation`` split, each a :class:`TokenBlocks` of
    ``{"input_ids", "labels"}`` int64 tensors of ``block_size`` tokens (and ``attention_mask``
    with ``pack: false``), which ``torch::train``'s ``DataLoader`` batches with Tango's default
    collator and a Hugging Face causal LM takes as ``model(input_ids=..., labels=...)``.

    The text (exactly one of):

    :param path: A UTF-8 text file, a directory (its files matching ``glob``, in sorted order), or a
        list of either. Each file is one document. Relative to the directory ``tango run`` runs in.
    :param glob: The files of a directory in ``path`` that are read (``"**/*.txt"``: subdirectories
        too); a pattern inside it, neither absolute nor climbing out with ``..``.
    :param dataset: A directory ``datasets``' ``save_to_disk`` wrote (a ``DatasetDict`` or a
        ``Dataset``); each row's ``text_column`` is one document.
    :param text_column: The dataset's column of text (another one only with ``dataset``).
    :param dataset_split: The split of a saved ``DatasetDict`` that is read (another one only with
        ``dataset``).
    :param dataset_validation_split: A split of the saved ``DatasetDict`` to validate on, as it is
        (instead of ``validation_fraction`` or ``validation_count``).
    :param documents: Strings, each one document, or one string, one document: another step's
        result (``{"type": "ref", ...}``).

    The tokens:

    :param tokenizer: A directory ``transformers.AutoTokenizer.from_pretrained`` loads (a model's
        ``save_pretrained`` directory, usually the one the model is fine-tuned from).
    :param block_size: Tokens per example: at most the model's context (``n_positions``,
        ``max_position_embeddings``); at least 2.
    :param stride: How far apart training blocks start (1 to ``block_size``; default
        ``block_size``): less makes overlapping blocks, more (correlated) examples from a short
        text. Validation blocks never overlap.
    :param pack: True: the documents are joined, with the tokenizer's EOS token between them, and
        cut into blocks; the incomplete last block is dropped. False: each document is cut on its
        own and its last block padded (``attention_mask`` 0, ``labels`` -100 there), for
        documents that must not share a block.
    :param add_special_tokens: Passed to the tokenizer for each document (a Llama tokenizer's
        BOS at its start, for one).
    :param max_examples: At most this many examples in each split (the first ones); tokenizing
        stops once they are made.

    The validation split (none unless one of ``validation_fraction``, ``validation_count`` or
    ``dataset_validation_split`` is set):

    :param validation_fraction: The share of the text held out, in (0, 1): of the documents
        (rounded up), or of each document's end (``split_by: "tail"``).
    :param validation_count: The number of documents held out.
    :param split_by: ``"documents"``: whole documents, chosen by hashing ``seed`` with each
        document's index (no document is in both splits); ``"tail"``: the last
        ``validation_fraction`` of every document, cut after a line break (for a few long texts,
        a book).
    :param seed: Which documents ``split_by: "documents"`` holds out.

    :param hash_contents: Whether the step's id covers the contents of the files it reads (the
        text, the dataset, the tokenizer's files; read once per ``tango run``), so that an edited
        file tokenizes again instead of reusing Tango's cached result. False: the config alone
        (Tango's default), for inputs too large to read at every run; then give changed contents
        a new path.
    """

    DETERMINISTIC = True
    CACHEABLE = True
    VERSION = "001"

    @property
    def unique_id(self) -> str:
        # Tango names a result after the step's config: without the contents, an edited text or a
        # new tokenizer at the same path would reuse the old tokens, and the training after them.
        cached = self.unique_id_cache
        if cached is None:
            cached = super().unique_id  # sets unique_id_cache to Tango's id
            if self.kwargs.get("hash_contents", True):
                cached = f"{cached}-{content_digest(self.kwargs)}"
            self.unique_id_cache = cached
        return cached

    def run(  # type: ignore[override]
        self,
        tokenizer: str,
        path: Optional[Union[str, List[str]]] = None,
        glob: str = "*.txt",
        dataset: Optional[str] = None,
        text_column: str = "text",
        dataset_split: str = "train",
        dataset_validation_split: Optional[str] = None,
        # A Union, so that Tango keeps one string as it is (a List[str] made it a list of characters).
        documents: Optional[Union[str, List[str]]] = None,
        block_size: int = 128,
        stride: _AsWritten[int] = None,
        pack: _AsWritten[bool] = True,
        add_special_tokens: _AsWritten[bool] = True,
        max_examples: _AsWritten[int] = None,
        validation_fraction: Optional[float] = None,
        validation_count: _AsWritten[int] = None,
        split_by: str = "documents",
        seed: int = 0,
        hash_contents: _AsWritten[bool] = True,
    ) -> DatasetDict:
        check_types(
            block_size=block_size,
            stride=stride,
            max_examples=max_examples,
            validation_count=validation_count,
            validation_fraction=validation_fraction,
            pack=pack,
            add_special_tokens=add_special_tokens,
            hash_contents=hash_contents,
        )
        check_text_options(
            path=path,
            glob=glob,
            dataset=dataset,
            text_column=text_column,
            dataset_split=dataset_split,
            documents=documents,
        )
        stride = block_size if stride is None else stride
        check_options(
            path=path,
            dataset=dataset,
            documents=documents,
            dataset_validation_split=dataset_validation_split,
            block_size=block_size,
            stride=stride,
            max_examples=max_examples,
            validation_fraction=validation_fraction,
            validation_count=validation_count,
            split_by=split_by,
        )
        assert isinstance(pack, bool) and isinstance(add_special_tokens, bool)  # by check_types
        if not Path(tokenizer).is_dir():
            raise TextNotFoundError(
                f"{STEP_NAME}: tokenizer {tokenizer} is not a directory ({Path(tokenizer).resolve()}): give "
                "one AutoTokenizer.from_pretrained loads, e.g. the model's save_pretrained directory"
            )

        # The documents of each split, as functions that read them (a split is read once).
        plan: Dict[str, Tuple[Callable[[], Iterator[str]], int]] = {}
        metadata: Dict[str, Any] = {}
        if dataset is not None:
            splits = [dataset_split] + ([dataset_validation_split] if dataset_validation_split else [])
            corpora = _dataset_corpora(dataset, text_column, splits)
            corpus = corpora[0]
            if dataset_validation_split is not None:
                plan["validation"] = (corpora[1].texts, len(corpora[1]))
        elif path is not None:
            corpus = _file_corpus(path, glob)
        else:
            assert documents is not None
            texts = [documents] if isinstance(documents, str) else list(documents)
            wrong = next((t for t in texts if not isinstance(t, str)), None)
            if wrong is not None:
                raise TextDataError(
                    f"{STEP_NAME}: documents must be a list of strings, each one document; it holds a "
                    f"{type(wrong).__name__} (a step whose result is not a list of strings?)"
                )
            if not any(texts):
                raise TextDataError(f"{STEP_NAME}: documents holds no text: nothing to tokenize")
            corpus = _Corpus([str(i) for i in range(len(texts))], lambda indices: (texts[i] for i in indices))
        if len(corpus) == 0:
            raise TextDataError(
                f"{STEP_NAME}: {input_name(path, dataset)} has no documents: no text to tokenize"
            )

        if validation_count is not None or (validation_fraction is not None and split_by == "documents"):
            if validation_count is not None:
                count = validation_count
            else:
                assert validation_fraction is not None
                # Rounded up (at least one document), after rounding off float noise: 0.1 * 30 is
                # 3.0000000000000004, which is 3 documents, not 4.
                count = math.ceil(round(validation_fraction * len(corpus), 6))
            if count >= len(corpus):
                raise TextDataError(
                    f"{STEP_NAME}: holding out {count} of {len(corpus)} document(s) leaves none to "
                    "train on: lower validation_count / validation_fraction, or hold out the end of "
                    'each document with split_by: "tail"'
                )
            held_out = _chosen_for_validation(count, len(corpus), seed)
            kept = sorted(set(range(len(corpus))) - set(held_out))
            plan["train"] = (lambda: corpus.texts(kept), len(kept))
            plan["validation"] = (lambda: corpus.texts(held_out), len(held_out))
            metadata["validation_documents"] = [corpus.names[i] for i in held_out]
        elif validation_fraction is not None:  # the tail of each document
            fraction = validation_fraction
            plan["train"] = (lambda: (t[: _cut_tail(t, fraction)] for t in corpus.texts()), len(corpus))
            plan["validation"] = (lambda: (t[_cut_tail(t, fraction) :] for t in corpus.texts()), len(corpus))
        else:
            plan["train"] = (corpus.texts, len(corpus))
        plan = {"train": plan["train"], **plan}  # train first, in the result too

        loaded = _load_tokenizer(tokenizer)
        if pack and loaded.eos_token_id is None and any(n > 1 for _, n in plan.values()):
            raise TextDataError(
                f"{STEP_NAME}: the tokenizer in {tokenizer} has no eos_token to put between packed "
                "documents: give it one (tokenizer.eos_token = ...; save_pretrained), or set pack: false"
            )
        model_max_length = getattr(loaded, "model_max_length", None)
        if isinstance(model_max_length, int) and block_size > model_max_length:
            self.logger.warning(
                "block_size %d is more than the tokenizer's model_max_length %d: the model may not "
                "take positions that far",
                block_size,
                model_max_length,
            )

        result: Dict[str, TokenBlocks] = {}
        counts: Dict[str, Dict[str, int]] = {}
        for split, (texts_of_split, _) in plan.items():
            blocks, count_of = _tokenize_split(
                texts_of_split(),
                loaded,
                block_size=block_size,
                stride=stride if split == "train" else block_size,
                pack=pack,
                max_examples=max_examples,
                add_special_tokens=add_special_tokens,
            )
            if len(blocks) == 0:
                raise TextDataError(
                    f"{STEP_NAME}: the {split} text has {count_of['tokens']} tokens, not one block of "
                    f"{block_size}: lower block_size, or give more text"
                )
            result[split], counts[split] = blocks, {**count_of, "examples": len(blocks)}
            self.logger.info(
                "%s: %d documents, %d tokens, %d examples of %d tokens",
                split,
                count_of["documents"],
                count_of["tokens"],
                len(blocks),
                block_size,
            )
        metadata.update(
            tokenizer=tokenizer,
            vocab_size=len(loaded),
            eos_token_id=loaded.eos_token_id,
            block_size=block_size,
            stride=stride,
            pack=pack,
            splits=counts,
        )
        return DatasetDict(splits=result, metadata=metadata)


def _load_tokenizer(directory: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TextDataError(
            f"{STEP_NAME} needs the transformers package: pip install 'tango-fairscale[examples]'"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TextDataError(
            f"{STEP_NAME}: AutoTokenizer.from_pretrained cannot load the tokenizer in {directory}: "
            f"{first_line}"
        ) from None
