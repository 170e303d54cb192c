"""
LoRA adapters on a pretrained model, from a config: :class:`LoraOptions` (peft's ``LoraConfig``
fields that a fine-tune sets) and the model constructor ``"fairscale::with_lora"``, which puts
peft's adapters on any model constructor's result, typically ``"fairscale::from_pretrained"``:

.. code-block:: jsonnet

    model: {
      type: "fairscale::with_wrapped_modules",
      model: {
        type: "fairscale::with_lora",
        model: { type: "fairscale::from_pretrained", pretrained_model_name_or_path: "/models/llama" },
        r: 8,
        target_modules: ["q_proj", "v_proj"],
      },
      wrap_module_classes: ["LlamaDecoderLayer"],
      fsdp_config: {},
    }

The result is peft's ``PeftModel``, as a user's own constructor calling ``get_peft_model`` would
return: either backend shards it with frozen and trainable parameters in one unit, and under
``init_on_meta`` the base is read from its files while the adapters keep peft's initialisation.
``peft`` is the optional extra ``lora`` (``pip install 'tango-fairscale[lora]'``); it is imported
only when a model uses it.
"""

import dataclasses
import difflib
import json
import math
import re
import sys
import warnings
from typing import Any, Dict, List, Optional, Union

import torch.nn as nn
from tango.common import FromParams
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import Model

from ..registry import register_model_constructor
from ..wrapping import recorded_plan

#: The registered name of :func:`with_lora`.
LORA_TYPE = "fairscale::with_lora"

_BIAS = ("none", "all", "lora_only")


