"""Exceptions of tango-fairscale."""

from tango.common.exceptions import TangoError


class CheckpointError(TangoError):
    """A checkpoint is missing, incomplete, foreign, or not safe to load."""
