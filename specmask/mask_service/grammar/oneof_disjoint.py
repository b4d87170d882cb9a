"""When a ``oneOf`` is an ``anyOf``: proofs that no value matches two of its branches.

``oneOf`` asks for exactly one matching branch. Where no value can match two
branches, "exactly one" and "at least one" are the same language, so the
``oneOf`` can be compiled as ``anyOf``, which both engines enforce (xgrammar
reads every ``oneOf`` as ``anyOf``; llguidance refuses one it cannot prove
disjoint itself). A proof must be sound: a pair of branches is called disjoint
only when a rule below shows that no JSON value satisfies both; anything not
understood (an unresolvable ``$ref``, an unknown keyword's effect) proves
nothing. Rules, each checked on a pair of branches (``$ref`` resolved):

* ``types``: their ``type`` sets (or the types of their ``const``/``enum``
  values) do not meet, within the parent's ``type``.
* ``values``: both are ``const``/``enum`` and no value is in both.
* ``ranges``: the same single type (string or number), with length or value
  ranges that do not overlap (``minimum``/``maximum``,
  ``exclusiveMinimum``/``exclusiveMaximum``, ``minLength``/``maxLength``).
* ``discriminator``: a property both require (in the branch or on the
  ``oneOf``'s own object) whose two subschemas are disjoint by these rules
  (a ``const``/``enum`` tag such as ``"type": {"const": "circle"}``).
* ``closed_required``: one branch requires a property the other cannot have:
  the other closes its object (``additionalProperties: false``, no
  ``patternProperties``) without declaring it, or declares it ``false``.
* ``patterns``: two string branches whose ``pattern`` is a literal prefix
  (``^abc``) and neither prefix starts the other: no string starts with both.

``exclusive_rule(schema, root)`` says which rules proved a ``oneOf`` (None when
some pair is not proven); ``bench/oneof_rules.py`` counts them on data.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

_NO_VALUE = object()
_NUMBER = (int, float)


def resolve(node: Any, root: Any) -> Any:
    """``node`` with local ``#/...`` references followed (a chain of up to 16), else itself."""
    for _ in range(16):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not (isinstance(ref, str) and ref.startswith("#/")):
            return node
        target = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part, _NO_VALUE) if isinstance(target, dict) else _NO_VALUE
        if target is _NO_VALUE:
            return node
        node = target
    return node


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, _NUMBER):
        return "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}[type(v)]


def _values(node: Any) -> list[Any] | None:
    if isinstance(node, dict) and "const" in node:
        return [node["const"]]
    if isinstance(node, dict) and isinstance(node.get("enum"), list):
        return list(node["enum"])
    return None


# Keywords that make xgrammar compile a schema without ``type`` as an object (stricter than JSON
# Schema, where they constrain objects and let other values through).
_OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties")


def types(node: Any, parent: set[str] | None, assume_objects: bool = False) -> set[str] | None:
    """JSON types a branch can take (None: unknown); "integer" is folded into "number".

    ``assume_objects``: what xgrammar emits for it (object keywords without a ``type`` give
    only objects); never what the branch matches, which is JSON Schema's reading."""
    t = node.get("type") if isinstance(node, dict) else None
    values = _values(node)
    if values is not None:
        found = {_json_type(v) for v in values}
    elif isinstance(t, str):
        found = {t}
    elif isinstance(t, list) and all(isinstance(x, str) for x in t):
        found = set(t)
    elif assume_objects and isinstance(node, dict) and any(k in node for k in _OBJECT_KEYWORDS):
        found = {"object"}
    else:
        return parent
    found = {"number" if x == "integer" else x for x in found}
    return found & parent if parent is not None else found


def _same(x: Any, y: Any) -> bool:
    """JSON equality (1 == 1.0; True is not 1)."""
    if isinstance(x, bool) or isinstance(y, bool):
        return type(x) is type(y) and x == y
    if isinstance(x, _NUMBER) and isinstance(y, _NUMBER):
        return bool(x == y)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y, strict=True))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, _NUMBER) and not isinstance(v, bool) else None


