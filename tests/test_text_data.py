"""
The data step ``"fairscale::tokenize_text"``: its blocks are the tokenizer's own tokens cut into
windows (a text file, a directory, a saved Hugging Face dataset, strings), its validation split
is the same on every run, its errors are one line and come before any tokenizing, its id follows
the contents of what it reads, and ``torch::train`` on its output with either backend resumes
exactly after a kill.
"""

import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from tango.common.exceptions import CliRunError, ConfigurationError

from tango_fairscale.finetune.text_data import (
    STEP_NAME,
    TextDataError,
    TextNotFoundError,
    TokenBlocks,
    TokenizeText,
)
from tests import harness
from tests.helpers import max_abs_difference, train_config

pytest.importorskip("transformers")

EOS = "<|endoftext|>"
PAD = "<pad>"
WORDS = "the queen said alice and rabbit ran down a hole into garden with cat who smiled at tea".split()


def text(seed: int, lines: int) -> str:
    """Lines of words, deterministic in ``seed``."""
    rng = random.Random(seed)
    return "".join(
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))) + ".\n" for _ in range(lines)
    )


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer (GPT-2's kind) learned from :func:`text`, saved as transformers does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=160,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(text(0, 200).splitlines(keepends=True), trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=PAD).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def run_step(**kwargs: Any) -> Any:
    return TokenizeText().run(**kwargs)


def ids(tokenizer: Any, value: str) -> List[int]:
    """The direct tokenizer call the step must agree with."""
    return list(tokenizer(value)["input_ids"])


def windows(stream: List[int], size: int, stride: int) -> List[List[int]]:
    return [stream[i : i + size] for i in range(0, len(stream) - size + 1, stride)]


def assert_blocks(split: Any, expected: List[List[int]]) -> None:
    """``split``'s items are exactly ``expected``'s windows, labels the inputs, no padding."""
    assert len(split) == len(expected) > 0
    for item, window in zip(split, expected):
        assert set(item) == {"input_ids", "labels"}
        assert item["input_ids"].dtype == torch.long
        assert item["input_ids"].tolist() == window
        assert torch.equal(item["labels"], item["input_ids"])


# --- What the blocks are ----------------------------------------------------------------------------


def test_a_text_file_is_the_tokenizers_windows_and_its_tail_validates(
    tokenizer_dir: Path, tok: Any, tmp_path: Path
) -> None:
    book = text(1, 60)
    (tmp_path / "book.txt").write_text(book)
    result = run_step(
        path=str(tmp_path / "book.txt"),
        tokenizer=str(tokenizer_dir),
        block_size=16,
        stride=8,
        validation_fraction=0.2,
        split_by="tail",
    )
    assert list(result) == ["train", "validation"]
    # The held-out tail starts after the last line break before 80 % of the text.
    cut = book.rfind("\n", 0, int(len(book) * 0.8)) + 1
    assert_blocks(result["train"], windows(ids(tok, book[:cut]), 16, 8))
    # Validation blocks never overlap, whatever the training stride.
    assert_blocks(result["validation"], windows(ids(tok, book[cut:]), 16, 16))
    assert result.metadata["vocab_size"] == len(tok)
    assert result.metadata["splits"]["train"]["tokens"] == len(ids(tok, book[:cut]))


def test_a_directory_is_packed_in_sorted_order_with_eos_between(
    tokenizer_dir: Path, tok: Any, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for name, seed in (("b.txt", 2), ("a.txt", 3), ("sub/c.txt", 4), ("notes.md", 5)):
        (corpus / name).write_text(text(seed, 6))
    eos = [tok.eos_token_id]
    a, b, c = (ids(tok, (corpus / name).read_text()) for name in ("a.txt", "b.txt", "sub/c.txt"))

    result = run_step(path=str(corpus), tokenizer=str(tokenizer_dir), block_size=12)
    assert list(result) == ["train"]
    assert_blocks(result["train"], windows(a + eos + b, 12, 12))
    nested = run_step(path=str(corpus), glob="**/*.txt", tokenizer=str(tokenizer_dir), block_size=12)
    assert_blocks(nested["train"], windows(a + eos + b + eos + c, 12, 12))
    # A list keeps its order; max_examples keeps the first blocks.
    listed = run_step(
        path=[str(corpus / "sub" / "c.txt"), str(corpus / "a.txt")],
        tokenizer=str(tokenizer_dir),
        block_size=12,
        stride=5,
        max_examples=4,
    )
    assert_blocks(listed["train"], windows(c + eos + a, 12, 5)[:4])


def test_documents_of_another_step_with_a_tokenizer_that_adds_bos_and_eos(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    from tokenizers import processors
    from transformers import AutoTokenizer

    # Llama's kind: each document's tokens end with EOS already, so packing adds none.
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)  # a copy of its own: this changes it
    backend = tok.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single=f"{PAD} $A {EOS}", special_tokens=[(PAD, tok.pad_token_id), (EOS, tok.eos_token_id)]
    )
    type(tok)(tokenizer_object=backend, eos_token=EOS, pad_token=PAD).save_pretrained(tmp_path / "tok")
    special = AutoTokenizer.from_pretrained(tmp_path / "tok")
    documents = [text(6, 3), "", text(7, 2)]
    first, second = ids(special, documents[0]), ids(special, documents[2])
    assert first[-1] == second[-1] == special.eos_token_id and first[0] == special.pad_token_id
    result = run_step(documents=documents, tokenizer=str(tmp_path / "tok"), block_size=10, stride=3)
    assert_blocks(result["train"], windows(first + second, 10, 3))
    plain = run_step(
        documents=documents, tokenizer=str(tmp_path / "tok"), block_size=10, add_special_tokens=False
    )
    stream = list(special(documents[0], add_special_tokens=False)["input_ids"])
    stream += [special.eos_token_id] + list(special(documents[2], add_special_tokens=False)["input_ids"])
    assert_blocks(plain["train"], windows(stream, 10, 10))


def test_validation_documents_are_the_same_on_every_run(
    tokenizer_dir: Path, tok: Any, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(10):
        (corpus / f"{i:02d}.txt").write_text(text(10 + i, 3))

    def split(**kwargs: Any) -> Any:
        return run_step(path=str(corpus), tokenizer=str(tokenizer_dir), block_size=8, stride=4, **kwargs)

    first, again = split(validation_fraction=0.3, seed=1), split(validation_fraction=0.3, seed=1)
    held_out = first.metadata["validation_documents"]
    names = [f"{corpus}/{i:02d}.txt" for i in range(10)]
    # Pinned: the choice hashes (seed, index), so no library release can move it.
    assert held_out == [names[i] for i in (4, 7, 8)]
    assert again.metadata["validation_documents"] == held_out
    for name in ("train", "validation"):
        assert len(first[name]) == len(again[name])
        assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(first[name], again[name]))
    # Each split is its documents, packed in their order; nothing is in both.
    eos = [tok.eos_token_id]

    def packed(files: List[str]) -> List[int]:
        stream: List[int] = []
        for file in files:
            stream += (eos if stream else []) + ids(tok, Path(file).read_text())
        return stream

    assert_blocks(first["validation"], windows(packed(held_out), 8, 8))
    assert_blocks(first["train"], windows(packed([n for n in names if n not in held_out]), 8, 4))
    # Another seed holds out other documents; a count holds out that many.
    assert split(validation_fraction=0.3, seed=2).metadata["validation_documents"] != held_out
    assert len(split(validation_count=4, seed=1).metadata["validation_documents"]) == 4


def test_a_saved_dataset_unpacked_pads_each_documents_last_block(
    tokenizer_dir: Path, tok: Any, tmp_path: Path
) -> None:
    import datasets

    rows = {"text": [text(20, 2), "", text(21, 1), None, text(22, 3)], "n": [0, 1, 2, 3, 4]}
    test_rows = {"text": [text(23, 2)], "n": [5]}
    saved = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(rows), "test": datasets.Dataset.from_dict(test_rows)}
    )
    saved.save_to_disk(str(tmp_path / "saved"))
    result = run_step(
        dataset=str(tmp_path / "saved"),
        dataset_validation_split="test",
        tokenizer=str(tokenizer_dir),
        block_size=8,
        stride=6,
        pack=False,
    )

    def expected(document: str, stride: int) -> List[List[int]]:
        tokens, blocks, start = ids(tok, document), [], 0
        while True:
            blocks.append(tokens[start : start + 8])
            if start + 8 >= len(tokens):
                return blocks
            start += stride

    for split, documents, stride in (
        ("train", [rows["text"][i] for i in (0, 2, 4)], 6),
        ("validation", test_rows["text"], 8),
    ):
        want = [block for document in documents for block in expected(document, stride)]
        got = list(result[split])
        assert len(got) == len(want)
        for item, block in zip(got, want):
            n = len(block)
            assert item["input_ids"][:n].tolist() == block and item["labels"][:n].tolist() == block
            assert (item["input_ids"][n:] == tok.pad_token_id).all() and (item["labels"][n:] == -100).all()
            assert item["attention_mask"].tolist() == [1] * n + [0] * (8 - n)
    # A saved Dataset (no splits) is the one split; max_examples cuts each split.
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "plain"))
    plain = run_step(
        dataset=str(tmp_path / "plain"), tokenizer=str(tokenizer_dir), block_size=8, max_examples=3
    )
    eos = [tok.eos_token_id]
    stream = ids(tok, rows["text"][0]) + eos + ids(tok, rows["text"][2]) + eos + ids(tok, rows["text"][4])
    assert_blocks(plain["train"], windows(stream, 8, 8)[:3])


