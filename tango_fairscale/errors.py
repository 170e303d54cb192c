"""Exceptions of tango-fairscale."""

from tango.common.exceptions import ConfigurationError, TangoError


class CheckpointError(TangoError):
    """A checkpoint is missing, incomplete, foreign, or not safe to load."""


class WrapConfigurationError(ConfigurationError, ValueError):
    """
    A ``with_wrapped_modules`` selection that cannot be applied (a pattern matching nothing, a
    class that is not there, a bad value). Also a :class:`ValueError`, which is what ai2-tango's
    bundled ``tango.integrations.fairscale`` raised for a pattern matching nothing: code that
    catches either keeps working.
    """
