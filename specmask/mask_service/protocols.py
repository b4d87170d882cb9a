"""Structural types for the grammar-engine seam, which has more than one implementation.

* ``GrammarMatcher``: the per-session matcher a grammar engine hands out. Two
  implement it: xgrammar's ``GrammarMatcher`` and llguidance's adapter
  (``backends_llguidance.LLGuidanceMatcher``); sessions, the draft walk and the
  forced continuations use only these calls, so they need not know the engine.

The client side's seam (``MaskService``) is in ``client/service.py``.

Nothing here is imported at run time by the implementations; mypy checks that
each one fits where it is passed.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["GrammarMatcher"]


class GrammarMatcher(Protocol):
    """A grammar's matcher with unbounded rollback (positional arguments: the engines name them differently)."""

    def accept_token(self, token_id: int, /) -> bool:
        """Advance by one token; False (state unchanged) when the grammar refuses it."""
        ...

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted (nothing may follow)."""
        ...

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int = 0, /) -> object:
        """Write the allowed-token row of the current state into ``bitmask[index]`` ([.., W] int32)."""
        ...

    def rollback(self, num_tokens: int, /) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...
