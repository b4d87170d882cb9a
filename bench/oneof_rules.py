"""How many ``oneOf`` schemas each disjointness rule of ``oneof_disjoint`` lets through.

    python -m bench.oneof_rules --schemas ../shared/data/maskbench [--subsets Github_medium,...]

No compile, no tokenizer: every ``oneOf`` in every schema (``$ref`` targets
included, wherever it sits) is judged as the xgrammar gate judges it
(``backends_routing.xgrammar_gap``: object keywords imply objects) and as the
llguidance rewrite does (``oneof_as_anyof``: JSON Schema's reading, plus the
``exclusive_required`` rewrite of "exactly one of these key sets"). A schema
counts as "proven" when every ``oneOf`` in it is. Per rule, "needed" is the
number of proven schemas that would not be without that rule (the rules are
tried in order, so a later rule may stand in for an earlier one). The last line
is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specmask.mask_service.grammar.oneof_disjoint import RULES, exclusive_required, exclusive_rules

_DATA_KEYS = ("const", "enum", "default", "examples", "example")


def one_ofs(node: Any) -> Iterator[dict[str, Any]]:
    """Every schema object holding a ``oneOf`` (data values skipped)."""
    if isinstance(node, list):
        for sub in node:
            yield from one_ofs(sub)
        return
    if not isinstance(node, dict):
        return
    if "oneOf" in node:
        yield node
    for key, value in node.items():
        if key not in _DATA_KEYS and isinstance(value, (dict, list)):
            yield from one_ofs(value)


def proven(schema: Any, rules: tuple[str, ...], assume_objects: bool) -> bool:
    """Whether every oneOf in ``schema`` is proven by ``rules`` (or, for llguidance, rewritten
    by ``exclusive_required`` when that name is among them)."""
    return all(
        exclusive_rules(node, schema, rules, assume_objects=assume_objects) is not None
        or (not assume_objects and "exclusive_required" in rules and exclusive_required(node["oneOf"]) is not None)
        for node in one_ofs(schema)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemas", required=True, help="maskbench-style directory: one {schema, tests} JSON per file")
    ap.add_argument("--subsets", default="", help="comma-separated file-name prefixes")
    args = ap.parse_args(argv)
    prefixes = [s for s in args.subsets.split(",") if s]
    result: dict[str, Any] = {}
    for reading, assume in (("xgrammar", True), ("llguidance", False)):
        all_rules = tuple(RULES) + (() if assume else ("exclusive_required",))
        counts: Counter[str] = Counter()
        for f in sorted(Path(args.schemas).glob("*.json")):
            if prefixes and not any(f.name.startswith(p) for p in prefixes):
                continue
            schema = json.loads(f.read_text())["schema"]
            if not any(True for _ in one_ofs(schema)):
                continue
            counts["with_oneOf"] += 1
            if not proven(schema, all_rules, assume):
                continue
            counts["proven"] += 1
            for rule in all_rules:
                if not proven(schema, tuple(r for r in all_rules if r != rule), assume):
                    counts[f"needed:{rule}"] += 1
        result[reading] = dict(sorted(counts.items()))
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
