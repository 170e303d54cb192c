"""
The step's model, built as ``plan`` needs it: on the meta device where it can be (no memory, no
weights read), as ``init_on_meta`` builds it, or on the CPU; and its wrap plan.
"""

import copy
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
from tango.common import Params
from tango.common.exceptions import ConfigurationError
from tango.integrations.torch import Model

from ..materialize import parameters_on_meta
from ..wrapping import WRAPPER_TYPE, WrapPlan

#: Where the plan built its model, and what that means, one sentence each.
BUILT_ON = {
    "meta": (
        "the meta device",
        "every tensor has its shape and dtype but no storage, so this command allocated no memory "
        "for the model and read no weights",
    ),
    "meta_parameters": (
        "the meta device (its parameters; its buffers on the CPU)",
        "as the workers build it under init_on_meta, its parameters took no memory here",
    ),
    "cpu": (
        "the CPU",
        "the model could not be built on the meta device, so this command built it for real, its "
        "whole size in this process's memory, and used only its shapes",
    ),
}


def build_model(model_params: Dict[str, Any], init_on_meta: bool = False) -> "tuple[nn.Module, str]":
    """The model, and where it was built (a key of :data:`BUILT_ON`)."""
    # Each attempt gets its own copy: from_params pops what it reads, nested dicts included.
    try:
        # As init_on_meta builds: a pretrained model (fairscale::from_pretrained, or transformers'
        # from_pretrained, which refuses a meta device otherwise) from its config, no tensor read.
        with torch.device("meta"), parameters_on_meta():
            return Model.from_params(Params(copy.deepcopy(model_params))), "meta"
    except ConfigurationError:
        raise
    except Exception:  # noqa: BLE001 - some models cannot be built on meta; CPU always works
        pass
    if init_on_meta:
        # What the workers do under init_on_meta: only the parameters on meta.
        try:
            with parameters_on_meta():
                return Model.from_params(Params(copy.deepcopy(model_params))), "meta_parameters"
        except ConfigurationError:
            raise
        except Exception:  # noqa: BLE001 - the CPU build below reports the constructor's own error
            pass
    try:
        return Model.from_params(Params(copy.deepcopy(model_params))), "cpu"
    except ConfigurationError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's constructor: its error, on one line
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        name = model_params.get("type", "the model")
        raise ConfigurationError(f"model: building {name!r} raised {type(error).__name__}: {first}") from None


def inner_model_config(step: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The model's config and the wrapper's (``{}`` without ``with_wrapped_modules``)."""
    model_config = dict(step["model"])
    if model_config.get("type") == WRAPPER_TYPE:
        return dict(model_config["model"]), model_config
    return model_config, {}


def wrap_plan_of(model: nn.Module, wrapper: Dict[str, Any]) -> Optional[WrapPlan]:
    if not wrapper:
        return None
    return WrapPlan.build(
        model,
        wrapper.get("modules_to_wrap"),
        wrap_module_classes=wrapper.get("wrap_module_classes"),
        min_num_params=wrapper.get("min_num_params"),
        activation_checkpointing=bool(wrapper.get("activation_checkpointing")),
        fsdp=wrapper.get("fsdp_config") is not None,
    )
