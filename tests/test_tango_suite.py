"""
The scenario of ai2-tango's own FairScale integration test, run on 2 CPU workers through the
real ``tango`` command line: the 8 combinations of

- ``fsdp``: the ``"fairscale"`` engine with ``reshard_after_forward`` and ``mixed_precision``
  equal to ``amp`` on both the engine and the wrapped units, or Tango's ``"torch"`` engine with
  the same ``fairscale::with_wrapped_modules`` model and no FSDP config;
- ``ckpt``: activation checkpointing of the wrapped units on or off;
- ``amp``: automatic mixed precision on or off (bfloat16, as on any CPU worker),

on a three-block regressor of four features (``tests/tango_suite/components.py``), every block
its own unit. All 8 are steps of one experiment, run by one ``tango run -i tango_fairscale``
(one start-up instead of 8; make test runs two of them, make test-all all 8). A second run
trains a third case with the plugin loaded only by a plain ``import tango_fairscale`` in the
process that calls Tango's CLI (``tests/tango_suite/plain_import.py``), so that the workers must
find the plugin by themselves.

Each case checks its own step: it finished, its ``weights.pt`` loads with ``strict=True`` into
the plain model, and those weights fit the training data better than the model Tango started
from.
"""

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
from tango.integrations.torch.util import set_seed_all

from tests.helpers import tango_command, tango_env
from tests.tango_suite.components import SuiteRegressor, make_data

COMPONENTS = "tests.tango_suite.components"
SEED = 42  # torch::train's default seed, which Tango sets before building the model
TRAIN_STEPS = 12


@dataclass(frozen=True)
class Case:
    fsdp: bool
    ckpt: bool
    amp: bool

    @property
    def name(self) -> str:
        return "-".join(
            [
                "fsdp" if self.fsdp else "torch",
                "ckpt" if self.ckpt else "nockpt",
                "amp" if self.amp else "fp32",
            ]
        )


CASES = [Case(fsdp, ckpt, amp) for fsdp in (True, False) for ckpt in (True, False) for amp in (True, False)]


def train_step(case: Case) -> Dict[str, Any]:
    """One ``torch::train`` step of the suite: batches of 2 per worker, validation on ``dev``."""
    fsdp_config: Optional[Dict[str, Any]] = (
        {"reshard_after_forward": True, "mixed_precision": case.amp} if case.fsdp else None
    )
    engine: Dict[str, Any] = {
        "type": "fairscale" if case.fsdp else "torch",
        "amp": case.amp,
        "optimizer": {"type": "torch::AdamW", "lr": 0.05, "betas": [0.9, 0.95], "eps": 1e-6},
    }
    if fsdp_config is not None:
        engine["fsdp_config"] = fsdp_config
    return {
        "type": "torch::train",
        "model": {
            "type": "fairscale::with_wrapped_modules",
            "model": {"type": "tango_suite::regressor"},
            "modules_to_wrap": ["blocks\\.[0-9]+"],
            "fsdp_config": fsdp_config,
            "activation_checkpointing": case.ckpt,
        },
        "training_engine": engine,
        "dataset_dict": {"type": "ref", "ref": "data"},
        "train_dataloader": {
            "batch_size": 2,
            "sampler": {"type": "torch::DistributedSampler", "shuffle": True, "drop_last": True},
        },
        "validation_split": "dev",
        "validation_dataloader": {
            "batch_size": 2,
            "sampler": {"type": "torch::DistributedSampler", "shuffle": False, "drop_last": True},
        },
        "train_steps": TRAIN_STEPS,
        "validate_every": TRAIN_STEPS,
        "validation_steps": 2,
        "checkpoint_every": TRAIN_STEPS,
        "log_every": 1,
        "device_count": 2,
        "seed": SEED,
        "callbacks": [{"type": "tango_suite::record_losses"}],
    }


@dataclass
class SuiteRun:
    workspace: Path
    returncode: int
    output: str  # stdout and stderr together, in order

    def work_dirs(self) -> Dict[str, Path]:
        """Each training step's work directory, by step name (from the loss records)."""
        found: Dict[str, Path] = {}
        for record in self.workspace.glob("cache/TorchTrainStep-*/work/suite_losses.json"):
            found[json.loads(record.read_text())["step_name"]] = record.parent
        return found

    def errors(self, step: Optional[str] = None) -> List[str]:
        """
        The distinct last lines of the tracebacks in the output (a worker's included), of one
        step (the output between its start and its failure) or of the whole run.
        """
        text = self.output
        if step is not None:
            end = text.find(f'\u2717 Step "{step}" failed')
            if end < 0:
                return []
            text = text[text.rfind(f'\u25cf Starting step "{step}"', 0, end) : end]
        lines = re.findall(r"^[\w.]*(?:Error|Exception): .+$", text, re.MULTILINE)
        return list(dict.fromkeys(line.strip() for line in lines))