# --- Errors: one line, before tokenizing ------------------------------------------------------------


def errors_cases(root: Path, tokenizer: str) -> Dict[str, Any]:
    (root / "empty_dir").mkdir()
    (root / "only_md").mkdir()
    (root / "only_md" / "a.md").write_text("text")
    (root / "empty.txt").write_text("")
    (root / "ok.txt").write_text(text(30, 5))
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (root / "zeros.txt").write_bytes(b"\0" * 64)  # valid UTF-8, but no text
    (root / "docs").mkdir()
    (root / "docs" / "a.txt").write_text(text(30, 5))
    (root / "docs" / "b.txt").write_text(text(30, 6))
    ok = str(root / "ok.txt")
    return {
        "path .*nowhere.txt does not exist": dict(path=str(root / "nowhere.txt"), tokenizer=tokenizer),
        "no file in the directory .*empty_dir matches glob '\\*.txt'": dict(
            path=str(root / "empty_dir"), tokenizer=tokenizer
        ),
        "no file in the directory .*only_md matches glob": dict(
            path=str(root / "only_md"), tokenizer=tokenizer
        ),
        "every file of path .*empty.txt is empty": dict(path=str(root / "empty.txt"), tokenizer=tokenizer),
        "documents holds no text": dict(documents=["", ""], tokenizer=tokenizer),
        "documents must be a list of strings, each one document; it holds a dict": dict(
            documents=[{"text": "a"}], tokenizer=tokenizer
        ),
        "block_size is 1; it must be at least 2": dict(path=ok, tokenizer=tokenizer, block_size=1),
        "stride is 9; it must be between 1 and block_size \\(8\\)": dict(
            path=ok, tokenizer=tokenizer, block_size=8, stride=9
        ),
        "validation_fraction is 0.0; it must be between 0 and 1": dict(
            path=ok, tokenizer=tokenizer, validation_fraction=0.0
        ),
        "validation_fraction is 1.5; it must be between 0 and 1": dict(
            path=ok, tokenizer=tokenizer, validation_fraction=1.5
        ),
        "give exactly one of path, dataset and documents .*not path and documents": dict(
            path=ok, documents=["x"], tokenizer=tokenizer
        ),
        "give at most one of validation_fraction and validation_count": dict(
            path=ok, tokenizer=tokenizer, validation_fraction=0.1, validation_count=1
        ),
        'validation_count counts documents; with split_by: "tail"': dict(
            path=ok, tokenizer=tokenizer, validation_count=1, split_by="tail"
        ),
        "holding out 1 of 1 document\\(s\\) leaves none to train on": dict(
            path=ok, tokenizer=tokenizer, validation_fraction=0.1
        ),
        "split_by is 'lines'": dict(path=ok, tokenizer=tokenizer, split_by="lines"),
        "tokenizer .*no_tokenizer is not a directory": dict(path=ok, tokenizer=str(root / "no_tokenizer")),
        "latin1.txt is not UTF-8 text \\(byte 3": dict(path=str(root / "latin1.txt"), tokenizer=tokenizer),
        "zeros.txt holds NUL bytes \\(at character 0\\): it is not text": dict(
            path=str(root / "zeros.txt"), tokenizer=tokenizer
        ),
        # The same files twice: a copy of each held-out document was trained on.
        "path names .*docs/a.txt twice \\(as .*docs/a.txt and as .*docs/a.txt\\)": dict(
            path=[str(root / "docs"), str(root / "docs")], tokenizer=tokenizer, validation_fraction=0.5
        ),
        "path names .*docs/b.txt twice": dict(
            path=[str(root / "docs" / "b.txt"), str(root / "docs")], tokenizer=tokenizer
        ),
        "the train text has \\d+ tokens, not one block of 4096": dict(
            path=ok, tokenizer=tokenizer, block_size=4096
        ),
        "dataset .*nowhere is not a directory": dict(dataset=str(root / "nowhere"), tokenizer=tokenizer),
        "dataset .*empty_dir has no dataset_dict.json or state.json": dict(
            dataset=str(root / "empty_dir"), tokenizer=tokenizer
        ),
    }


