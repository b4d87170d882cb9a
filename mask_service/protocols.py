"""Structural types for the seams with more than one implementation.

* ``GrammarMatcher``: the per-session matcher a grammar engine hands out. Two
  implement it: xgrammar's ``GrammarMatcher`` and llguidance's adapter
  (``backends_llguidance.LLGuidanceMatcher``); sessions, the draft walk and the
  forced continuations use only these calls, so they need not know the engine.
* ``MaskService``: what a worker's ``MaskChannel`` (and anything else that
  drives sessions) needs of the mask service. Two implement it: the router over
  replicas (``router.MaskRouter``) and a client of one replica
  (``client.MaskServiceClient``).

Nothing here is imported at run time by the implementations; mypy checks that
each one fits where it is passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from mask_service.client import DraftMaskItem, DraftMaskResult
    from mask_service.grammar import GrammarSpec

__all__ = ["GrammarMatcher", "MaskService"]


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


class MaskService(Protocol):
    """Session calls of the mask service, on one replica or routed over several."""

    def open_session(
        self, tokenizer_id: str, spec: GrammarSpec, vocab_size: int | None = None, *, request_id: str = ""
    ) -> str: ...

    def commit(self, session_id: str, seq: int, tokens: Sequence[int]) -> bool: ...

    def draft_masks(self, items: Sequence[DraftMaskItem]) -> list[DraftMaskResult]: ...

    def close_session(self, session_id: str) -> None: ...

    def session_count(self) -> int: ...

    def close(self) -> None: ...