def run_suite(root: Path, cases: List[Case], plain_import: bool) -> SuiteRun:
    """One ``tango run`` of ``cases``, each a step of its own, with the plugin loaded by ``-i``
    or by a plain import in the process that calls Tango's CLI."""
    config = {
        "steps": {"data": {"type": "tango_suite::data"}, **{case.name: train_step(case) for case in cases}}
    }
    workspace, cwd = root / "ws", root / "cwd"
    if plain_import:
        command = tango_command(config, workspace, cwd, includes=[COMPONENTS])
        command = [sys.executable, "-m", "tests.tango_suite.plain_import", *command[1:]]
    else:
        command = tango_command(config, workspace, cwd, includes=["tango_fairscale", COMPONENTS])
    result = subprocess.run(
        command,
        cwd=cwd,
        env=tango_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=480,
    )
    return SuiteRun(workspace, result.returncode, result.stdout)


# With the plugin loaded by a plain import, one case: the FSDP engine and the wrapper, both needed
# inside the workers (each step costs several seconds of worker start-up).
PLAIN_IMPORT_CASES = [Case(fsdp=True, ckpt=False, amp=False)]
# make test runs three of the 8, two here and the plain import's (every option on and off at least
# once, both engines); the run of all 8 (60 s) is extended.
INCLUDE_CASES = [
    Case(fsdp=True, ckpt=True, amp=True),
    Case(fsdp=False, ckpt=True, amp=False),
]
VARIANTS = {"include": INCLUDE_CASES, "include_all": CASES, "plain_import": PLAIN_IMPORT_CASES}
EXTENDED_VARIANTS = {"include_all"}


def variant_param(variant: str, *values: Any, id: str) -> Any:
    marks = [pytest.mark.extended] if variant in EXTENDED_VARIANTS else []
    return pytest.param(variant, *values, id=id, marks=marks)


@pytest.fixture(scope="module")
def include_run(tmp_path_factory: pytest.TempPathFactory) -> SuiteRun:
    return run_suite(tmp_path_factory.mktemp("suite_include"), INCLUDE_CASES, plain_import=False)


@pytest.fixture(scope="module")
def include_all_run(tmp_path_factory: pytest.TempPathFactory) -> SuiteRun:
    return run_suite(tmp_path_factory.mktemp("suite_include_all"), CASES, plain_import=False)


@pytest.fixture(scope="module")
def plain_import_run(tmp_path_factory: pytest.TempPathFactory) -> SuiteRun:
    return run_suite(tmp_path_factory.mktemp("suite_plain_import"), PLAIN_IMPORT_CASES, plain_import=True)


def full_train_loss(model: SuiteRegressor) -> float:
    train = make_data()["train"]
    with torch.no_grad():
        return model(
            torch.stack([example["x"] for example in train]), torch.stack([example["y"] for example in train])
        )["loss"].item()


@pytest.mark.parametrize("variant", [variant_param(variant, id=variant) for variant in VARIANTS])
def test_run_exits_zero(variant: str, request: pytest.FixtureRequest) -> None:
    run: SuiteRun = request.getfixturevalue(f"{variant}_run")
    returncode = run.returncode
    errors = "\n".join(run.errors())
    assert returncode == 0, (
        f"tango run exited with {returncode}; errors:\n{errors}\n--- output tail ---\n{run.output[-3000:]}"
    )


@pytest.mark.parametrize(
    "variant, case",
    [
        variant_param(variant, case, id=f"{variant}-{case.name}")
        for variant, cases in VARIANTS.items()
        for case in cases
    ],
)
def test_case_trains(variant: str, case: Case, request: pytest.FixtureRequest) -> None:
    run: SuiteRun = request.getfixturevalue(f"{variant}_run")
    work_dir = run.work_dirs().get(case.name)
    weights_path = work_dir / "weights.pt" if work_dir is not None else None
    finished = weights_path is not None and weights_path.is_file()
    errors = "\n".join(run.errors(case.name))
    assert finished, f"step {case.name!r} wrote no weights.pt; its errors:\n{errors}"
    assert work_dir is not None and weights_path is not None

    record = json.loads((work_dir / "suite_losses.json").read_text())
    losses = [record["losses"][str(step)] for step in range(TRAIN_STEPS)]
    assert all(torch.isfinite(torch.tensor(losses))), losses

    weights = torch.load(weights_path, map_location="cpu", weights_only=True)
    trained = SuiteRegressor()
    trained.load_state_dict(weights, strict=True)

    set_seed_all(SEED)
    initial = SuiteRegressor()
    before, after = full_train_loss(initial), full_train_loss(trained)
    print(f"[{variant} {case.name}] training loss {before:.3f} -> {after:.3f}")
    assert after < 0.9 * before, f"training loss {before:.3f} -> {after:.3f}; batch losses {losses}"
