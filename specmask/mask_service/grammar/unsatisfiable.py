"""Schemas with no valid instance, proven by cheap sound rules and refused before any engine.

Such a schema used to reach the engines, or, when only a relaxation could be compiled, checked
mode: there every attempt failed the end check, since no output can pass it, and the request
spent all its attempts before ending with ``GRAMMAR_VIOLATION``. Refused up front instead, the
caller gets ``INVALID_ARGUMENT`` and the reason.

How: each subschema is given the set of *kinds* of JSON value that may still be its instances
(``KINDS``: null, boolean, object, array, string, an integral number, a non-integral number),
always a superset of the truth. A keyword that applies only to some kinds can remove only those
kinds (``minimum > maximum`` empties numbers; a string still passes it); ``allOf`` intersects,
``anyOf``/``oneOf`` unite, a required property whose subschema has no kind left removes objects.
The schema is refused only when the root has no kind left. Anything a rule does not understand
keeps every kind, so an unknown keyword, a remote ``$ref`` or a pattern can only make the proof
fail, never refuse a satisfiable schema.

The rules (each a sound implication; the docstring of each helper says why):

* ``type`` (absent: every kind); ``false`` as a schema;
* ``enum``/``const``: the values that pass the whole node, judged by ``jsonschema`` the way the
  end check judges an output (``enum_filter.judges``): none left, no instance;
* numbers: the bounds leave no number, or no integer, or no multiple of ``multipleOf`` (exact
  rational arithmetic on each number's shortest spelling, as the end check reads it); an
  integral ``multipleOf`` leaves no non-integral number;
* strings: ``minLength > maxLength``; arrays: ``minItems > maxItems``, ``minContains >
  maxContains``, an item (``items``, a tuple position below ``minItems``) or ``contains``
  that has no instance; objects: ``minProperties > maxProperties``, more required names than
  ``maxProperties``, a required property whose subschema has no instance (``properties``, or
  ``additionalProperties`` for an undeclared name where no ``patternProperties`` exist);
* ``allOf``, ``anyOf``, ``oneOf``, local ``$ref`` (draft 4-7: without its siblings);
* ``oneOf`` with two branches every instance of the node matches (a branch of only ``type``
  covering the node's kinds, only ``required`` names the node requires, or nothing): every
  instance matches at least two, so none matches exactly one;
* ``not`` of a schema every value matches (``{}``, ``true``), or of only a ``type``;
* only integers left, at most ``MAX_INTEGERS`` between the node's own bounds, and a ``not``,
  ``if``, union or ``$ref`` beside them: each integer judged like an ``enum`` value.

Not proven (left to the engines and the end check): anything needing ``pattern`` or ``format``
reasoning, ``if``/``then``/``else``, dependencies, ``uniqueItems``, ``propertyNames`` beyond
``false``, object or array ``enum`` values beside other keywords are still judged exactly.
"""

from __future__ import annotations

import decimal
import math
from fractions import Fraction
from typing import Any

from specmask.mask_service.grammar.enum_filter import judged_size, judges, refs_hide_siblings, validator_keywords

NULL, BOOLEAN, OBJECT, ARRAY, STRING, INTEGRAL, FRACTIONAL = (
    "null",
    "boolean",
    "object",
    "array",
    "string",
    "integral number",
    "non-integral number",
)
KINDS = frozenset({NULL, BOOLEAN, OBJECT, ARRAY, STRING, INTEGRAL, FRACTIONAL})
NUMBERS = frozenset({INTEGRAL, FRACTIONAL})
_TYPE_KINDS: dict[str, frozenset[str]] = {
    "null": frozenset({NULL}),
    "boolean": frozenset({BOOLEAN}),
    "object": frozenset({OBJECT}),
    "array": frozenset({ARRAY}),
    "string": frozenset({STRING}),
    "number": NUMBERS,
    "integer": frozenset({INTEGRAL}),
}
MAX_ENUM = 1024  # enum values judged one by one; past this the values' kinds only
MAX_INTEGERS = 4096  # integers judged one by one where only integers are left (as integer_enum)
# Keywords beside bounded integers the other rules do not read: then each integer is judged.
_BESIDE_INTEGERS = frozenset({"not", "if", "oneOf", "anyOf", "allOf", "$ref"})
MAX_DEPTH = 200  # subschemas deep (a $ref chain counts): past it, every kind
MAX_JUDGED = 20_000  # values x subschemas judged per node (enum_filter.judged_size): past it, no judging
MAX_NODES = 100_000  # subschemas visited per document: past it, every kind (a bound on the work)
_REASONS = 3  # reasons kept per node, for the message