def _interval(node: dict[str, Any], t: str) -> tuple[float, bool, float, bool]:
    """(low, low open, high, high open) of a branch's numbers or string lengths."""
    lo, lo_open, hi, hi_open = -float("inf"), False, float("inf"), False
    if t == "string":
        lo = _number(node.get("minLength")) or 0.0
        found = _number(node.get("maxLength"))
        hi = found if found is not None else hi
        return lo, False, hi, False
    for key, open_ in (("minimum", False), ("exclusiveMinimum", True)):
        v = _number(node.get(key))
        if v is not None and (v > lo or (v == lo and open_)):
            lo, lo_open = v, open_
    for key, open_ in (("maximum", False), ("exclusiveMaximum", True)):
        v = _number(node.get(key))
        if v is not None and (v < hi or (v == hi and open_)):
            hi, hi_open = v, open_
    return lo, lo_open, hi, hi_open


def _apart(a: tuple[float, bool, float, bool], b: tuple[float, bool, float, bool]) -> bool:
    """Whether two intervals share no point."""
    return a[2] < b[0] or (a[2] == b[0] and (a[3] or b[1])) or b[2] < a[0] or (b[2] == a[0] and (b[3] or a[1]))


_LITERAL_PREFIX = re.compile(r"\^([A-Za-z0-9_:/@ -]+)")


def _prefix(pattern: Any) -> str | None:
    """The literal text every match of an anchored pattern starts with, or None.

    Only ``^`` followed by plain characters counts; a quantifier right after the
    run makes its last character optional, so that one is dropped; a ``|``
    anywhere could start another alternative, so none."""
    if not isinstance(pattern, str) or "|" in pattern:
        return None
    m = _LITERAL_PREFIX.match(pattern)
    if not m:
        return None
    text = m.group(1)
    if pattern[m.end() : m.end() + 1] in ("?", "*", "{"):
        text = text[:-1]
    return text or None


def _required(node: Any, parent: dict[str, Any] | None) -> set[str]:
    names = set()
    for source in (node, parent):
        req = source.get("required") if isinstance(source, dict) else None
        if isinstance(req, list):
            names |= {r for r in req if isinstance(r, str)}
    return names


def _cannot_have(node: dict[str, Any], name: str) -> bool:
    props = node.get("properties")
    if isinstance(props, dict) and name in props:
        return props[name] is False
    patterns = node.get("patternProperties")
    return node.get("additionalProperties") is False and not (isinstance(patterns, dict) and patterns)


def _rule_types(a: Any, b: Any, ctx: _Context) -> bool:
    ta, tb = ctx.types(a), ctx.types(b)
    return ta is not None and tb is not None and not ta & tb


def _rule_values(a: Any, b: Any, ctx: _Context) -> bool:
    va, vb = _values(a), _values(b)
    return va is not None and vb is not None and not any(_same(x, y) for x in va for y in vb)


def _rule_ranges(a: Any, b: Any, ctx: _Context) -> bool:
    ta, tb = ctx.types(a), ctx.types(b)
    for t in ("string", "number"):
        same = ta == {t} and tb == {t} and isinstance(a, dict) and isinstance(b, dict)
        if same and _apart(_interval(a, t), _interval(b, t)):
            return True
    return False


def _rule_discriminator(a: Any, b: Any, ctx: _Context) -> bool:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    parent_props = ctx.parent.get("properties") if isinstance(ctx.parent, dict) else None
    parent_props = parent_props if isinstance(parent_props, dict) else {}
    if not (isinstance(pa, dict) and isinstance(pb, dict)) or not _objects_only(a, b, ctx):
        return False
    for name in _required(a, ctx.parent) & _required(b, ctx.parent):
        sa, sb = pa.get(name, parent_props.get(name)), pb.get(name, parent_props.get(name))
        if sa is None or sb is None:
            continue
        sub = _Context(ctx.root, None, None, ctx.depth + 1, ctx.assume_objects)
        if ctx.depth < 4 and pair_rule(resolve(sa, ctx.root), resolve(sb, ctx.root), sub) is not None:
            return True
    return False


