"""Independent reference for draft-position masks: xgrammar called directly, docs/design.md step 2."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def reference_walk(
    compiled: Any, committed: Sequence[int], drafts: Sequence[int], vocab_size: int
) -> tuple[np.ndarray, int, bool]:
    """Fresh matcher, replay ``committed``, then rows M_0..M_k.

    Returns ([k+1, W] int32 rows, drafts accepted, whether the walk stopped early
    (rejected draft or termination)).
    """
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled)
    for t in committed:
        ok = m.accept_token(t)
        assert ok, "reference replay must only use accepted tokens"
    w = (vocab_size + 31) // 32
    rows = np.full((len(drafts) + 1, w), -1, dtype=np.int32)
    if m.is_terminated():
        return rows, 0, True
    m.fill_next_token_bitmask(rows, 0)
    accepted = 0
    for i, d in enumerate(drafts):
        ok = m.accept_token(d)
        if not ok:
            return rows, accepted, True
        accepted += 1
        if m.is_terminated():
            return rows, accepted, True
        m.fill_next_token_bitmask(rows, i + 1)
    return rows, accepted, False


def reference_rows(
    compiled: Any, committed: Sequence[int], drafts: Sequence[int], vocab_size: int
) -> tuple[np.ndarray, int]:
    rows, accepted, _ = reference_walk(compiled, committed, drafts, vocab_size)
    return rows, accepted