def test_errors_are_one_line_naming_the_field(tokenizer_dir: Path, tmp_path: Path) -> None:
    for message, kwargs in errors_cases(tmp_path, str(tokenizer_dir)).items():
        # A ConfigurationError that tango run prints as its message alone (a CliRunError).
        with pytest.raises(TextDataError, match=message) as caught:
            run_step(**kwargs)
        assert isinstance(caught.value, ConfigurationError) and isinstance(caught.value, CliRunError)
        assert "\n" not in str(caught.value) and str(caught.value).startswith(STEP_NAME), str(caught.value)
        missing = "does not exist" in message or "is not a directory" in message
        assert isinstance(caught.value, (TextNotFoundError, FileNotFoundError)) == missing, message


def test_dataset_errors_come_before_the_tokenizer_is_loaded(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["a b"], "n": [1]})}).save_to_disk(
        str(tmp_path / "saved")
    )
    (tmp_path / "not_a_tokenizer").mkdir()  # a directory AutoTokenizer cannot load
    common = dict(dataset=str(tmp_path / "saved"), tokenizer=str(tmp_path / "not_a_tokenizer"))
    datasets.Dataset.from_dict({"body": ["a b"]}).save_to_disk(str(tmp_path / "plain"))
    plain = dict(
        dataset=str(tmp_path / "plain"), tokenizer=str(tmp_path / "not_a_tokenizer"), text_column="body"
    )
    for message, kwargs in {
        "is a saved Dataset \\(one split, no names\\), so dataset_split 'validation' names nothing": dict(
            dataset_split="validation"
        ),
        "so dataset_validation_split 'validation' names nothing in it: remove": dict(
            dataset_validation_split="validation"
        ),
    }.items():
        with pytest.raises(ConfigurationError, match=message):
            run_step(**{**plain, **kwargs})
    for message, kwargs in {
        "has no column 'text': its columns are \\['body', 'n'\\] \\(set text_column\\)": {},
        "column 'n' of dataset .* holds Value\\('int64'\\), not text": dict(text_column="n"),
        "has no split 'validation': its splits are \\['train'\\]": dict(
            text_column="body", dataset_validation_split="validation"
        ),
        "AutoTokenizer.from_pretrained cannot load the tokenizer in": dict(text_column="body"),
    }.items():
        with pytest.raises(ConfigurationError, match=message) as caught:
            run_step(**common, **kwargs)
        assert "\n" not in str(caught.value), str(caught.value)


