"""
Warnings a run printed about nothing its config says, silenced at their source: transformers'
``loss_type=None`` for GPT-2's causal LM (the engine names the loss transformers falls back to).
(setuptools' ``pkg_resources`` deprecation, W3, is checked on a real ``tango run``'s output in
tests/test_signals.py.)
"""

import logging
from typing import List

import pytest
import torch

pytest.importorskip("transformers")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_causal_lm_is_given_the_loss_transformers_would_fall_back_to() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model
    from transformers.utils import logging as hf_logging

    from tango_fairscale.engine import name_causal_lm_loss

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=8)
    torch.manual_seed(0)
    named, unnamed = GPT2LMHeadModel(config), GPT2LMHeadModel(config)
    unnamed.load_state_dict(named.state_dict())
    base = GPT2Model(config)
    # Inside a wrapper, as the engine's model is (Tango's Model, FSDP units).
    name_causal_lm_loss(torch.nn.ModuleList([named, base]))
    assert named.loss_type == "ForCausalLM" and unnamed.loss_type is None
    assert base.loss_type is None  # not a causal LM: its warning could mean a wrong loss

    records = _Records()
    hf_logger = hf_logging.get_logger("transformers.modeling_utils")
    hf_logger.addHandler(records)
    # transformers says it once per process: forget an earlier test's.
    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]
    try:
        tokens = torch.randint(0, 40, (2, 8))
        named.eval()
        unnamed.eval()
        loss = named(input_ids=tokens, labels=tokens).loss
        assert not [m for m in records.messages if "loss_type" in m], records.messages
        # The same loss as transformers' fallback, which warns.
        assert torch.equal(loss, unnamed(input_ids=tokens, labels=tokens).loss)
        assert [m for m in records.messages if "loss_type=None" in m], records.messages
    finally:
        hf_logger.removeHandler(records)
