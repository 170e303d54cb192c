"""
docs/failure-modes.md's list "Refused before any worker starts" is run here: each row names a case
of :data:`CASES` (a change to a fine-tuning config), and the line the row quotes must be in the one
line that case is refused with, before any worker starts (pre-flight, Tango's construction of the
package's steps, or the evaluation's own checks, run in this process as ``tango run`` runs them). A
row without a case, or a case without a row, fails the test: the page and the behaviour are one list.
"""

import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from tango.common import Lazy, Params
from tango.common.exceptions import CliRunError
from tango.integrations.torch import Model
from tango.step import Step
from torch import nn

from tango_fairscale.finetune.evaluate import Evaluate
from tango_fairscale.finetune.text_data import TokenizeText
from tests.helpers import REPO, markdown_text
from tests.test_evaluate import GPT2, documents, experiment, gpt2_config, pretrained  # noqa: F401 - a fixture
from tests.test_validation import run_preflight

pytest.importorskip("transformers")

Config = Dict[str, Any]
SECTION = "## Refused before any worker starts"


def _train(config: Config) -> Config:
    return config["steps"]["train"]  # type: ignore[no-any-return]


def _engine(**changes: Any) -> Callable[[Config], None]:
    return lambda config: _train(config)["training_engine"].update(changes)


def _callbacks(*callbacks: Dict[str, Any]) -> Callable[[Config], None]:
    return lambda config: _train(config).update(callbacks=list(callbacks))


def _data(**changes: Any) -> Callable[[Config], None]:
    return lambda config: config["steps"]["data"].update(changes)


def _pretrained(**changes: Any) -> Callable[[Config], None]:
    return lambda config: _train(config)["model"]["model"].update(changes)


def _wrapper(**changes: Any) -> Callable[[Config], None]:
    return lambda config: _train(config)["model"].update(changes)


def _larger_tokenizer(config: Config) -> None:
    directory = Path(config["steps"]["data"]["tokenizer"]).parent / "larger-tokenizer"
    if not directory.exists():
        from tests.test_evaluate import _tokenizer

        _tokenizer(GPT2["vocab_size"] * 4, directory)
    far = " ".join(f"w{GPT2['vocab_size'] + i}" for i in range(40))
    config["steps"]["data"].update(tokenizer=str(directory), documents=documents() + [far])


