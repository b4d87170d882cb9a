"""Grammar exactness, instance by instance: which schemas the service accepts, and whether it lies.

    python -m bench.coverage --schemas ../shared/data/maskbench --tokenizer ../shared/data/tokenizers/llama3 \\
        [--subsets Github_medium,Glaiveai2K] [--backend auto|xgrammar|llguidance] [--limit N]
    python -m bench.coverage --test-suite ../shared/data/json-schema-test-suite/draft2020-12 \\
        --tokenizer ../shared/data/tokenizers/llama3 --table
    python -m bench.coverage --schemas ... --checked    # also count checked mode apart
    python -m bench.coverage --schemas ... --checked --without-rules dependencies   # one exact rewrite off

Every schema is compiled through the service's own path (``backends.BACKENDS``,
the code ``compiler_cache`` runs, in-process). For every accepted schema each
test instance is serialised the way the grammar expects (compact separators,
non-ASCII kept raw) in two key orders, the instance's own and the schema's
``properties`` order (both engines emit properties in schema order), tokenized
with the real tokenizer, fed token by token to a fresh matcher, and finished
with a stop token. An instance counts as accepted if either order is.

* valid instance rejected: over-restriction (allowed: strict mode, key order,
  integer-valued floats such as ``1.0``; counted);
* invalid instance accepted: a **lie** (goal 0). Each one is printed.

The last line is ``RESULT {json}``: totals plus the same per subset (maskbench:
the file-name prefix; test suite: the feature file) and per backend.

``--checked`` compiles every schema as an opted-in checked-mode request
(``GrammarSpec.checked``). Schemas an engine enforces exactly are counted as
before (``accepted``, ``invalid_accepted``: the exact path's lie figure);
schemas accepted only through a relaxation are counted apart
(``checked_accepted``, with ``checked_*`` instance counts), and ``refused``
is what neither mode takes. For those, the grammar accepting an invalid
instance is expected (``checked_grammar_invalid_accepted``); each such
instance is then put through the orchestrator's end-of-request check against
the ORIGINAL schema (``orchestrator.output_check``), and one it lets through
would be returned as a success: ``checked_lies`` (goal 0, each printed).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_COUNTERS = (
    "schemas",
    "accepted",
    "refused",
    "crashes",
    "valid_instances",
    "valid_accepted",
    "invalid_instances",
    "invalid_accepted",
)
# Checked mode (--checked): schemas accepted only through a relaxation, counted apart.
_CHECKED_COUNTERS = (
    "checked_accepted",
    "checked_valid_instances",
    "checked_valid_accepted",
    "checked_invalid_instances",
    "checked_grammar_invalid_accepted",  # expected: the relaxation is wider; the end check must catch each
    "checked_lies",  # grammar AND end check accept an invalid instance: would be returned as success
    "checked_end_check_rejects_valid",  # the end check refuses a valid instance the grammar accepts
)


@dataclass(frozen=True)
class Case:
    """One schema and its labelled instances."""

    subset: str
    name: str
    schema: Any
    tests: list[tuple[Any, bool]]  # (instance, valid)


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    by_subset: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    by_backend: Counter[str] = field(default_factory=Counter)
    refusal_reasons: Counter[str] = field(default_factory=Counter)
    relaxed: Counter[str] = field(default_factory=Counter)  # checked mode: relaxation rules applied
    lies: list[str] = field(default_factory=list)

    def add(self, subset: str, key: str, n: int = 1) -> None:
        self.counts[key] += n
        self.by_subset[subset][key] += n

    def result(self, checked: bool = False) -> dict[str, Any]:
        keys = _COUNTERS + (_CHECKED_COUNTERS if checked else ())
        out: dict[str, Any] = {k: self.counts[k] for k in keys}
        out["accepted_by"] = dict(self.by_backend)
        out["subsets"] = {s: {k: c[k] for k in keys} for s, c in sorted(self.by_subset.items())}
        return out


def maskbench_cases(directory: Path, subsets: list[str] | None) -> Iterator[Case]:
    for f in sorted(directory.glob("*.json")):
        subset = f.name.split("---")[0] if "---" in f.name else f.name.split("_")[0]
        if subsets and not any(f.name.startswith(p) for p in subsets):
            continue
        data = json.loads(f.read_text())
        tests = [(t["data"], bool(t["valid"])) for t in data.get("tests", [])]
        yield Case(subset, f.stem, data["schema"], tests)


def test_suite_cases(directory: Path, subsets: list[str] | None) -> Iterator[Case]:
    """JSON-Schema-Test-Suite groups: one case per group, subset = the feature file."""
    for f in sorted(directory.glob("*.json")):
        if subsets and f.stem not in subsets:
            continue
        for i, group in enumerate(json.loads(f.read_text())):
            tests = [(t["data"], bool(t["valid"])) for t in group["tests"]]
            yield Case(f.stem, f"{f.stem}#{i} {group['description']}", group["schema"], tests)


def _resolve(node: Any, root: Any) -> Any:
    for _ in range(32):  # $ref chains; cycles stop here
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#")):
            return node
        target: Any = root
        for part in node["$ref"][1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return node
        node = target
    return node


def _property_schemas(node: Any, root: Any) -> dict[str, Any]:
    """Declared properties in the order the grammar emits them (own, then allOf/anyOf/oneOf branches')."""
    node = _resolve(node, root)
    if not isinstance(node, dict):
        return {}
    props: dict[str, Any] = dict(node["properties"]) if isinstance(node.get("properties"), dict) else {}
    for comb in ("allOf", "anyOf", "oneOf"):
        for branch in node.get(comb, []) if isinstance(node.get(comb), list) else []:
            for k, v in _property_schemas(branch, root).items():
                props.setdefault(k, v)
    return props


def schema_order(instance: Any, node: Any, root: Any) -> Any:
    """The instance with object keys in the schema's ``properties`` order (undeclared keys after)."""
    if isinstance(instance, dict):
        props = _property_schemas(node, root)
        resolved = _resolve(node, root)
        extra = resolved.get("additionalProperties") if isinstance(resolved, dict) else None
        keys = [k for k in props if k in instance] + [k for k in instance if k not in props]
        return {k: schema_order(instance[k], props.get(k, extra), root) for k in keys}
    if isinstance(instance, list):
        resolved = _resolve(node, root)
        prefix = resolved.get("prefixItems") if isinstance(resolved, dict) else None
        items = resolved.get("items") if isinstance(resolved, dict) else None
        out = []
        for i, v in enumerate(instance):
            if isinstance(prefix, list) and i < len(prefix):
                sub = prefix[i]
            elif isinstance(items, list):
                sub = items[i] if i < len(items) else None
            else:
                sub = items
            out.append(schema_order(v, sub, root))
        return out
    return instance


def serializations(instance: Any, schema: Any) -> list[str]:
    """The compact texts to try (instance order, schema order); [] if not representable as JSON."""
    texts = []
    for candidate in (instance, schema_order(instance, schema, schema)):
        try:
            text = json.dumps(candidate, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError):
            return []
        if text not in texts:
            texts.append(text)
    return texts


class Checker:
    """Compiles through the service's backend registry and feeds instances to its matchers."""

    def __init__(self, tokenizer_dir: str, backend: str, strict: bool, checked: bool = False) -> None:
        from specmask.mask_service.grammar.backends import BACKENDS
        from specmask.mask_service.server.tokenizers import TokenizerRegistry, TokenizerSource

        self.registry = TokenizerRegistry([TokenizerSource(tokenizer_dir)])
        tid = self.registry.ids()[0]
        self.hf = self.registry.get(tid).hf_tokenizer
        self.stop = self.registry.get(tid).stop_token_ids[0]
        self.backend = BACKENDS["auto"]
        self.compilers = self.backend.make_compiler(self.registry.info(tid, None), 2)
        self.explicit = "" if backend == "auto" else backend
        self.strict = strict
        self.checked = checked
        self._end_check: Any = None

    def spec(self, schema: Any) -> Any:
        from specmask.common.grammar_spec import GrammarKind, GrammarSpec

        text = json.dumps(schema, ensure_ascii=False)
        return GrammarSpec(
            GrammarKind.JSON_SCHEMA, text, strict=self.strict, backend=self.explicit, checked=self.checked
        )

    def end_check(self, schema: Any, text: str, engine: str) -> tuple[bool, str]:
        """The orchestrator's end-of-request check of ``text`` against the original schema (fails closed):
        (passes, why not). ``engine``: the engine that masked the output, as the orchestrator passes it
        (GrammarReport.backend): it picks what strict mode means (output_check.STRICT_READINGS)."""
        from specmask.orchestrator.output_check import OutputChecker, OutputCheckError

        if self._end_check is None:
            self._end_check = OutputChecker()
        try:
            verdict = self._end_check.check(self.spec(schema), text, engine)
        except OutputCheckError as exc:
            return False, f"unverifiable: {exc}"
        return bool(verdict.ok), verdict.reason

    def compile(self, schema: Any) -> Any:
        return self.backend.compile(self.compilers, self.spec(schema))

    def accepts(self, selected: Any, text: str) -> bool:
        m = self.backend.new_matcher(selected)
        for t in [*self.hf.encode(text, add_special_tokens=False), self.stop]:
            if not m.accept_token(t):
                return False
        return bool(m.is_terminated())


def run_case(checker: Checker, case: Case, tally: Tally, verbose: bool) -> None:
    from specmask.mask_service.errors import MaskError
    from specmask.mask_service.grammar.backends import SelectedGrammar

    tally.add(case.subset, "schemas")
    try:
        selected = checker.compile(case.schema)
    except MaskError as exc:
        tally.add(case.subset, "refused")
        tally.refusal_reasons[_reason_key(exc.message)] += 1
        if verbose:
            print(f"refused {case.name}: {exc.message[:200]}")
        return
    except Exception as exc:
        tally.add(case.subset, "crashes")
        print(f"CRASH compiling {case.name}: {type(exc).__name__}: {exc}"[:400])
        return
    backend = selected.backend if isinstance(selected, SelectedGrammar) else checker.explicit
    if getattr(selected, "enforcement", "exact") == "checked":
        tally.add(case.subset, "checked_accepted")
        tally.by_backend[f"checked:{backend}"] += 1
        for rule in selected.relaxed:
            tally.relaxed[rule] += 1
        _run_checked_instances(checker, case, selected, tally, verbose)
        return
    tally.add(case.subset, "accepted")
    tally.by_backend[backend] += 1
    for texts, valid, ok in _matched_instances(checker, case, selected, tally):
        tally.add(case.subset, "valid_instances" if valid else "invalid_instances")
        if valid and ok:
            tally.add(case.subset, "valid_accepted")
        elif not valid and ok:
            tally.add(case.subset, "invalid_accepted")
            lie = f"LIE [{backend}] {case.name}: accepts invalid {texts[0][:200]}"
            tally.lies.append(lie)
            print(lie)
        elif valid and verbose:
            print(f"over-restricts [{backend}] {case.name}: rejects valid {texts[0][:160]}")


def _matched_instances(
    checker: Checker, case: Case, selected: Any, tally: Tally
) -> Iterator[tuple[list[str], bool, bool]]:
    """(serialisations, labelled valid, grammar accepts one) per instance of ``case`` that
    serialises; a matcher crash is counted and printed, and that instance skipped."""
    for instance, valid in case.tests:
        texts = serializations(instance, case.schema)
        if not texts:
            continue
        try:
            ok = any(checker.accepts(selected, t) for t in texts)
        except Exception as exc:
            tally.add(case.subset, "crashes")
            print(f"CRASH matching {case.name}: {type(exc).__name__}: {exc}"[:400])
            continue
        yield texts, valid, ok


def _run_checked_instances(checker: Checker, case: Case, selected: Any, tally: Tally, verbose: bool) -> None:
    """A relaxation's grammar vs the labels, and the end check behind it (the checked mode's lie metric)."""
    for texts, valid, ok in _matched_instances(checker, case, selected, tally):
        tally.add(case.subset, "checked_valid_instances" if valid else "checked_invalid_instances")
        if valid and ok:
            tally.add(case.subset, "checked_valid_accepted")
            passed, why = checker.end_check(case.schema, texts[0], selected.backend)
            if not passed:
                tally.add(case.subset, "checked_end_check_rejects_valid")
                if verbose:
                    print(f"end check rejects valid [{selected.backend}] {case.name}: {texts[0][:160]} ({why[:200]})")
        elif not valid and ok:
            tally.add(case.subset, "checked_grammar_invalid_accepted")
            if checker.end_check(case.schema, texts[0], selected.backend)[0]:
                tally.add(case.subset, "checked_lies")
                lie = f"CHECKED LIE [{selected.backend}] {case.name}: end check passes invalid {texts[0][:200]}"
                tally.lies.append(lie)
                print(lie)


def mask_cost(checker: Checker, cases: Iterator[Case], num_schemas: int) -> dict[str, Any]:
    """Per-row mask time of each engine on the same schemas and the same token walks.

    Schemas both engines compile (explicitly, bypassing selection); along each
    schema's first valid instance the engines fill the row for every position,
    interleaved, so load on the box hits both alike.
    """
    import numpy as np

    from specmask.common.grammar_spec import GrammarKind, GrammarSpec
    from specmask.mask_service.errors import MaskError

    width = (checker.compilers.tokenizer_info.vocab_size + 31) // 32
    times: dict[str, list[float]] = {"xgrammar": [], "llguidance": []}
    used = 0
    for case in cases:
        if used >= num_schemas:
            break
        valid = [inst for inst, ok in case.tests if ok]
        texts = serializations(valid[0], case.schema) if valid else []
        if not texts:
            continue
        text = json.dumps(case.schema, ensure_ascii=False)
        try:
            compiled = {
                n: checker.backend.compile(checker.compilers, GrammarSpec(GrammarKind.JSON_SCHEMA, text, backend=n))
                for n in times
            }
        except MaskError:
            continue
        tokens = [*checker.hf.encode(texts[0], add_special_tokens=False), checker.stop]
        if not all(checker.accepts(c, texts[0]) for c in compiled.values()):
            continue
        matchers = {n: checker.backend.new_matcher(c) for n, c in compiled.items()}
        row = np.zeros((1, width), dtype=np.int32)  # [1, W]
        for t in tokens:
            for n, m in matchers.items():
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(row, 0)
                times[n].append(time.perf_counter() - t0)
                m.accept_token(t)
        used += 1
    out: dict[str, Any] = {"schemas": used, "rows": len(times["xgrammar"])}
    for n, ts in times.items():
        if ts:
            arr = np.array(ts) * 1e6
            out[n] = {
                "p50_us": round(float(np.percentile(arr, 50)), 1),
                "p99_us": round(float(np.percentile(arr, 99)), 1),
                "mean_us": round(float(arr.mean()), 1),
            }
    return out


def _reason_key(message: str) -> str:
    """A short bucket for a refusal message (its first engine's first clause)."""
    first = message.split("; llguidance:", 1)[0]
    for marker in (": '", "keyword at"):
        if marker in first:
            break
    return first[:90]


def feature_table(result: dict[str, Any], checked: bool = False) -> str:
    """Markdown: per test-suite feature, groups enforced / refused / lied and instance counts.

    ``checked``: a "checked" column (groups accepted only through a relaxation) and, for them,
    invalid instances the relaxed grammar accepts that the end check caught (caught/grammar-accepted).
    """
    extra_head = " checked | checked: invalid caught by end check |" if checked else ""
    lines = [
        "| feature | groups | accepted |"
        + extra_head
        + " refused | groups that lied | invalid accepted | valid rejected |",
        "|---|---:|---:|" + ("---:|---:|" if checked else "") + "---:|---:|---:|---:|",
    ]
    for name, c in result["subsets"].items():
        extra = ""
        if checked:
            grammar_ok = c["checked_grammar_invalid_accepted"]
            extra = f" {c['checked_accepted']} | {grammar_ok - c['checked_lies']}/{grammar_ok} |"
        lines.append(
            f"| {name} | {c['schemas']} | {c['accepted']} |{extra} {c['refused']} | {c.get('lied_groups', 0)} | "
            f"{c['invalid_accepted']}/{c['invalid_instances']} | "
            f"{c['valid_instances'] - c['valid_accepted']}/{c['valid_instances']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--schemas", help="maskbench-style directory: one {schema, tests} JSON per file")
    src.add_argument("--test-suite", help="a JSON-Schema-Test-Suite draft directory (e.g. .../draft2020-12)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer directory (tokenizer.json)")
    ap.add_argument("--subsets", default="", help="comma-separated file-name prefixes (maskbench) or feature names")
    ap.add_argument("--backend", default="auto", choices=["auto", "xgrammar", "llguidance"])
    ap.add_argument("--limit", type=int, default=0, help="stop after this many schemas (0: all)")
    ap.add_argument("--every", type=int, default=1, help="take every N-th schema (a sample spread over all subsets)")
    ap.add_argument(
        "--strict",
        choices=["on", "off", "default"],
        default="default",
        help="strict mode (no undeclared properties); default: on for maskbench, off for the test suite",
    )
    ap.add_argument(
        "--mask-cost",
        type=int,
        default=0,
        metavar="N",
        help="instead: per-row mask time of both engines on the first N schemas both compile",
    )
    ap.add_argument(
        "--checked",
        action="store_true",
        help="compile as opted-in checked-mode requests: schemas accepted only through a relaxation counted apart",
    )
    ap.add_argument(
        "--without-rules",
        default="",
        help="comma-separated exact_rewrites rules to switch off (allOf, dependencies, anyOf, enum): "
        "what each rule adds is the difference to a run with all of them",
    )
    ap.add_argument("--table", action="store_true", help="print the per-subset table as markdown")
    ap.add_argument("--verbose", action="store_true", help="print every refusal and over-restriction")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from specmask.mask_service.grammar.exact_rewrites import RULES

    for rule in (r for r in args.without_rules.split(",") if r):
        if rule not in RULES:
            ap.error(f"unknown rule {rule!r}; known: {', '.join(RULES)}")
        del RULES[rule]
    subsets = [s for s in args.subsets.split(",") if s] or None
    if args.schemas:
        cases = maskbench_cases(Path(args.schemas), subsets)
        strict = args.strict != "off"
    else:
        cases = test_suite_cases(Path(args.test_suite), subsets)
        strict = args.strict == "on"  # the suite's instances follow plain JSON-Schema semantics
    checker = Checker(args.tokenizer, args.backend, strict, checked=args.checked)
    if args.mask_cost:
        print("RESULT " + json.dumps({"mask_cost": mask_cost(checker, cases, args.mask_cost)}, sort_keys=True))
        return 0
    tally = Tally()
    t0 = time.perf_counter()
    partial = False
    try:
        for i, case in enumerate(cases):
            if args.limit and i >= args.limit * args.every:
                break
            if i % args.every:
                continue
            lies_before = len(tally.lies)
            run_case(checker, case, tally, args.verbose)
            if len(tally.lies) > lies_before:
                tally.by_subset[case.subset]["lied_groups"] += 1
            if tally.counts["schemas"] % 250 == 0:
                print(f"... {tally.counts['schemas']} schemas, {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    except KeyboardInterrupt:  # SIGINT: report what was checked so far, marked partial
        partial = True
    result = tally.result(checked=args.checked)
    result["checked"] = args.checked
    if args.checked:
        result["relaxed"] = dict(tally.relaxed.most_common())
    result["partial"] = partial
    result["every"] = args.every
    result["strict"] = strict
    result["backend"] = args.backend
    result["rules"] = list(RULES)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["top_refusals"] = dict(tally.refusal_reasons.most_common(15))
    if args.table:
        for name, c in tally.by_subset.items():
            result["subsets"][name]["lied_groups"] = c["lied_groups"]
        print(feature_table(result, checked=args.checked))
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