@dataclasses.dataclass
class LoraOptions(FromParams):
    """The options of peft's ``LoraConfig`` a fine-tune sets, with peft's meaning and defaults."""

    r: int = 8
    """The rank of each adapter: ``lora_A`` maps the layer's input to ``r`` features, ``lora_B`` back."""

    lora_alpha: Optional[float] = None
    """The adapters' output is scaled by ``lora_alpha / r``. Default: ``2 * r``."""

    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training (peft's default, 0, keeps runs deterministic)."""

    target_modules: Optional[Union[str, List[str]]] = None
    """
    The modules that get adapters: names (a module matches when its name ends with one) or, as a
    single string, a regex fully matched against module names. Default: peft's choice for the
    model's architecture (for Llama ``q_proj`` and ``v_proj``).
    """

    # A string too, so that a config's string reaches the check below (Tango would make a list of
    # its characters for a list annotation).
    modules_to_save: Optional[Union[str, List[str]]] = None
    """Modules trained in full beside the adapters (e.g. a new classification head)."""

    bias: str = "none"
    """Which biases train: ``"none"``, ``"all"`` or ``"lora_only"`` (those of adapted layers)."""

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigurationError(f"{LORA_TYPE}.r: must be a positive integer, got {self.r!r}.")
        # Infinite too: it scaled every adapter's output to inf, and training went on in NaN.
        if self.lora_alpha is not None and not (
            _is_number(self.lora_alpha) and 0 < self.lora_alpha < math.inf
        ):
            raise ConfigurationError(
                f"{LORA_TYPE}.lora_alpha: must be a finite number > 0, got {self.lora_alpha!r}."
            )
        if not (_is_number(self.lora_dropout) and 0.0 <= self.lora_dropout < 1.0):
            raise ConfigurationError(
                f"{LORA_TYPE}.lora_dropout: must be in [0, 1), got {self.lora_dropout!r}."
            )
        if self.bias not in _BIAS:
            raise ConfigurationError(f"{LORA_TYPE}.bias: must be one of {list(_BIAS)}, got {self.bias!r}.")
        if isinstance(self.target_modules, str):
            try:
                re.compile(self.target_modules)
            except re.error as error:
                raise ConfigurationError(
                    f"{LORA_TYPE}.target_modules: {self.target_modules!r} is not a valid regular "
                    f"expression ({error})."
                ) from None
        # peft takes target_modules as a string (a regex), not modules_to_save.
        if isinstance(self.modules_to_save, str):
            raise ConfigurationError(
                f"{LORA_TYPE}.modules_to_save: expected a list of module names, got the string "
                f"{self.modules_to_save!r}: write [{self.modules_to_save!r}]."
            )

    def peft_config(self) -> Any:
        """These options as peft's ``LoraConfig``."""
        from peft import LoraConfig

        kwargs: Dict[str, Any] = {
            "r": self.r,
            "lora_alpha": self.lora_alpha if self.lora_alpha is not None else 2 * self.r,
            "lora_dropout": self.lora_dropout,
            "bias": self.bias,
        }
        if self.target_modules is not None:
            kwargs["target_modules"] = self.target_modules
        if self.modules_to_save is not None:
            kwargs["modules_to_save"] = self.modules_to_save
        return LoraConfig(**kwargs)


def _import_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigurationError(
            f"{LORA_TYPE} needs peft: pip install 'tango-fairscale[lora]' (or 'peft>=0.21,<0.22')."
        ) from None


@register_model_constructor(LORA_TYPE)
def with_lora(
    model: Model,
    r: int = 8,
    lora_alpha: Optional[float] = None,
    lora_dropout: float = 0.0,
    target_modules: Optional[Union[str, List[str]]] = None,
    modules_to_save: Optional[Union[str, List[str]]] = None,
    bias: str = "none",
) -> Model:
    """
    ``model`` with peft's LoRA adapters (see :class:`LoraOptions` for the options): peft's
    ``get_peft_model``, so the base's parameters are frozen and the adapters (and
    ``modules_to_save``) train.

    .. tip::
        Registered as a :class:`~tango.integrations.torch.Model` constructor under the name
        "fairscale::with_lora".
    """
    options = LoraOptions(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=target_modules,
        modules_to_save=modules_to_save,
        bias=bias,
    )
    _import_peft()
    from peft import get_peft_model

    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"{LORA_TYPE}.model: expected a torch module, got {type(model).__name__}.")
    if hasattr(model, "peft_config"):
        # peft only warns ("Already found a peft_config attribute"); the run trained and its export
        # failed in a 111-line traceback.
        raise ConfigurationError(
            f"{LORA_TYPE}.model: it has adapters already ({type(model).__name__} with a peft_config): give "
            "the model under them, with every target module in one fairscale::with_lora."
        )
    if recorded_plan(model) is not None:
        # peft's wrapper hides the plan recorded on the model under it: the run trained the whole
        # model as one unit, without a word.
        raise ConfigurationError(
            f"{LORA_TYPE}.model: it is a fairscale::with_wrapped_modules model, whose wrap plan the "
            f"adapters would hide (the run would train one unit). Put {LORA_TYPE} inside "
            "fairscale::with_wrapped_modules: with_wrapped_modules { model: with_lora { model: ... } }."
        )
    _check_modules_to_save(model, options.modules_to_save)
    try:
        with warnings.catch_warnings():
            # peft switches fan_in_fan_out on itself for transformers' Conv1D layers (GPT-2's),
            # as they need, and says so once per process: the main process's pre-flight build
            # and every worker's. The option is peft's, not one of this constructor's.
            warnings.filterwarnings("ignore", message=_CONV1D_FAN_IN_FAN_OUT, category=UserWarning)
            return get_peft_model(model, options.peft_config())  # type: ignore[no-any-return]
    except ValueError as error:
        # peft's own words for a target_modules that matches nothing, one line, and the names
        # that would match.
        message = str(error).splitlines()[0]
        unsupported = re.match(r"Target module (\w+)\(", message)
        if unsupported is not None:
            # peft's message is the whole module printed over many lines, then what it supports.
            message = (
                f"target_modules {target_modules!r} matches a {unsupported.group(1)}, which LoRA cannot "
                "adapt (it adapts linear, embedding and convolution layers). The model's layers that can "
                f"take adapters are named: {', '.join(adaptable_names(model))}."
            )
        elif "target modules" in message.lower():
            how = (
                "a regex, it must match a module's whole dotted name (e.g. transformer.h.0.attn.c_attn)"
                if isinstance(target_modules, str)
                else "a name in the list matches the end of a module's dotted name"
            )
            message += (
                f" The model's layers that can take adapters are named: {', '.join(adaptable_names(model))} "
                f"(target_modules as {how})."
            )
        raise ConfigurationError(f"{LORA_TYPE}: {message}") from None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_modules_to_save(model: nn.Module, modules_to_save: Optional[Union[str, List[str]]]) -> None:
    """
    Each name of ``modules_to_save`` must be a module of ``model`` as peft matches it (the end of a
    module's dotted name): peft ignores one that matches nothing, and the module it was meant
    for stayed frozen.
    """
    names = [name for name, _ in model.named_modules() if name]
    # A string was refused by LoraOptions already (it is a list of names here).
    for wanted in [] if isinstance(modules_to_save, str) else modules_to_save or []:
        if not isinstance(wanted, str) or not any(n == wanted or n.endswith("." + wanted) for n in names):
            ends = sorted({name.rsplit(".", 1)[-1] for name in names})
            near = difflib.get_close_matches(str(wanted), ends, n=3)
            hint = f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""
            raise ConfigurationError(
                f"{LORA_TYPE}.modules_to_save: {wanted!r} names no module of {type(model).__name__} "
                f"(it must be the end of a module's dotted name, e.g. 'lm_head').{hint}"
            )