def _objects_only(a: dict[str, Any], b: dict[str, Any], ctx: _Context) -> bool:
    """Whether every value either branch yields is an object: ``required`` and ``properties``
    say nothing about other values, so a string would match two branches told apart by them.
    With ``assume_objects`` (xgrammar) a branch with object keywords yields only objects, and
    an object that matches both branches is what the object rules exclude."""
    return all(types(x, ctx.parent_types, ctx.assume_objects) == {"object"} for x in (a, b))


def _rule_closed_required(a: Any, b: Any, ctx: _Context) -> bool:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    if not _objects_only(a, b, ctx):
        return False
    return any(_cannot_have(b, n) for n in _required(a, ctx.parent)) or any(
        _cannot_have(a, n) for n in _required(b, ctx.parent)
    )


def _rule_patterns(a: Any, b: Any, ctx: _Context) -> bool:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    if ctx.types(a) != {"string"} or ctx.types(b) != {"string"}:
        return False
    xa, xb = _prefix(a.get("pattern")), _prefix(b.get("pattern"))
    return xa is not None and xb is not None and not xa.startswith(xb) and not xb.startswith(xa)


class _Context:
    """What a pair is judged in: the root (for ``$ref``), the ``oneOf``'s own schema and its
    types, the nesting of discriminator proofs, and whether object keywords imply objects."""

    __slots__ = ("assume_objects", "depth", "parent", "parent_types", "root")

    def __init__(
        self,
        root: Any,
        parent: dict[str, Any] | None,
        parent_types: set[str] | None,
        depth: int,
        assume_objects: bool = False,
    ) -> None:
        self.root = root
        self.parent = parent
        self.parent_types = parent_types
        self.depth = depth
        self.assume_objects = assume_objects

    def types(self, node: Any) -> set[str] | None:
        """The branch's types as JSON Schema reads it (the other branch's language is the
        schema's, whatever an engine emits for this one)."""
        return types(node, self.parent_types)


# Rule name -> check, tried in this order (the first that proves a pair is the one counted).
RULES = {
    "types": _rule_types,
    "values": _rule_values,
    "ranges": _rule_ranges,
    "discriminator": _rule_discriminator,
    "closed_required": _rule_closed_required,
    "patterns": _rule_patterns,
}


def pair_rule(a: Any, b: Any, ctx: _Context) -> str | None:
    """The first rule proving that no value matches both branches, or None."""
    for name, rule in RULES.items():
        if rule(a, b, ctx):
            return name
    return None


def exclusive_rules(
    schema: dict[str, Any], root: Any, rules: tuple[str, ...] | None = None, assume_objects: bool = False
) -> set[str] | None:
    """The rules that prove ``schema``'s ``oneOf`` branches pairwise disjoint (empty for one
    branch), or None when some pair is not proven. ``rules``: only these (default: all).
    ``assume_objects``: judged as xgrammar compiles the branches (``types``)."""
    branches = schema.get("oneOf")
    if not isinstance(branches, list) or not all(isinstance(b, dict) for b in branches):
        return None
    # A parent's type is pushed into typeless branches (schema_rewrite.push_type), so object
    # keywords imply objects only where the parent has none.
    assume_objects = assume_objects and "type" not in schema
    parent_types = types(schema, None) if "type" in schema else None
    ctx = _Context(root, schema, parent_types, 0, assume_objects)
    resolved = [resolve(b, root) for b in branches]
    used: set[str] = set()
    for i in range(len(resolved)):
        for j in range(i + 1, len(resolved)):
            name = None
            for rule_name, rule in RULES.items():
                if (rules is None or rule_name in rules) and rule(resolved[i], resolved[j], ctx):
                    name = rule_name
                    break
            if name is None:
                return None
            used.add(name)
    return used