@Model.register("test::replaces_weights", exist_ok=True)
class ReplacesWeights(Model):
    """A small LM whose constructor sets its head's values in one of the ways ``how`` names."""

    def __init__(self, how: str = "copy") -> None:
        super().__init__()
        self.embed = nn.Embedding(GPT2["vocab_size"], 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, GPT2["vocab_size"])
        values = torch.full((GPT2["vocab_size"], 8), 0.01)
        if how == "data":
            self.head.weight.data = values
        elif how == "set":
            with torch.no_grad():
                self.head.weight.set_(values)
        elif how == "spectral_norm":
            self.head = nn.utils.spectral_norm(self.head)
        elif how == "value_from_weight":
            self.scale = float(self.head.weight.detach().abs().max())
        elif how == "lazy":
            self.head = nn.Sequential(nn.LazyLinear(GPT2["vocab_size"]))
        elif how == "random_value":
            # Not from a weight: the workers' build (parameters on meta, nothing else) draws it.
            self.scale = float(torch.rand(()))
        elif how == "buffer_from_weight":
            self.register_buffer("scale", self.head.weight.detach().norm(dim=1).clone())
        else:
            with torch.no_grad():
                self.head.weight.copy_(values)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **_: Any) -> Dict[str, torch.Tensor]:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = torch.relu(block(hidden))
        logits = self.head(hidden)
        return {
            "loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        }


def _own_model(how: str) -> Callable[[Config], None]:
    def change(config: Config) -> None:
        _train(config)["model"] = {
            "type": "fairscale::with_wrapped_modules",
            "model": {"type": "test::replaces_weights", "how": how},
            "modules_to_wrap": ["blocks\\.[0-9]+"],
        }

    return change


def _lora(config: Config, r: Any = 4, nested: bool = False) -> None:
    model = _train(config)["model"]
    lora = {"type": "fairscale::with_lora", "model": model["model"], "r": r, "target_modules": ["c_attn"]}
    if nested:
        lora = {"type": "fairscale::with_lora", "model": lora, "r": 4, "target_modules": ["c_fc"]}
    model["model"] = lora


#: How a case is run: "train" (the training step's pre-flight), "data" (Tango constructing the data
#: step), "evaluate" (``fairscale::evaluate`` on the data, with the evaluation's options).
CASES: Dict[str, Tuple[str, Any]] = {
    "optimizer-misspelt": ("train", lambda c: _train(c)["training_engine"].update(optimiser={})),
    "threads-beyond-cores": ("train", _engine(cpu_threads_per_worker=10000)),
    "export-read-only": ("train", _engine(export_hf="/sys/tango-fairscale-export/hf")),
    "overrides-type": ("train", _pretrained(config_overrides={"n_embd": "big"})),
    "peak-zero": ("train", _callbacks({"type": "fairscale::metrics", "peak_tflops": 0})),
    "peak-huge": ("train", _callbacks({"type": "fairscale::metrics", "peak_tflops": 1e308})),
    "callback-option-misspelt": ("train", _callbacks({"type": "fairscale::tensorboard", "logdir": "tb"})),
    "wrap-container": ("train", _wrapper(modules_to_wrap=["transformer\\.h"])),
    "tokens-past-vocabulary": ("train", _larger_tokenizer),
    "blocks-past-positions": ("train", _data(block_size=2 * GPT2["n_positions"])),
    "block-size-string": ("data", _data(block_size="8")),
    "block-size-fraction": ("data", _data(block_size=8.5)),
    "data-option-misspelt": ("data", lambda c: c["steps"]["data"].update(block_sise=8)),
    "meta-weight-data": ("train", _own_model("data")),
    "meta-weight-set": ("train", _own_model("set")),
    "meta-spectral-norm": ("train", _own_model("spectral_norm")),
    "meta-value-from-weight": ("train", _own_model("value_from_weight")),
    "meta-buffer-from-weight": ("train", _own_model("buffer_from_weight")),
    "meta-lazy-module": ("train", _own_model("lazy")),
    "lora-rank-fraction": ("train", lambda c: _lora(c, r=2.5)),
    "lora-on-lora": ("train", lambda c: _lora(c, nested=True)),
    "merged-without-lora": (
        "train",
        _engine(export_hf="/tmp/tango-fairscale-hf", export_hf_merged="/tmp/tango-fairscale-merged"),
    ),
    "evaluate-split-missing": ("evaluate", {"split": "test"}),
    "evaluate-model-missing": ("evaluate", {"pretrained_model_name_or_path": "/nonexistent/model"}),
    "evaluate-tokens-past-vocabulary": ("evaluate", {"split": "train", "data": _larger_tokenizer}),
}


def documented() -> List[Tuple[str, str]]:
    """The section's rows: (case, the line quoted), in the page's order."""
    text = markdown_text("docs/failure-modes.md")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`([a-z-]+)`", cells[0]) if len(cells) == 3 else None
        if match:
            quoted = re.fullmatch(r"`(.+)`", cells[2])
            assert quoted, f"the line of {match[1]} is not quoted as code: {cells[2]}"
            rows.append((match[1], quoted[1]))
    return rows


def test_every_case_has_its_row() -> None:
    rows = [case for case, _ in documented()]
    assert len(rows) == len(set(rows)), rows
    assert set(rows) == set(CASES), (sorted(set(rows) - set(CASES)), sorted(set(CASES) - set(rows)))
    assert f"lists {len(rows)} cases" in (REPO / "docs" / "failure-modes.md").read_text()


def _refusal(kind: str, change: Any, pretrained: Path) -> str:  # noqa: F811 - the fixture's value
    config = experiment(pretrained)
    if kind == "evaluate":
        # The evaluation's options, the model's path, and a change to the data.
        model_config = gpt2_config(pretrained, wrapped=False)
        model_config.update({k: v for k, v in change.items() if k == "pretrained_model_name_or_path"})
        options = {k: v for k, v in change.items() if k not in ("pretrained_model_name_or_path", "data")}
        change.get("data", lambda config: None)(config)
    else:
        change(config)
        model_config, options = gpt2_config(pretrained, wrapped=False), {}
    with pytest.raises(CliRunError) as raised:
        if kind == "train":
            run_preflight(config)
        elif kind == "data":
            Step.from_params(dict(config["steps"]["data"]))
        else:
            data = TokenizeText().run(**{k: v for k, v in config["steps"]["data"].items() if k != "type"})  # type: ignore[call-arg]
            Evaluate().run(model=Lazy(Model, Params(model_config)), dataset_dict=data, **options)
    return str(raised.value)


@pytest.mark.parametrize("case, line", documented(), ids=[case for case, _ in documented()])
def test_each_documented_refusal_is_the_line_it_quotes(case: str, line: str, pretrained: Path) -> None:  # noqa: F811
    kind, change = CASES[case]
    message = _refusal(kind, change, pretrained)
    assert "\n" not in message, message
    assert line in message, f"{case}: {message}"


def test_a_constructor_that_draws_a_number_is_not_refused(pretrained: Path) -> None:  # noqa: F811
    """
    Pre-flight's first build puts every tensor on meta, so ``float(torch.rand(()))`` fails there;
    the workers' build under init_on_meta puts only the parameters there and draws it. Pre-flight
    judges by the workers' build: refused only what they cannot build.
    """
    config = experiment(pretrained)
    _own_model("random_value")(config)
    run_preflight(config)