#: The start of peft's warning that it sets ``fan_in_fan_out`` for a ``Conv1D`` target.
_CONV1D_FAN_IN_FAN_OUT = "fan_in_fan_out is set to False but the target module is `Conv1D`"


def adaptable_names(model: nn.Module) -> List[str]:
    """
    The last parts of the names of ``model``'s modules that peft's LoRA adapts (leaf modules with
    a weight of two or more dimensions: linear, embedding, convolution and transformers'
    ``Conv1D`` layers), sorted, once each.
    """
    names = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name and not any(True for _ in module.children()) and isinstance(weight, nn.Parameter):
            if weight.dim() >= 2:
                names.add(name.rpartition(".")[2])
    return sorted(names)


def peft_model_in(model: nn.Module) -> Optional[Any]:
    """The outermost peft ``PeftModel`` inside ``model`` (wrapped or not), if there is one."""
    if "peft" not in sys.modules:  # a model holding one has imported it
        return None
    from peft import PeftModel

    for module in model.modules():
        if isinstance(module, PeftModel):
            return module
    return None


#: The peft methods (``peft_type``) trained, checkpointed, exported and loaded back end to end.
SUPPORTED_PEFT_TYPES = ("LORA",)


def check_peft_method(model: nn.Module) -> None:
    """
    Refuse a peft model of another method than LoRA, naming it: the checkpoints, the adapter
    export and its merge know LoRA's tensors only (IA3's or LoHa's trained, then their export
    found no adapter; prefix and prompt tuning failed in the export, VeRA under ``init_on_meta``
    in the first forward).
    """
    peft_model = peft_model_in(model)
    if peft_model is None:
        return
    for name, config in peft_model.peft_config.items():
        kind = str(getattr(config.peft_type, "value", config.peft_type))
        if kind not in SUPPORTED_PEFT_TYPES:
            raise ConfigurationError(
                f"model: its peft adapter {name!r} is peft's {kind} ({type(config).__name__}), which "
                f"tango-fairscale does not train: it supports peft's LoRA only (LoraConfig, or "
                f"{LORA_TYPE}). Use LoRA adapters, or train the model without this training engine."
            )
    if list(peft_model.peft_config) != ["default"]:
        raise ConfigurationError(
            f"model: its peft model has the adapters {sorted(peft_model.peft_config)}; tango-fairscale "
            "trains one, named 'default' (as get_peft_model names it)."
        )


def adapter_config_of(model: nn.Module) -> Optional[Dict[str, Any]]:
    """
    The fields of the ``adapter_config.json`` of the peft model inside ``model``, if it holds one
    (of a method :func:`check_peft_method` accepts, else its error).
    """
    peft_model = peft_model_in(model)
    if peft_model is None:
        return None
    check_peft_method(model)
    fields = peft_model.peft_config["default"].to_dict()
    # As peft writes it: sets (target_modules) as lists, enums by value.
    return json.loads(
        json.dumps(fields, default=lambda value: sorted(value) if isinstance(value, set) else str(value))
    )
