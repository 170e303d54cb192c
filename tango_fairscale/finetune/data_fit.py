"""
Does the data fit the model? Token ids below the model's vocabulary, examples no longer than its
learned position table: checked before any worker starts, where a mismatch was an
``IndexError: index out of range in self`` from every worker's first forward (a tokenizer of
another model, ``block_size`` above ``n_positions``).
"""

import logging
from typing import Any, Iterable, Optional, Tuple

from tango.common.exceptions import ConfigurationError
from torch import nn

__all__ = ["check_data_fits_model", "token_range"]

logger = logging.getLogger(__name__)

#: Examples read from a split that is neither this package's ``TokenBlocks`` nor a Hugging Face
#: ``Dataset`` (whose columns are scanned whole, in C++): its first ones.
SCANNED_EXAMPLES = 10_000


def token_range(split: Any) -> Optional[Tuple[int, int]]:
    """The largest token id in ``split``'s ``input_ids`` and its longest example; ``None`` where unknown."""
    tokens = getattr(split, "tokens", None)
    block_size = getattr(split, "block_size", None)
    if tokens is not None and isinstance(block_size, int):  # TokenBlocks
        largest = int(tokens.max()) if tokens.numel() else -1
        pad = getattr(split, "pad_token_id", None)
        if getattr(split, "lengths", None) is not None and isinstance(pad, int):
            largest = max(largest, pad)
        return largest, block_size
    table = getattr(split, "data", None)
    column_names = getattr(split, "column_names", None)
    if table is not None and isinstance(column_names, list):  # a datasets.Dataset
        if "input_ids" not in column_names or len(split) == 0:
            return None
        import pyarrow.compute as pc

        column = table.column("input_ids")
        largest = pc.max(pc.list_flatten(column)).as_py()
        longest = pc.max(pc.list_value_length(column)).as_py()
        return (-1 if largest is None else int(largest)), int(longest or 0)
    return _scan(split)


def _scan(split: Any) -> Optional[Tuple[int, int]]:
    try:
        count = min(len(split), SCANNED_EXAMPLES)
    except TypeError:
        return None
    largest, longest = -1, 0
    for index in range(count):
        example = split[index]
        ids = example.get("input_ids") if isinstance(example, dict) else None
        if ids is None:
            return None
        values = list(ids.reshape(-1).tolist()) if hasattr(ids, "reshape") else list(_flat(ids))
        if values:
            largest = max(largest, max(int(v) for v in values))
        longest = max(longest, len(ids) if not hasattr(ids, "shape") else int(ids.shape[-1]))
    return largest, longest


def _flat(values: Iterable[Any]) -> Iterable[Any]:
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _flat(value)
        else:
            yield value


def _learned_positions(model: nn.Module) -> Optional[Tuple[str, int]]:
    """The learned position table of a ``transformers`` model (GPT-2's ``wpe``), its name and rows."""
    config = getattr(model, "config", None)
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, nn.Embedding) and ("pos" in leaf or leaf == "wpe"):
            return name, limit
    return None


def check_data_fits_model(
    hf_model: Optional[nn.Module], splits: Iterable[Tuple[str, Any]], field: str
) -> None:
    """
    Refuse, in one line naming the split, data whose token ids reach past ``hf_model``'s
    vocabulary or whose examples are longer than its learned position table. ``field`` names
    where the data comes from in the config (``dataset_dict``).
    """
    if hf_model is None:
        return
    get_embeddings = getattr(hf_model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    vocabulary = getattr(embeddings, "num_embeddings", None)
    positions = _learned_positions(hf_model)
    model_name = type(hf_model).__name__
    for name, split in splits:
        found = token_range(split)
        if found is None:
            continue
        largest, longest = found
        if isinstance(vocabulary, int) and largest >= vocabulary:
            raise ConfigurationError(
                f"{field}: split {name!r} holds token id {largest}, but the model ({model_name}) has "
                f"{vocabulary} rows in its input embedding (ids 0 to {vocabulary - 1}): the data was "
                "tokenized with another model's tokenizer. Tokenize it with the model's own (the "
                "tokenizer option of fairscale::tokenize_text), or resize the model's embeddings"
            )
        if positions is not None and longest > positions[1]:
            raise ConfigurationError(
                f"{field}: split {name!r} has examples of {longest} tokens, but the model ({model_name}) "
                f"has {positions[1]} learned positions ({positions[0]}): lower block_size to "
                f"{positions[1]} or less"
            )