# --- Tango: the id, the cache, the import -------------------------------------------------------------


def test_the_step_id_follows_the_contents_it_reads(tokenizer_dir: Path, tmp_path: Path) -> None:
    import shutil

    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, tokenizer)
    (tmp_path / "book.txt").write_text("one\n")
    config = dict(path=str(tmp_path / "book.txt"), tokenizer=str(tokenizer), block_size=8)

    def step_id(**extra: Any) -> str:
        return TokenizeText(step_name="data", **{**config, **extra}).unique_id

    first = step_id()
    assert first.startswith("TokenizeText-001-") and step_id() == first
    (tmp_path / "book.txt").write_text("two\n")
    edited = step_id()
    assert edited != first
    # A model's weights beside the tokenizer are not read (gigabytes at every run), its files are.
    (tokenizer / "model.safetensors").write_bytes(b"weights")
    assert step_id() == edited
    (tokenizer / "tokenizer_config.json").write_text((tokenizer / "tokenizer_config.json").read_text() + " ")
    assert step_id() != edited
    # Without hash_contents, the config alone (Tango's own id).
    unhashed = step_id(hash_contents=False)
    (tmp_path / "book.txt").write_text("three\n")
    assert step_id(hash_contents=False) == unhashed != step_id()
    assert step_id(block_size=16) != step_id()


