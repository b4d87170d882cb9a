"""``allOf`` folded into its schema: applies wherever ``schema_merge.merge`` proves the branch's
conjunction with the rest of the node, branch by branch.

Why exact: ``{K..., "allOf": [A, B]}`` is ``K and A and B``; each branch that merges is
replaced by the merged schema (the same conjunction, ``schema_merge``). Branches are tried
in order; an ``allOf`` a merged branch brings with it is folded the same way (bounded). The
rewrite applies only when every branch merges.

Why it matters: xgrammar compiles an ``allOf`` of several branches as "any value", so
``schema_check`` refuses it; llguidance enforces ``allOf`` but refuses some intersections
(two ``anyOf`` among the branches, patterns it cannot intersect). Merged, the schema is one
object/string/number schema either engine reads, and the other rewrites (``dependencies``,
``anyof_distribute``) can see through it.
"""

from __future__ import annotations

from typing import Any

from specmask.mask_service.grammar.schema_merge import MergeContext, inline, merge

# Nested allOf brought in by merged branches are folded at most this many rounds.
MAX_ROUNDS = 8


def _reorders(out: dict[str, Any], branch: Any, ctx: MergeContext) -> bool:
    """Whether merging ``branch`` would move its properties before those of a union already in
    ``out``: the engines emit a node's own properties before its ``anyOf``/``oneOf`` branches',
    and the allOf order (the union's first) is the order a caller's documents follow."""
    resolved = inline(branch, ctx)
    lists = isinstance(resolved, dict) and "properties" in resolved
    return lists and any(k in out for k in ("anyOf", "oneOf", "allOf"))


def merge_all_of(body: dict[str, Any], ctx: MergeContext) -> dict[str, Any] | None:
    """``body`` (a node's validation keywords) with its ``allOf`` branches merged in where exact;
    None when no branch merges."""
    branches = body.get("allOf")
    if not isinstance(branches, list):
        return None
    out = {k: v for k, v in body.items() if k != "allOf"}
    left: list[Any] = []
    merged_any = False
    pending = list(branches)
    for _ in range(MAX_ROUNDS):
        for branch in pending:
            if branch is True or branch == {}:
                merged_any = True
                continue
            merged = None if _reorders(out, branch, ctx) else merge(out, branch, ctx)
            if merged is None:
                left.append(branch)
                continue
            merged_any = True
            out = merged
        pending = out.pop("allOf", [])
        if not pending:
            break
    else:
        left.extend(pending)
    if not merged_any or left:
        # Only a complete merge helps: an allOf left behind is still refused by xgrammar, and
        # llguidance, which reads it either way, would see the keywords in a new arrangement
        # (and emit the properties in another order).
        return None
    return out
