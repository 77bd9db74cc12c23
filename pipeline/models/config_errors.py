"""The one error a checkpoint's config raises when it cannot be served."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """The checkpoint's config cannot be served; the message says why."""
