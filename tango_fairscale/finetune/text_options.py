"""
The options of ``"fairscale::tokenize_text"`` (:mod:`tango_fairscale.finetune.text_data`), checked before
anything is read: their types (Tango's own conversion turns ``true`` into 1), their ranges, and
which of them go together; a mistake is one :class:`TextDataError` line naming the option.
"""

from pathlib import Path
from typing import Any, Optional

from tango.common.exceptions import CliRunError, ConfigurationError

#: The step's registered name.
STEP_NAME = "fairscale::tokenize_text"

#: How the validation text is chosen (``split_by``).
SPLIT_BY = ("documents", "tail")


class TextDataError(ConfigurationError, CliRunError):
    """
    A mistake in the step's options or its text, told in one line that names the option and the
    fix; ``tango run`` prints a ``CliRunError`` as its message alone, without the traceback.
    """


class TextNotFoundError(TextDataError, FileNotFoundError):
    """A file or directory the step was given that is not there."""


def input_name(path: Any, dataset: Optional[str]) -> str:
    if dataset is not None:
        return f"dataset {dataset}"
    return f"path {path}" if path is not None else "documents"


def _wrong_type(name: str, wanted: str, value: Any) -> TextDataError:
    numeric = wanted.startswith(("a whole number", "a number"))
    quoted = " (write it without quotes)" if isinstance(value, str) and numeric else ""
    got = "null" if value is None else f"{value!r} (a {type(value).__name__})"
    return TextDataError(f"{STEP_NAME}: {name} must be {wanted}, got {got}{quoted}")


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_types(
    *,
    block_size: Any,
    stride: Any,
    max_examples: Any,
    validation_count: Any,
    validation_fraction: Any,
    pack: Any,
    add_special_tokens: Any,
    hash_contents: Any,
) -> None:
    """
    The options' types, before their values are compared: a string, a fraction or a boolean in
    a count reached slicing as a raw TypeError, or (``true`` as 1) ran quietly.
    """
    if not _is_whole(block_size):
        raise _wrong_type("block_size", "a whole number", block_size)
    for name, value in (
        ("stride", stride),
        ("max_examples", max_examples),
        ("validation_count", validation_count),
    ):
        if value is not None and not _is_whole(value):
            raise _wrong_type(name, "a whole number (or null)", value)
    if validation_fraction is not None and (
        isinstance(validation_fraction, bool) or not isinstance(validation_fraction, (int, float))
    ):
        raise _wrong_type("validation_fraction", "a number between 0 and 1 (or null)", validation_fraction)
    for name, value in (
        ("pack", pack),
        ("add_special_tokens", add_special_tokens),
        ("hash_contents", hash_contents),
    ):
        if not isinstance(value, bool):
            raise _wrong_type(name, "true or false", value)


def glob_error(glob: Any) -> Optional[str]:
    """Why ``glob`` cannot select files inside a directory of ``path``, or None."""
    if not isinstance(glob, str) or not glob:
        return f"glob must be a pattern such as '*.txt', got {glob!r}"
    pattern = Path(glob)
    if pattern.is_absolute():
        return f"glob {glob!r} is absolute: give a pattern relative to the directory in path, e.g. '*.txt'"
    if ".." in pattern.parts:
        return (
            f"glob {glob!r} climbs out of the directory in path ('..'): give a pattern of the files "
            "inside it (e.g. '**/*.txt'), or add the other directory to path"
        )
    return None


def path_entries_error(path: Any) -> Optional[str]:
    """Why ``path`` is not a file or directory name, or a list of them, or None."""
    entries = [path] if isinstance(path, str) else path
    if not isinstance(entries, (list, tuple)):
        kind = type(path).__name__
        return f"path must be a file or directory name, or a list of them, got {path!r} (a {kind})"
    for entry in entries:
        if not isinstance(entry, str):
            return f"path must name files or directories; it holds {entry!r} (a {type(entry).__name__})"
        if not entry.strip():
            return (
                "path holds an empty name: give a text file or a directory of them ('.' for the current one)"
            )
    return None


