"""The one exception type every user-facing model-loading failure raises."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model that cannot be loaded. The message says what was wrong and what to do about it."""
