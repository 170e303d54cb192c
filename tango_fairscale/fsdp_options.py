"""
:class:`FSDPOptions`: every option of an FSDP unit that a user tunes (FairScale's
:class:`~fairscale.nn.FullyShardedDataParallel` names and defaults), as a Tango ``FromParams``
dataclass: the fields, their types and contradictions, read by the backends. Users write them as
:class:`~tango_fairscale.config.FSDPConfig`, which adds ``wrap()``.
"""

import typing
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Type, TypeVar, Union

import torch
from tango.common import FromParams, Params
from tango.common.exceptions import ConfigurationError

#: Spellings accepted for the dtype fields, mapped to the dtype they name.
DTYPE_NAMES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

_DEVICE_FIELDS = ("state_dict_device",)
_DTYPE_FIELDS = ("compute_dtype", "buffer_dtype")


def dtype_named(value: Any) -> Optional[torch.dtype]:
    """The dtype a config's string names (``"bfloat16"``, ``"torch.fp16"``, ...), else ``None``."""
    if isinstance(value, str):
        return DTYPE_NAMES.get(value.strip().lower().removeprefix("torch."))
    return None


def parse_dtype(field_name: str, value: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """Turn a dtype given in a config (``"bfloat16"``, ``"fp16"``, ...) into a :class:`torch.dtype`."""
    if value is None or isinstance(value, torch.dtype):
        return value
    named = dtype_named(value)
    if named is not None:
        return named
    raise ConfigurationError(
        f"FSDPConfig.{field_name}: {value!r} is not a dtype. "
        f"Use one of {sorted(set(DTYPE_NAMES))}, or leave it unset."
    )


_Options = TypeVar("_Options", bound="FSDPOptions")


@dataclass
class FSDPOptions(FromParams):
    """
    The options of FairScale's :class:`~fairscale.nn.FullyShardedDataParallel` (FSDP), with
    FairScale's own defaults. The first four fields are those of
    ``tango.integrations.fairscale.FSDPConfig``, with the same names and meaning.

    Dtypes are strings in configs (``"float32"``, ``"float16"``/``"fp16"``,
    ``"bfloat16"``/``"bf16"``). Unknown keys are an error that lists the valid ones.

    .. seealso::
        `Best practices for FullyShardedDataParallel
        <https://fairscale.readthedocs.io/en/latest/deep_dive/oss_sdp_fsdp.html>`_ in the FairScale docs.
    """

    reshard_after_forward: bool = True
    """
    Free the gathered full parameters of each unit after its forward pass and gather them
    again for the backward pass (ZeRO-3). ``False`` keeps them from forward to backward:
    one all-gather fewer per unit and step, at the cost of holding every unit's full
    parameters between the two passes (ZeRO-2-like memory).
    """

    move_params_to_cpu: bool = False
    """
    Keep the sharded FP32 parameters (and, by default, the gradients and so the optimizer
    step) in CPU memory, copying each unit to the GPU only to use it. Saves GPU memory at a
    large cost in speed. On CPU workers everything already lives in CPU memory, so this has
    no effect there.
    """

    move_grads_to_cpu: Optional[bool] = None
    """
    Move the sharded gradients to CPU memory after the reduction. ``None`` (the default)
    follows :data:`move_params_to_cpu`. ``False`` together with ``move_params_to_cpu: true``
    is refused: FairScale would then run the optimizer on CPU parameters with GPU gradients
    (fairscale#918).
    """

    mixed_precision: bool = False
    """
    Keep FP32 master shards but gather, compute and reduce in :data:`compute_dtype`
    (FP16 on GPUs and BF16 on CPU workers unless set). Pair it with the engine's
    ``amp: true``; without AMP it can hurt convergence, and the engine warns.
    """

    flatten_parameters: bool = True
    """
    Flatten each unit's parameters into one contiguous buffer, so that a unit is gathered
    and reduced with one collective instead of one per parameter.
    """

    disable_reshard_on_root: bool = True
    """
    Never free the root unit's full parameters after forward: its backward comes right
    after, so resharding it would only add an all-gather.
    """

    compute_dtype: Optional[str] = None
    """
    The dtype of the gathered parameters used in forward and backward. Default: with
    :data:`mixed_precision`, ``float16`` on GPUs and ``bfloat16`` on CPU workers (whose AMP is
    bfloat16); else ``float32``.
    """

    buffer_dtype: Optional[str] = None
    """
    The dtype of the module's buffers (e.g. batch-norm statistics). Default: :data:`compute_dtype`.
    """

    fp32_reduce_scatter: bool = False
    """
    Reduce-scatter gradients in FP32 even under :data:`mixed_precision` (more precise, twice
    the traffic). Requires ``mixed_precision: true``.
    """

    bucket_cap_mb: int = 25
    """
    Size in MiB of the buckets that batch small gradient reduce-scatters together (the engine's:
    one bucket all units share). ``0`` disables bucketing. The fairscale backend allocates less
    where the gradients that fit the bucket add up to less, with the same reduce-scatters.
    """

    no_broadcast_optim_state: bool = False
    """
    When gathering a full optimizer state, do not broadcast the state of units that are not
    sharded (for mixture-of-experts layers, whose experts differ per worker).
    """

    state_dict_device: Optional[str] = None
    """
    The device of the tensors in a full ``state_dict()`` (e.g. ``"cpu"`` to gather a large
    model without running out of GPU memory). Default: the compute device.
    """

    clear_autocast_cache: bool = False
    """
    Clear autocast's cast cache after each unit's forward. Useful with ``amp`` and
    ``reshard_after_forward``, where the cache would otherwise keep the gathered half-precision
    weights alive.
    """

    force_input_to_fp32: bool = False
    """
    Cast floating-point inputs to FP32 before the forward pass, for modules that must see
    FP32 inputs under :data:`mixed_precision`.
    """

    verbose: bool = False
    """
    Include FSDP's full settings in each wrapped unit's ``repr``.
    """

    state_dict_on_rank_0_only: bool = False
    """
    Build a full ``state_dict()`` on rank 0 only, returning an empty dict elsewhere: saves
    memory when gathering large models.
    """

    gradient_predivide_factor: Optional[float] = None
    """
    Divide gradients by this before the reduce-scatter, and by ``world_size / factor`` after
    it. Default: FairScale's choice, close to the square root of the world size, which keeps
    FP16 sums in range.
    """

    allow_reset_parameters: bool = False
    """
    Let ``reset_parameters()`` calls pass through to the wrapped module.
    """

    def __post_init__(self) -> None:
        self._check_types()
        for name in _DTYPE_FIELDS:
            parse_dtype(name, getattr(self, name))
        for name in _DEVICE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                try:
                    torch.device(value)
                except (RuntimeError, TypeError) as error:
                    raise ConfigurationError(
                        f"FSDPConfig.{name}: {value!r} is not a device ({error}). "
                        'Use e.g. "cpu" or "cuda", or leave it unset.'
                    ) from None
        if self.move_params_to_cpu and self.move_grads_to_cpu is False:
            raise ConfigurationError(
                "FSDPConfig.move_grads_to_cpu: false together with move_params_to_cpu: true "
                "crashes FairScale's optimizer step (fairscale#918). Leave move_grads_to_cpu "
                "unset (it then follows move_params_to_cpu) or set it to true."
            )
        if self.fp32_reduce_scatter and not self.mixed_precision:
            raise ConfigurationError(
                "FSDPConfig.fp32_reduce_scatter: true requires mixed_precision: true "
                "(without mixed precision, gradients are already reduced in FP32)."
            )
        if self.bucket_cap_mb < 0:
            raise ConfigurationError(
                f"FSDPConfig.bucket_cap_mb: must be >= 0 (0 disables bucketing), got {self.bucket_cap_mb}."
            )
        if self.gradient_predivide_factor is not None and self.gradient_predivide_factor <= 0:
            raise ConfigurationError(
                f"FSDPConfig.gradient_predivide_factor: must be > 0, got {self.gradient_predivide_factor}."
            )

    def _check_types(self) -> None:
        for field in fields(self):
            _check_type(field.name, getattr(self, field.name))

    @classmethod
    def from_params(  # type: ignore[override]
        cls: Type[_Options], params_: Any, *args: Any, **kwargs: Any
    ) -> _Options:
        keys = (
            params_.as_dict(quiet=True).keys()
            if isinstance(params_, Params)
            else params_.keys()
            if isinstance(params_, dict)
            else ()
        )
        unknown = sorted(set(keys) - set(cls.field_names()))
        if unknown:
            raise ConfigurationError(
                f"Unknown FSDPConfig option(s) {unknown}. Valid options: {', '.join(cls.field_names())}."
            )
        # Checked here too because Tango's own conversion raises a bare TypeError first.
        values = params_.as_dict(quiet=True) if isinstance(params_, Params) else params_
        if isinstance(values, dict):
            for name, value in values.items():
                _check_type(name, value)
        return super().from_params(params_, *args, **kwargs)  # type: ignore[return-value]

    @classmethod
    def field_names(cls) -> tuple:
        """The names of all options, in declaration order."""
        return tuple(field.name for field in fields(cls))

    def as_kwargs(self) -> Dict[str, Any]:
        """
        The keyword arguments for :class:`~fairscale.nn.FullyShardedDataParallel`, with dtype
        and device strings converted. Unset optional values are left out so that FairScale's
        own defaults apply.
        """
        kwargs: Dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in _DTYPE_FIELDS:
                value = parse_dtype(field.name, value)
            elif field.name in _DEVICE_FIELDS and value is not None:
                value = torch.device(value)
            if value is None and field.default is None:
                continue
            kwargs[field.name] = value
        return kwargs

    def resolved_compute_dtype(self, on_cpu: bool) -> torch.dtype:
        """
        The dtype FSDP gathers and computes in. With ``mixed_precision`` and no ``compute_dtype``,
        FairScale's float16, except on CPU workers: there AMP is bfloat16 (float16 AMP needs CUDA
        loss scaling), and float16 parameters under bfloat16 autocast fail in ops such as LayerNorm
        that take the input's dtype and the parameters' together.
        """
        explicit = parse_dtype("compute_dtype", self.compute_dtype)
        if explicit is not None:
            return explicit
        if not self.mixed_precision:
            return torch.float32
        return torch.bfloat16 if on_cpu else torch.float16


def _plain_type(annotation: Any) -> type:
    """``Optional[X]`` -> ``X``."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return args[0] if args else annotation


def _check_type(name: str, value: Any) -> None:
    """A :class:`ConfigurationError` naming the field when ``value`` has the wrong type for it."""
    # Tango passes config values through as they are, so "yes" could reach a bool field.
    field = next(f for f in fields(FSDPOptions) if f.name == name)
    expected = _plain_type(typing.get_type_hints(FSDPOptions)[name])
    if value is None and field.default is None:
        return
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif name in _DTYPE_FIELDS:
        ok = isinstance(value, (str, torch.dtype))
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise ConfigurationError(
            f"FSDPConfig.{name}: expected {expected.__name__}"
            f"{' or null' if field.default is None else ''}, got {type(value).__name__} {value!r}."
        )