def test_the_result_goes_through_tangos_cache_format(tokenizer_dir: Path, tmp_path: Path) -> None:
    from tango import Step

    (tmp_path / "book.txt").write_text(text(40, 30))
    result = run_step(path=str(tmp_path / "book.txt"), tokenizer=str(tokenizer_dir), block_size=16, stride=4)
    # The format Tango caches a step's result in (dill, gzipped), written and read back.
    assert TokenizeText.FORMAT is Step.FORMAT
    (tmp_path / "cache").mkdir()
    TokenizeText.FORMAT.write(result, tmp_path / "cache")
    loaded = TokenizeText.FORMAT.read(tmp_path / "cache")
    assert isinstance(loaded["train"], TokenBlocks) and len(loaded["train"]) == len(result["train"])
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(loaded["train"], result["train"]))
    # Overlapping blocks share their tokens: the split holds the text's tokens once, as int32.
    tokens = result.metadata["splits"]["train"]["tokens"]
    assert loaded["train"].tokens.dtype == torch.int32 and len(loaded["train"].tokens) <= tokens


def test_importing_the_package_imports_neither_transformers_nor_datasets() -> None:
    script = (
        "import sys, tango_fairscale\nfrom tango import Step\n"
        f"assert Step.by_name({STEP_NAME!r}) is tango_fairscale.TokenizeText\n"
        "print(sorted(m for m in ('transformers', 'datasets', 'tokenizers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


# --- torch::train on the step's output: either backend, killed after a checkpoint, resumed -------------

#: Checkpoint every 3 steps; the killed run dies right after checkpoint_state_step3.
KILL_AFTER = 3


def lm_experiment(book: Path, tokenizer: Path, vocab_size: int, backend: str, killed: bool) -> Dict[str, Any]:
    """A 2-layer GPT-2, one FSDP unit per block, trained on the step's blocks of ``book``."""
    model = {
        "type": "fairscale::with_wrapped_modules",
        "model": {
            "type": "test::hf_gpt2",
            "n_layer": 2,
            "n_embd": 32,
            "n_head": 2,
            "vocab_size": vocab_size,
            "n_positions": 16,
        },
        "modules_to_wrap": ["gpt2\\.transformer\\.h\\.[0-9]+"],
        "fsdp_config": {},
    }
    callbacks = [{"type": "test::kill_once", "step": KILL_AFTER}] if killed else []
    config = train_config(
        engine="fairscale",
        model=model,
        train_steps=8,
        checkpoint_every=KILL_AFTER,
        callbacks=callbacks,
        engine_extra={"backend": backend},
    )
    config["steps"]["data"] = {
        "type": STEP_NAME,
        "path": str(book),
        "tokenizer": str(tokenizer),
        "block_size": 16,
        "stride": 8,
    }
    # 2 workers x 4 blocks a step: the 8 steps cross an epoch of the shuffled blocks.
    config["steps"]["train"]["train_dataloader"]["batch_size"] = 4
    return config


def test_training_on_the_blocks_resumes_exactly_with_either_backend(
    tokenizer_dir: Path, tok: Any, tmp_path: Path
) -> None:
    book = tmp_path / "book.txt"
    book.write_text(text(50, 12))
    blocks = run_step(path=str(book), tokenizer=str(tokenizer_dir), block_size=16, stride=8)["train"]
    assert 2 * 4 * 3 < len(blocks) < 2 * 4 * 8  # more than the steps before the kill, less than the run

    backends = ("fairscale", "torch")
    plain = {
        b: harness.Train(lm_experiment(book, tokenizer_dir, len(tok), b, False), tmp_path / f"{b}-plain")
        for b in backends
    }
    killed = {
        b: harness.Train(lm_experiment(book, tokenizer_dir, len(tok), b, True), tmp_path / f"{b}-killed")
        for b in backends
    }
    reruns = harness.killed_and_rerun(plain, killed, tmp_path)
    for backend, rerun in reruns.items():
        work_dir = killed[backend].work_dir
        assert (
            f"Recovering from previous run at {work_dir / f'checkpoint_state_step{KILL_AFTER}'}" in rerun.logs
        )
        uninterrupted = torch.load(plain[backend].work_dir / "weights.pt", weights_only=True)
        resumed = torch.load(work_dir / "weights.pt", weights_only=True)
        difference = max_abs_difference(resumed, uninterrupted)
        print(f"[{backend}] tokenized text, max |killed and rerun - uninterrupted|: {difference:.3e}")
        # The same blocks in the same order from the checkpoint on: the same weights, exactly.
        assert difference == 0.0


def test_a_misspelt_option_or_a_value_of_the_wrong_type_is_one_line(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """
    Found by Tango while it constructs the step (patch T8): before, "Extra parameters passed to
    TokenizeText" or "Expected block_size to be int" inside a 38-42-line traceback; now one line
    naming the option, with the nearest one, before any step runs.
    """
    from tango.step import Step

    from tests.helpers import run_tango

    base = {"type": STEP_NAME, "tokenizer": str(tokenizer_dir), "documents": ["w1 w2 w3"]}
    cases = [
        (
            {"block_sise": 8},
            f"ConfigurationError: {STEP_NAME}: block_sise is not one of its options: "
            "did you mean 'block_size'?",
        ),
        (
            {"block_size": "8"},
            f"ConfigurationError: {STEP_NAME}: block_size must be a whole number, got '8' (a str) "
            "(write it without quotes)",
        ),
        (
            {"block_size": 8.5},
            f"ConfigurationError: {STEP_NAME}: block_size must be a whole number, got 8.5 (a float)",
        ),
    ]
    for change, message in cases:
        with pytest.raises(CliRunError) as raised:
            Step.from_params(dict(base, **change))
        assert str(raised.value) == message, str(raised.value)
    # Another package's step keeps Tango's own error.
    with pytest.raises(ConfigurationError, match='Missing key "model" for TorchTrainStep') as raised:
        Step.from_params({"type": "torch::train", "train_stepz": 3})
    assert not isinstance(raised.value, CliRunError)
    # Through the command line: the one line, and nothing ran.
    result = run_tango(
        {"steps": {"data": dict(base, block_size="8")}}, tmp_path / "ws", cwd=tmp_path, check=False
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "Traceback" not in output and cases[1][1] in output, output[-3000:]


# --- Hostile round 5 (issue #44): what Tango hands the step --------------------------------------------


def built_and_run(**options: Any) -> Any:
    """As ``tango run`` does: the step from its config (Tango's FromParams), its id, then ``run``."""
    from tango.step import Step

    step = Step.from_params({"type": STEP_NAME, **options})
    _ = step.unique_id
    return step.run(**step.kwargs)


def test_one_string_of_documents_is_one_document(tokenizer_dir: Path, tok: Any) -> None:
    """
    ``documents`` as one string: Tango's FromParams made it a list of its characters (the option
    was a List[str]), each tokenized as a document of its own, so every block was single
    characters with EOS between them, silently. Now the string is one document.
    """
    book = text(5, 12)
    result = built_and_run(tokenizer=str(tokenizer_dir), documents=book, block_size=4)
    assert result.metadata["splits"]["train"]["documents"] == 1
    assert_blocks(result["train"], windows(ids(tok, book), 4, 4))


def test_options_of_the_wrong_type_or_outside_path_are_one_line(tokenizer_dir: Path, tmp_path: Path) -> None:
    """
    Counts given as fractions, strings or booleans (``true`` was taken as 1), ``null`` where a
    value is needed, a glob that reads another directory's files ("../gpt2/*.json" tokenized
    them), an empty glob or path, and the dataset's options without a dataset: raw TypeErrors or
    quietly accepted before; now one line naming the option, before any text is read.
    """
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(text(40, 8))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "b.txt").write_text(text(41, 8))
    base: Dict[str, Any] = {"tokenizer": str(tokenizer_dir), "documents": [text(42, 8), text(43, 8)]}
    on_path = {"tokenizer": str(tokenizer_dir), "path": str(tmp_path / "text")}
    cases = [
        ({"stride": 2.5}, "stride must be a whole number (or null), got 2.5 (a float)"),
        (
            {"stride": "8"},
            "stride must be a whole number (or null), got '8' (a str) (write it without quotes)",
        ),
        (
            {"validation_fraction": "0.1"},
            "validation_fraction must be a number between 0 and 1 (or null), got '0.1'",
        ),
        ({"validation_count": 2.5}, "validation_count must be a whole number (or null), got 2.5 (a float)"),
        ({"validation_count": True}, "validation_count must be a whole number (or null), got True (a bool)"),
        ({"max_examples": 1.5}, "max_examples must be a whole number (or null), got 1.5 (a float)"),
        ({"max_examples": True}, "max_examples must be a whole number (or null), got True (a bool)"),
        ({"block_size": None}, "block_size must be a whole number, got null"),
        ({"pack": 0}, "pack must be true or false, got 0 (a int)"),
        ({"pack": None}, "pack must be true or false, got null"),
        ({"pack": "false"}, "pack must be true or false, got 'false' (a str)"),
        ({"hash_contents": 1}, "hash_contents must be true or false, got 1 (a int)"),
        (
            {"text_column": "body"},
            "text_column is an option of dataset (a saved Hugging Face dataset), which is not given",
        ),
        (
            {"dataset_split": "test"},
            "dataset_split is an option of dataset (a saved Hugging Face dataset), which is not given",
        ),
        ({"documents": 5}, "documents must be a string (one document) or a list of strings, got 5 (a int)"),
        (
            {**on_path, "glob": "../other/*.txt"},
            "glob '../other/*.txt' climbs out of the directory in path ('..')",
        ),
        (
            {**on_path, "glob": str(tmp_path / "other" / "*.txt")},
            f"glob '{tmp_path / 'other' / '*.txt'}' is absolute: give a pattern relative to the directory",
        ),
        ({**on_path, "glob": ""}, "glob must be a pattern such as '*.txt', got ''"),
        ({**on_path, "path": ""}, "path holds an empty name"),
        ({**on_path, "path": [str(tmp_path / "text"), ""]}, "path holds an empty name"),
    ]
    for change, message in cases:
        options = {**base, **change} if "path" not in change else {"tokenizer": base["tokenizer"], **change}
        with pytest.raises(TextDataError) as raised:
            built_and_run(**options)
        assert str(raised.value).startswith(f"{STEP_NAME}: {message}"), (change, str(raised.value))
        assert "\n" not in str(raised.value)
    # The same options of the right types and places run.
    result = built_and_run(**on_path, glob="*.txt", stride=4, block_size=8, max_examples=3, pack=False)
    assert len(result["train"]) == 3