def provably_disjoint(schema: dict[str, Any], root: Any, assume_objects: bool = False) -> bool:
    """Whether no value can match two of ``schema``'s ``oneOf`` branches (then ``anyOf`` is exact)."""
    return exclusive_rules(schema, root, assume_objects=assume_objects) is not None


def oneof_as_anyof(schema: Any, root: Any = None) -> Any:
    """A copy of ``schema`` where every ``oneOf`` proven disjoint is an ``anyOf`` (beside an
    ``anyOf`` already there, an ``allOf`` branch holding it: the same conjunction)."""
    if root is None:
        root = schema
        if "/oneOf" in json.dumps(schema):  # a $ref into a oneOf would lose its target: leave it all
            return schema
    if isinstance(schema, list):
        return [oneof_as_anyof(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("const", "enum", "default", "examples", "example"):
            out[key] = value
        elif key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas") and isinstance(
            value, dict
        ):
            out[key] = {name: oneof_as_anyof(sub, root) for name, sub in value.items()}
        else:
            out[key] = oneof_as_anyof(value, root)
    exclusive = None if "oneOf" not in schema else exclusive_required(schema["oneOf"])
    if "oneOf" in schema and (exclusive is not None or provably_disjoint(schema, root)):
        branches = out.pop("oneOf") if exclusive is None else exclusive
        out.pop("oneOf", None)
        if "anyOf" not in out:
            out["anyOf"] = branches
        else:
            all_of = out.get("allOf")
            out["allOf"] = [*(all_of if isinstance(all_of, list) else []), {"anyOf": branches}]
    return out


# Most ``anyOf`` choices one rewritten branch may get (names it must lack, one per other set).
_MAX_CHOICES = 16
# Keywords a ``required``-only branch may carry besides ``required`` (annotations).
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default"})


def exclusive_required(branches: Any) -> list[dict[str, Any]] | None:
    """``anyOf`` branches equal to a ``oneOf`` of ``required``-only branches, or None.

    ``oneOf: [{required: A}, {required: B}]`` ("exactly one of these key sets")
    has no disjoint branches, yet is exact as ``anyOf`` of each branch with the
    others negated: an object that has A and lacks one name of each other set
    (``properties: {name: false}``; with two or more candidates, an ``anyOf`` of
    them, several such sets multiplied out into one ``anyOf`` of at most 16). A
    branch whose set contains another's can never be the only match and is left
    out. ``type: object`` on each: a non-object matches
    every branch of the original, so the original refuses it (two or more
    branches), and the rewrite must too."""
    if not isinstance(branches, list) or len(branches) < 2:
        return None
    sets: list[list[str]] = []
    for b in branches:
        if not (isinstance(b, dict) and isinstance(b.get("required"), list) and set(b) - {"required"} <= _ANNOTATIONS):
            return None
        if not all(isinstance(r, str) for r in b["required"]):
            return None
        sets.append(list(dict.fromkeys(b["required"])))
    out: list[dict[str, Any]] = []
    for i, mine in enumerate(sets):
        branch: dict[str, Any] = {"type": "object", "required": mine}
        absent: dict[str, Any] = {}
        either: list[list[str]] = []
        possible = True
        for j, other in enumerate(sets):
            if j == i:
                continue
            missing = [n for n in other if n not in mine]
            if not missing:
                possible = False  # having mine means having other's too: two matches
                break
            if len(missing) == 1:
                absent[missing[0]] = False
            else:
                either.append(missing)
        if not possible:
            continue
        if absent:
            branch["properties"] = absent
        if either:
            # One anyOf over the choices' product: llguidance reads an anyOf inside allOf
            # beside required more narrowly than JSON Schema (it refused valid objects).
            choices = list(itertools.product(*either))
            if len(choices) > _MAX_CHOICES:
                return None
            branch["anyOf"] = [{"properties": dict.fromkeys(combo, False)} for combo in choices]
        out.append(branch)
    return out or None
