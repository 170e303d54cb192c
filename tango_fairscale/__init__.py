"""
tango-fairscale: FairScale's Fully Sharded Data Parallel (ZeRO-3) for AI2 Tango's
``torch::train`` step, on GPUs and on CPU workers.

Importing this package registers:

- :class:`FairScaleTrainingEngine` as the training engine ``"fairscale"``;
- :func:`with_wrapped_modules` as the model constructor ``"fairscale::with_wrapped_modules"``;
- :func:`from_pretrained` as the model constructor ``"fairscale::from_pretrained"`` (a pretrained
  ``transformers`` model, read unit by unit under ``init_on_meta``);
- :func:`with_lora` as the model constructor ``"fairscale::with_lora"`` (peft's LoRA adapters on a
  model, from :class:`LoraOptions`);
- the callbacks ``"fairscale::metrics"``, ``"fairscale::memory"``, ``"fairscale::wandb"``,
  ``"fairscale::tensorboard"`` and ``"fairscale::profile"``;
- :class:`TokenizeText` as the step ``"fairscale::tokenize_text"`` (text tokenized into blocks
  for a causal language model);
- :class:`ValidateFirst` as the callback ``"fairscale::validate_first"`` (the validation loss
  before the first step) and :class:`Evaluate` as the step ``"fairscale::evaluate"`` (a language
  model's loss and perplexity on a split).

Use it with ``tango run config.jsonnet -i tango_fairscale``, or list ``tango_fairscale``
under ``include_package`` in ``tango.yml``.
"""

from . import checkpointing, compat, launch, train_step
from .config import FSDPConfig
from .engine import FairScaleTrainingEngine
from .errors import CheckpointError, WrapConfigurationError
from .finetune.evaluate import Evaluate
from .finetune.lora import LoraOptions, with_lora
from .finetune.pretrained import from_pretrained, load_on_meta
from .finetune.text_data import TokenBlocks, TokenizeText
from .finetune.validate_first import ValidateFirst
from .materialize import building_on_meta
from .results import TrainOutputs, read_checkpoint, read_weights, train_outputs
from .step_config import step_config_error
from .telemetry.callbacks import MemoryCallback, RestoreRandomState
from .telemetry.loggers import ProfileCallback, TensorBoardLogger, WandbLogger
from .telemetry.metrics import MetricsLog
from .version import VERSION as __version__
from .wrapping import WrapPlan, plan_wrapping, with_wrapped_modules

# Every change to FairScale, Tango and torch is made by tango_fairscale.compat, and only when
# asked: this installs what every process needs, routing Tango's step and worker functions to
# the step's logic (tango_fairscale.train_step).
compat.install(train_step.run_step, train_step.run_worker, step_config_error)
# ... and, when transformers or Tango's transformers integration is imported, makes that
# integration import on the transformers we install (H1) and routes transformers' from_pretrained
# under init_on_meta to the same unit-by-unit reading as fairscale::from_pretrained (H2).
compat.install_transformers_patches(building_on_meta, load_on_meta)
# One host of a launch across hosts, in `tango run`: present to the other hosts from now to this
# process's exit, so that a run that ends before the training step is seen there at once.
launch.start_in_tango_run()
# SIGINT or SIGTERM to `tango run`, alone or with its process group, ends it with one line and
# exit status 130 or 143 wherever it lands (a training step stops its workers first).
if launch.in_tango_run():
    launch.stop_run_on_signals()

__all__ = [
    "CheckpointError",
    "Evaluate",
    "FSDPConfig",
    "FairScaleTrainingEngine",
    "MemoryCallback",
    "MetricsLog",
    "LoraOptions",
    "ProfileCallback",
    "RestoreRandomState",
    "TensorBoardLogger",
    "TokenBlocks",
    "TokenizeText",
    "TrainOutputs",
    "ValidateFirst",
    "WandbLogger",
    "WrapConfigurationError",
    "WrapPlan",
    "__version__",
    "checkpointing",
    "from_pretrained",
    "plan_wrapping",
    "read_checkpoint",
    "read_weights",
    "train_outputs",
    "with_lora",
    "with_wrapped_modules",
]
