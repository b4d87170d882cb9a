"""Host-side questions about grammar mask rows (DESIGN.md wire format).

A row is a ``mask_service.row_table.MaskRow``: a slot of the mask client's
interned table, ``W = ceil(V / 32)`` int32 words, bit j of word w is token
32*w + j. Its allowed-token count and, for a count of 1, that token come with
the row from the service (``NewRow.allowed_count``), so these answers cost no
popcount per step. Bits at or past the logits width V stand for no token (rows
"past the stop" arrive all-ones, tail bits included).
"""

from __future__ import annotations

from mask_service.row_table import MaskRow


def forced_token(row: MaskRow, vocab_size: int) -> int | None:
    """The token id if ``row`` allows exactly one token and it is < vocab_size, else None.

    A row whose only other set bits are padding (>= V) is not reported: it is
    never a grammar's row (padding ids are never allowed), and missing a forced
    position costs only a draft.
    """
    token = row.single_token
    return token if token is not None and token < vocab_size else None


def is_allowed(row: MaskRow, token_id: int) -> bool:
    """Whether bit ``token_id`` of ``row`` is set."""
    return row.allows(token_id)