class _Verdict:
    """The kinds a subschema's instances may have, and why kinds were removed (JSON pointers)."""

    __slots__ = ("kinds", "why")

    def __init__(self, kinds: frozenset[str], why: tuple[str, ...] = ()) -> None:
        self.kinds = kinds
        self.why = why


_ANY = _Verdict(KINDS)


def why_unsatisfiable(schema: Any) -> str | None:
    """Why ``schema`` has no valid instance, or None when these rules cannot prove it (then it
    may still have none). Run on a document that passed its metaschema."""
    walk = _Walk(schema)
    if not walk.keywords():
        return None
    verdict = walk.node(schema, "#", 0)
    if verdict.kinds:
        return None
    return "; ".join(verdict.why) or "no value passes it"


def _number(value: Any) -> Fraction | None:
    """``value`` as an exact rational, from its shortest spelling (how the end check reads it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return Fraction(decimal.Decimal(repr(value))) if isinstance(value, float) else Fraction(value)


class _Walk:
    def __init__(self, root: Any) -> None:
        self.root = root
        declared = root.get("$schema") if isinstance(root, dict) else None
        declared = declared if isinstance(declared, str) else ""
        self.old = refs_hide_siblings(root)
        self.draft4 = any(f"draft-0{n}" in declared for n in (3, 4))
        # $ref resolution by JSON pointer is what the end check does only without $id/anchors below the root.
        self.refs = _plain_refs(root)
        self.resolving: set[str] = set()
        self.memo: dict[str, _Verdict] = {}
        self.budget = MAX_NODES
        self.validators: frozenset[str] | None = None

    def keywords(self) -> frozenset[str]:
        """The keywords the end check's reading validates with (any other key is an annotation
        there): its validator's, with the bound flags and contains counts it reads inside them."""
        if self.validators is None:
            known = set(validator_keywords(self.root))  # empty (unreadable): no proof at all
            if "minimum" in known:
                known |= {"exclusiveMinimum", "exclusiveMaximum"}  # draft 4: flags read by minimum/maximum
            if "dependentRequired" in known:
                known |= {"minContains", "maxContains"}  # 2019-09 on: read by contains
            self.validators = frozenset(known)
        return self.validators

    def node(self, schema: Any, path: str, depth: int) -> _Verdict:
        if schema is True:
            return _ANY
        if schema is False:
            return _Verdict(frozenset(), (f"{path} is false",))
        self.budget -= 1
        if not isinstance(schema, dict) or depth > MAX_DEPTH or self.budget < 0:
            return _ANY
        schema = {k: v for k, v in schema.items() if k in self.keywords()}  # the rest are annotations here
        kinds = _types(schema.get("type"))
        why: list[str] = []

        def cut(removed: frozenset[str], reason: str) -> None:
            nonlocal kinds
            if kinds & removed:
                kinds = kinds - removed
                if len(why) < _REASONS:
                    why.append(reason)

        def meet(sub: _Verdict, where: str) -> None:
            nonlocal kinds
            if kinds - sub.kinds:
                kinds = kinds & sub.kinds
                why.extend(sub.why[: _REASONS - len(why)])
                if not kinds and not why:
                    why.append(f"{path}: {where} admits no value of the type beside it")

        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = self.resolve(ref, depth)
            if self.old:
                return target  # draft 4-7: a $ref's siblings are ignored
            meet(target, f"$ref {ref}")
        if kinds & NUMBERS:
            self.numbers(schema, path, cut)
        if STRING in kinds and _greater(schema.get("minLength"), schema.get("maxLength")):
            cut(frozenset({STRING}), f"{path}: minLength above maxLength")
        if ARRAY in kinds:
            self.arrays(schema, path, depth, cut)
        if OBJECT in kinds:
            self.objects(schema, path, depth, cut)
        all_of = schema.get("allOf")
        if isinstance(all_of, list):
            for i, sub in enumerate(all_of):
                meet(self.node(sub, f"{path}/allOf/{i}", depth + 1), f"allOf/{i}")
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                verdicts = [self.node(sub, f"{path}/{key}/{i}", depth + 1) for i, sub in enumerate(branches)]
                union = frozenset().union(*(v.kinds for v in verdicts))
                if kinds - union:
                    kinds = kinds & union
                    if not kinds:
                        why.append(f"{path}: no {key} branch admits a value of the type beside it")
                    for v in verdicts:
                        why.extend(v.why[: _REASONS - len(why)])
        if kinds and isinstance(schema.get("oneOf"), list):
            implied = [i for i, sub in enumerate(schema["oneOf"]) if self.implied(sub, schema, kinds)]
            if len(implied) >= 2:
                cut(
                    kinds,
                    f"{path}: every instance matches oneOf branches {implied[0]} and {implied[1]} (each asks "
                    "nothing beyond what the schema beside the oneOf already requires), so none matches exactly one",
                )
        if "not" in schema:
            self.negation(schema["not"], path, cut)
        if kinds and ("enum" in schema or "const" in schema):
            self.values(schema, path, cut)
        elif kinds == {INTEGRAL} and _BESIDE_INTEGERS & schema.keys():
            self.integers(schema, path, cut)
        return _Verdict(kinds, tuple(why))

    def integers(self, schema: dict[str, Any], path: str, cut: Any) -> None:
        """Only integers left, few enough between the bounds: each judged as the end check would."""
        low, high = _number(schema.get("minimum")), _number(schema.get("maximum"))
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            value = _number(schema.get(key))  # a draft 4 flag is no number: the bound stays closed (wider)
            if value is not None and key == "exclusiveMinimum":
                low = value if low is None else max(low, value)
            elif value is not None:
                high = value if high is None else min(high, value)
        if low is None or high is None or high - low > MAX_INTEGERS:
            return
        size = judged_size(self.root, schema, MAX_JUDGED)
        if size is None or size * (high - low + 1) > MAX_JUDGED:
            return  # judging would cost too much: no proof
        try:
            checks = judges(self.root, schema)
            found = any(all(j.is_valid(v) for j in checks) for v in range(math.ceil(low), math.floor(high) + 1))
        except Exception:  # a node jsonschema cannot evaluate: no proof from it
            return
        if not found:
            cut(frozenset({INTEGRAL}), f"{path}: no integer between its bounds passes the keywords beside them")

    def resolve(self, ref: str, depth: int) -> _Verdict:
        if self.refs is None or not (ref == "#" or ref.startswith("#/")) or ref in self.resolving:
            return _ANY  # unknown, or a cycle: no proof through it
        target: Any = self.root
        for raw in ref[2:].split("/") if ref != "#" else ():
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return _ANY
        if ref in self.memo:
            return self.memo[ref]
        self.resolving.add(ref)
        try:
            verdict = self.node(target, ref, depth + 1)
        finally:
            self.resolving.discard(ref)
        # A target's verdict is the same wherever it is referenced (one cut short by a cycle only
        # keeps more kinds): once per target, so shared references cost no more than a tree.
        self.memo[ref] = verdict
        return verdict

    def numbers(self, schema: dict[str, Any], path: str, cut: Any) -> None:
        """Bounds and ``multipleOf``: no number between the bounds, no integer, no multiple."""
        low, low_open = _number(schema.get("minimum")), False
        high, high_open = _number(schema.get("maximum")), False
        for key, bound in (("exclusiveMinimum", "low"), ("exclusiveMaximum", "high")):
            value = schema.get(key)
            if isinstance(value, bool):  # draft 4: a flag on its bound
                if bound == "low":
                    low_open = value and low is not None
                else:
                    high_open = value and high is not None
                continue
            exclusive = _number(value)
            if exclusive is None:
                continue
            if bound == "low" and (low is None or exclusive >= low):
                low, low_open = exclusive, True
            elif bound == "high" and (high is None or exclusive <= high):
                high, high_open = exclusive, True
        if low is not None and high is not None and (low > high or (low == high and (low_open or high_open))):
            cut(NUMBERS, f"{path}: no number lies between its bounds")
            return
        step = _number(schema.get("multipleOf"))
        if step is not None and step > 0:
            if step.denominator == 1:
                cut(frozenset({FRACTIONAL}), f"{path}: an integral multipleOf admits no fraction")
            if low is not None and high is not None and _no_multiple(step, low, low_open, high, high_open):
                cut(NUMBERS, f"{path}: no multiple of {schema['multipleOf']} lies between its bounds")
                return
            # The integral multiples of p/q are the multiples of p.
            if low is not None and high is not None:
                whole = Fraction(step.numerator)
                if _no_multiple(whole, low, low_open, high, high_open):
                    cut(frozenset({INTEGRAL}), f"{path}: no integral multiple of {schema['multipleOf']} in its bounds")
        elif low is not None and high is not None and _no_multiple(Fraction(1), low, low_open, high, high_open):
            cut(frozenset({INTEGRAL}), f"{path}: no integer lies between its bounds")

    def arrays(self, schema: dict[str, Any], path: str, depth: int, cut: Any) -> None:
        """Item counts, and an item every array must hold that has no instance."""
        gone = frozenset({ARRAY})
        min_items = schema.get("minItems", 0)
        min_items = min_items if isinstance(min_items, int) and not isinstance(min_items, bool) else 0
        if _greater(min_items, schema.get("maxItems")):
            cut(gone, f"{path}: minItems above maxItems")
            return
        if _greater(schema.get("minContains"), schema.get("maxContains")):
            cut(gone, f"{path}: minContains above maxContains")
            return
        tuple_key, tuple_items = next(
            ((k, schema[k]) for k in ("prefixItems", "items") if isinstance(schema.get(k), list)), (None, [])
        )
        for i, sub in enumerate(tuple_items[:min_items]):
            if not self.node(sub, f"{path}/{tuple_key}/{i}", depth + 1).kinds:
                cut(gone, f"{path}: item {i} has no valid value, and minItems is {min_items}")
                return
        rest_key = "additionalItems" if tuple_key == "items" else "items"
        rest = schema.get(rest_key)
        rest_needed = min_items > len(tuple_items) and isinstance(rest, (dict, bool))
        if rest_needed and not self.node(rest, f"{path}/{rest_key}", depth + 1).kinds:
            cut(gone, f"{path}: {rest_key} has no valid value, and minItems is {min_items}")
            return
        min_contains = schema.get("minContains", 1)
        if (
            "contains" in schema
            and min_contains != 0
            and not self.node(schema["contains"], f"{path}/contains", depth + 1).kinds
        ):
            cut(gone, f"{path}: contains has no valid value")

    def objects(self, schema: dict[str, Any], path: str, depth: int, cut: Any) -> None:
        """Property counts, and a required property that has no valid value."""
        gone = frozenset({OBJECT})
        if _greater(schema.get("minProperties"), schema.get("maxProperties")):
            cut(gone, f"{path}: minProperties above maxProperties")
            return
        required = schema.get("required")
        names = list(dict.fromkeys(r for r in required if isinstance(r, str))) if isinstance(required, list) else []
        if _greater(len(names), schema.get("maxProperties")):
            cut(gone, f"{path}: {len(names)} required properties but maxProperties {schema['maxProperties']}")
            return
        if names and schema.get("propertyNames") is False:
            cut(gone, f"{path}: properties are required but propertyNames is false")
            return
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        for name in names:
            if name in properties:
                sub, where = properties[name], f"{path}/properties/{_escape(name)}"
            elif "patternProperties" not in schema and "additionalProperties" in schema:
                sub, where = schema["additionalProperties"], f"{path}/additionalProperties"
            else:
                continue
            verdict = self.node(sub, where, depth + 1)
            if not verdict.kinds:
                cut(gone, f"{path}: required property {name!r} has no valid value ({'; '.join(verdict.why)})")
                return

    def implied(self, branch: Any, node: dict[str, Any], kinds: frozenset[str]) -> bool:
        """Whether every instance of ``node`` (of ``kinds``) matches ``branch``: a branch of
        annotations only, only a ``type`` covering ``kinds``, or only ``required`` names that
        ``node`` requires (``required`` asks nothing of a value that is not an object)."""
        if branch is True:
            return True
        if not isinstance(branch, dict):
            return False
        known = self.keywords()
        if not known:
            return False
        asks = {k for k in branch if k in known}
        if not asks <= {"type", "required"}:
            return False
        if "type" in asks and not kinds <= _named_types(branch["type"], self.draft4):
            return False
        if "required" in asks:
            needed = branch["required"]
            have = node.get("required")
            if not isinstance(needed, list) or not isinstance(have, list) or not set(needed) <= set(have):
                return False
        return True

    def negation(self, negated: Any, path: str, cut: Any) -> None:
        """``not`` of a schema every value matches (``true``, annotations only), or of a ``type`` alone."""
        if negated is True or (isinstance(negated, dict) and not (set(negated) & self.keywords())):
            cut(KINDS, f"{path}: not of a schema every value matches")
        elif isinstance(negated, dict) and set(negated) & self.keywords() == {"type"}:
            removed = _named_types(negated["type"], self.draft4)
            cut(removed, f"{path}: not of its own type")

    def values(self, schema: dict[str, Any], path: str, cut: Any) -> None:
        """``enum``/``const``: the kinds of the values that pass the whole node."""
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        if not isinstance(values, list):
            return
        size = judged_size(self.root, schema, MAX_JUDGED)
        if len(values) > MAX_ENUM or size is None or size * len(values) > MAX_JUDGED:
            cut(KINDS - frozenset().union(*(_kind(v) for v in values)), f"{path}: no listed value has its type")
            return
        try:
            checks = judges(self.root, schema)
            kept = [v for v in values if all(j.is_valid(v) for j in checks)]
        except Exception:  # a node jsonschema cannot evaluate: no proof from it
            return
        keyword = "const" if "const" in schema else "enum"
        left = frozenset().union(*(_kind(v) for v in kept))
        if not values:
            reason = f"{path}: enum is empty"
        elif not kept:
            reason = f"{path}: no {keyword} value passes the keywords beside it"
        else:
            reason = f"{path}: every {keyword} value that passes is a {' or '.join(sorted(left))}"
        cut(KINDS - left, reason)


