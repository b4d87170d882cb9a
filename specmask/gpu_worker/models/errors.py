"""The one error type of the model cache: its message is a single line telling the user what to do."""

from __future__ import annotations


class ModelError(RuntimeError):
    """Fetching, converting or verifying a named model failed; ``str()`` is one actionable line."""
