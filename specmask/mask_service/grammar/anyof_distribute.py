"""Keywords beside ``anyOf``/``oneOf`` pushed into every branch: applies where each branch
merges with them exactly (``schema_merge.merge``) and the copies stay within a size bound.

Why exact: ``T and (A or B)`` is ``(T and A) or (T and B)``. For ``oneOf`` too: where ``T``
fails no branch ``T and X`` matches and the ``oneOf`` fails as the original does; where it
holds, ``T and X`` matches exactly when ``X`` does, so the count of matching branches is the
original's. A branch that merges to nothing (``false``) matches nothing in either form and
is dropped.

Why it matters: xgrammar keeps only the ``anyOf``/``oneOf`` and drops the keywords beside
it, so ``schema_check`` refuses such a node (``type`` alone is already pushed in by
``schema_rewrite.push_type``). Distributed, each branch is a plain schema.
"""

from __future__ import annotations

from typing import Any

from specmask.mask_service.grammar.oneof_disjoint import provably_disjoint
from specmask.mask_service.grammar.schema_merge import MergeContext, inline, merge, size, type_meet

# The branches' total size may grow to this many times the node's, plus this many bytes.
GROWTH_FACTOR = 4
GROWTH_BYTES = 32 * 1024
MAX_BRANCHES = 64


def distribute(body: dict[str, Any], ctx: MergeContext) -> dict[str, Any] | None:
    """``body`` (a node's validation keywords) as one ``anyOf``/``oneOf`` of merged branches, or None."""
    combinators = [k for k in ("anyOf", "oneOf") if k in body]
    if len(combinators) != 1:
        return None
    comb = combinators[0]
    branches = body[comb]
    siblings = {k: v for k, v in body.items() if k != comb}
    if not isinstance(branches, list) or not siblings or set(siblings) == {"type"} or len(branches) > MAX_BRANCHES:
        return None
    out = []
    for branch in branches:
        branch = inline(branch, ctx)
        if branch is None:
            return None
        if branch is False or (
            "type" in siblings and "type" in branch and not type_meet(siblings["type"], branch["type"])
        ):
            continue  # matches nothing beside the siblings' type
        merged = merge(siblings, branch, ctx)
        if merged is None:
            return None
        out.append(merged)
    if not out or size(out) > GROWTH_FACTOR * size(body) + GROWTH_BYTES:
        return None
    if comb == "oneOf" and not provably_disjoint({comb: out}, ctx.root, assume_objects=True):
        # Unproven, the oneOf goes to llguidance either way, whose own proofs
        # (oneof_disjoint.oneof_as_anyof) read required-only branches beside properties.
        return None
    return {comb: out}
