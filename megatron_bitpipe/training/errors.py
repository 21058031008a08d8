"""Errors the pretrain scripts turn into exit codes."""

from ..megatron_args import BitPipeConfigError

__all__ = ["BitPipeConfigError", "CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run; the message says why (flag, parameter)."""
