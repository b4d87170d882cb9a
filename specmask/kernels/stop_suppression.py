"""min_tokens: stop tokens removed from the rows of output positions before the minimum.

vLLM's min-tokens processor, per row rather than per request: under speculation a
request's k_r + 1 target rows (and its draft positions) are consecutive output
positions, so only the rows before the request's ``min_tokens``-th output token
lose their stop tokens. It runs after the grammar mask and before temperature,
like vLLM's (a logits processor that is not argmax-invariant: greedy requests see
it too), and the target and the draft apply it to the same positions, so p and q
are processed alike (docs/design.md step 4).

A row can be left with no allowed token: a grammar that at this position allows
only a stop token (the document is complete and cannot go on) meets a request that
still needs output tokens. Such a row has no distribution to sample; the caller
gets it back as ``dead`` and must fail the request rather than emit anything from it.

One PyTorch implementation for both backends (an index_put over host-built
indices, as bitmask application's reference path), so the Triton and reference
pipelines see identical logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["suppress_stop_tokens_"]


def suppress_stop_tokens_(
    logits: torch.Tensor,  # [num_rows, V] float, grammar-masked; modified in place
    rows: Sequence[int],  # [n] rows whose output position comes before the request's min_tokens
    stop_token_ids: Sequence[Sequence[int]],  # [n] per row: the ids to remove (EOS and stop_token_ids)
) -> torch.Tensor:  # [n] bool: True where the row has no finite logit left (nothing may be sampled)
    """Set the stop tokens of ``rows`` to -inf; returns which of those rows are now empty.
    Ids outside [0, V) are skipped (they cannot be sampled anyway)."""
    if len(rows) != len(stop_token_ids):
        raise ValueError(f"{len(rows)} rows but {len(stop_token_ids)} stop-token lists")
    num_rows, vocab = logits.shape
    flat_rows: list[int] = []
    flat_ids: list[int] = []
    for row, ids in zip(rows, stop_token_ids):
        if not 0 <= row < num_rows:
            raise ValueError(f"row {row} is outside the {num_rows} logit rows")
        kept = [t for t in ids if 0 <= t < vocab]
        flat_rows.extend([row] * len(kept))
        flat_ids.extend(kept)
    device = logits.device
    if flat_rows:
        index = (
            torch.tensor(flat_rows, dtype=torch.int64, device=device),
            torch.tensor(flat_ids, dtype=torch.int64, device=device),
        )
        logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=device))
    if not rows:
        return torch.zeros(0, dtype=torch.bool, device=device)
    picked = torch.tensor(list(rows), dtype=torch.int64, device=device)  # [n]
    # NaN logits count as empty too: nothing could be sampled from them either.
    return ~(logits.index_select(0, picked) > float("-inf")).any(dim=1)  # [n]