def check_text_options(
    *,
    path: Any,
    glob: Any,
    dataset: Any,
    text_column: Any,
    dataset_split: Any,
    documents: Any,
) -> None:
    """Where the text comes from: names that name something, and no option of a source not given."""
    if path is not None:
        error = path_entries_error(path) or glob_error(glob)
        if error is not None:
            raise TextDataError(f"{STEP_NAME}: {error}")
    for name, value, default in (
        ("text_column", text_column, "text"),
        ("dataset_split", dataset_split, "train"),
    ):
        if dataset is None and value != default:
            # Without a dataset it would be ignored: the text read is not the one the user meant.
            # The default passes: Tango puts it in the step's id, so it cannot become None.
            raise TextDataError(
                f"{STEP_NAME}: {name} is an option of dataset (a saved Hugging Face dataset), which is "
                f"not given: remove {name}, or give dataset"
            )
    if documents is not None and not isinstance(documents, (str, list, tuple)):
        raise TextDataError(
            f"{STEP_NAME}: documents must be a string (one document) or a list of strings, got "
            f"{documents!r} (a {type(documents).__name__})"
        )


def check_options(
    *,
    path: Any,
    dataset: Optional[str],
    documents: Any,
    dataset_validation_split: Optional[str],
    block_size: int,
    stride: int,
    max_examples: Optional[int],
    validation_fraction: Optional[float],
    validation_count: Optional[int],
    split_by: str,
) -> None:
    """The options' own rules, before anything is read."""
    given = [
        name
        for name, value in (("path", path), ("dataset", dataset), ("documents", documents))
        if value is not None
    ]
    if len(given) != 1:
        raise TextDataError(
            f"{STEP_NAME}: give exactly one of path, dataset and documents (the text), not "
            f"{' and '.join(given) if given else 'none'}"
        )
    if block_size < 2:
        raise TextDataError(
            f"{STEP_NAME}: block_size is {block_size}; it must be at least 2 (an input token and its target)"
        )
    if not 1 <= stride <= block_size:
        raise TextDataError(
            f"{STEP_NAME}: stride is {stride}; it must be between 1 and block_size ({block_size})"
        )
    if max_examples is not None and max_examples < 1:
        raise TextDataError(f"{STEP_NAME}: max_examples is {max_examples}; it must be at least 1 (or null)")
    if split_by not in SPLIT_BY:
        raise TextDataError(f"{STEP_NAME}: split_by is {split_by!r}; it must be one of {list(SPLIT_BY)}")
    held_out = [
        name
        for name, value in (
            ("validation_fraction", validation_fraction),
            ("validation_count", validation_count),
            ("dataset_validation_split", dataset_validation_split),
        )
        if value is not None
    ]
    if len(held_out) > 1:
        raise TextDataError(
            f"{STEP_NAME}: give at most one of {' and '.join(held_out)} (the validation split)"
        )
    if dataset_validation_split is not None and dataset is None:
        raise TextDataError(f"{STEP_NAME}: dataset_validation_split needs dataset (a saved DatasetDict)")
    if validation_fraction is not None and not 0.0 < validation_fraction < 1.0:
        raise TextDataError(
            f"{STEP_NAME}: validation_fraction is {validation_fraction}; it must be between 0 and 1 "
            "(exclusive), or null for no validation split"
        )
    if validation_count is not None:
        if validation_count < 1:
            raise TextDataError(
                f"{STEP_NAME}: validation_count is {validation_count}; it must be at least 1, or null "
                "for no validation split"
            )
        if split_by == "tail":
            raise TextDataError(
                f'{STEP_NAME}: validation_count counts documents; with split_by: "tail" give '
                "validation_fraction (the share of each document's end)"
            )