def _types(value: Any) -> frozenset[str]:
    if isinstance(value, str):
        return _TYPE_KINDS.get(value, KINDS)
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        if any(t not in _TYPE_KINDS for t in value):
            return KINDS
        return frozenset().union(*(_TYPE_KINDS[t] for t in value))
    return KINDS


def _named_types(value: Any, draft4: bool) -> frozenset[str]:
    """The kinds a ``type`` surely admits (a subset; the empty set for a name it does not know).
    Draft 3-4's ``integer`` admits no float (``1.0``), so there it surely admits no kind."""
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    out: frozenset[str] = frozenset()
    for name in names:
        if name == "integer" and draft4:
            continue
        if isinstance(name, str):
            out |= _TYPE_KINDS.get(name, frozenset())
    return out


def _kind(value: Any) -> frozenset[str]:
    if value is None:
        return frozenset({NULL})
    if isinstance(value, bool):
        return frozenset({BOOLEAN})
    if isinstance(value, dict):
        return frozenset({OBJECT})
    if isinstance(value, list):
        return frozenset({ARRAY})
    if isinstance(value, str):
        return frozenset({STRING})
    number = _number(value)
    if number is None:
        return KINDS
    return frozenset({INTEGRAL if number.denominator == 1 else FRACTIONAL})


def _greater(low: Any, high: Any) -> bool:
    """Whether two counts (non-negative integers) are both given and ``low > high``."""
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high))
    return bool(ok and low > high)


def _no_multiple(step: Fraction, low: Fraction, low_open: bool, high: Fraction, high_open: bool) -> bool:
    """Whether no multiple of ``step`` (> 0) lies in the interval."""
    first = math.ceil(low / step)
    if low_open and first * step == low:
        first += 1
    last = math.floor(high / step)
    if high_open and last * step == high:
        last -= 1
    return first > last


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _plain_refs(root: Any) -> bool | None:
    """True where local $refs are JSON pointers into this document (no $id or anchor below the
    root, no dynamic reference), else None."""
    stack = [(root, True)]
    while stack:
        node, top = stack.pop()
        if isinstance(node, list):
            stack.extend((sub, False) for sub in node)
        elif isinstance(node, dict):
            if {"$anchor", "$dynamicAnchor", "$recursiveAnchor", "$dynamicRef", "$recursiveRef"} & node.keys():
                return None
            if not top and ("$id" in node or isinstance(node.get("id"), str)):
                return None
            stack.extend((v, False) for k, v in node.items() if k not in ("enum", "const", "default", "examples"))
    return True
