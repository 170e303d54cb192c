import inspect

import pytest
import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from tango.common import Params
from tango.common.exceptions import ConfigurationError

from tango_fairscale import FSDPConfig


def test_defaults_are_fairscales() -> None:
    fairscale_defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(FSDP.__init__).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    for name in FSDPConfig.field_names():
        assert name in fairscale_defaults, f"{name} is not an FSDP option"
        assert getattr(FSDPConfig(), name) == fairscale_defaults[name], name


def test_bundled_fields_keep_names_and_meaning() -> None:
    config = FSDPConfig.from_params(
        Params(
            {
                "reshard_after_forward": False,
                "move_params_to_cpu": True,
                "move_grads_to_cpu": True,
                "mixed_precision": True,
            }
        )
    )
    kwargs = config.as_kwargs()
    assert kwargs["reshard_after_forward"] is False
    assert kwargs["move_params_to_cpu"] is True
    assert kwargs["move_grads_to_cpu"] is True
    assert kwargs["mixed_precision"] is True
    assert "move_grads_to_cpu" not in FSDPConfig().as_kwargs()  # None: FairScale decides


@pytest.mark.parametrize(
    "text, dtype",
    [
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("bf16", torch.bfloat16),
        ("torch.float32", torch.float32),
    ],
)
def test_dtype_strings(text: str, dtype: torch.dtype) -> None:
    config = FSDPConfig.from_params(
        Params({"compute_dtype": text, "buffer_dtype": text, "mixed_precision": True})
    )
    assert config.as_kwargs()["compute_dtype"] == dtype
    assert config.as_kwargs()["buffer_dtype"] == dtype


@pytest.mark.parametrize(
    "params, fragment",
    [
        (
            {"reshard_after_forwards": True},
            "Unknown FSDPConfig option(s) ['reshard_after_forwards']. Valid options: reshard_after_forward,",
        ),
        ({"compute_dtype": "float17"}, "FSDPConfig.compute_dtype: 'float17' is not a dtype"),
        ({"mixed_precision": "yes"}, "FSDPConfig.mixed_precision: expected bool, got str 'yes'"),
        ({"bucket_cap_mb": 2.5}, "FSDPConfig.bucket_cap_mb: expected int, got float 2.5"),
        ({"move_params_to_cpu": True, "move_grads_to_cpu": False}, "fairscale#918"),
        (
            {"fp32_reduce_scatter": True},
            "FSDPConfig.fp32_reduce_scatter: true requires mixed_precision: true",
        ),
        ({"state_dict_device": "gpu"}, "FSDPConfig.state_dict_device: 'gpu' is not a device"),
        ({"bucket_cap_mb": -1}, "FSDPConfig.bucket_cap_mb: must be >= 0"),
    ],
)
def test_bad_configs_name_the_field(params: dict, fragment: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        FSDPConfig.from_params(Params(params))
    assert fragment in str(error.value)


def test_integer_is_accepted_for_float_field() -> None:
    assert FSDPConfig(gradient_predivide_factor=2).as_kwargs()["gradient_predivide_factor"] == 2
