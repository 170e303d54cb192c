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

from tests.conftest import ToyRun
from tests.test_equivalence import CLI_WRAP

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


def test_fairscales_grad_scaler_deprecation_is_silenced_only_there() -> None:
    # W4: FairScale's ShardedGradScaler subclasses torch.cuda.amp.GradScaler, whose constructor
    # torch deprecated: a FutureWarning in every worker of a float16 run, about FairScale's code.
    import warnings

    from fairscale.optim.grad_scaler import ShardedGradScaler

    from tango_fairscale import compat

    deprecated = "torch.cuda.amp.GradScaler(args...)` is deprecated"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.silence_internal_warnings()  # ahead of "always", as install() left them
        ShardedGradScaler(enabled=False)
        assert not [w for w in caught if deprecated in str(w.message)], [str(w.message) for w in caught]
        # The same warning raised from anywhere else is still shown.
        torch.cuda.amp.GradScaler(enabled=False)
        assert [w for w in caught if deprecated in str(w.message)]


@pytest.mark.parametrize("backend", ["fairscale", "torch"])
def test_a_tango_run_on_either_backend_prints_no_warning(backend: str, toy_run: ToyRun) -> None:
    """
    The toy run through the CLI (tests/test_equivalence.py's) says nothing that is a warning: the
    torch backend's collectives called torch's deprecated all-gather and reduce-scatter names, a
    FutureWarning in every worker of every run.
    """
    output = (toy_run("fairscale", CLI_WRAP, backend).parent / "output.txt").read_text()
    warnings = [line for line in output.splitlines() if "Warning" in line or "WARNING" in line]
    assert not warnings, "\n".join(warnings)
