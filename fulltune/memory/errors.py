"""Errors of the memory model that a user's configuration can cause.

They are `fulltune.errors.ConfigError`s (exit 2, one message, no traceback) and also `ValueError`s, so
callers that add the pipeline's name and YAML field to a ValueError keep doing so.
"""

from __future__ import annotations

from fulltune.errors import ConfigError


class MemoryConfigError(ConfigError, ValueError):
    """A setting, budget or model config the memory model cannot work with; the message names it."""
