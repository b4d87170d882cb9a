"""Which engine may take a JSON schema: constructs xgrammar compiles but does not enforce exactly.

``schema_check`` refuses what xgrammar 0.2.8 would silently ignore when xgrammar
is the only engine. With llguidance beside it, the selector (backends.py) can do
better than refuse: a schema holding one of the constructs below skips xgrammar
and goes to llguidance, which enforces it or refuses it itself. Each entry was
found by ``python -m bench.coverage`` on the JSON-Schema-Test-Suite (draft
2020-12), where xgrammar accepted an instance the schema rejects:

* ``oneOf`` whose branches we cannot prove disjoint (``_provably_disjoint``:
  different types, disjoint ``const``/``enum`` values, or a required
  discriminator property with disjoint values): xgrammar falls back to
  ``anyOf`` semantics (it only logs a warning), so an instance matching two
  branches passes. llguidance keeps ``oneOf`` only when it proves the branches
  disjoint and refuses it otherwise.
* ``$ref`` to an anchor (``#name``, not a JSON pointer): xgrammar warns and
  resolves it to an unconstrained value.
* property names that JSON must escape (``"``, ``\\``, control characters):
  xgrammar's literal for the key does not match the escaped key, so such keys
  fall through to ``additionalProperties``.

Found on maskbench (Github_easy):

* ``format`` on a schema without ``type``: xgrammar ignores the format (any
  value passes, e.g. ``"Invalid Date"`` for date-time); llguidance applies it to
  strings and lets other types through, which is JSON Schema's meaning.
* a standard ``format`` xgrammar does not know (``iri``, ``regex``, ``idn-*``):
  xgrammar treats it as a plain string (``"not-an-iri"``, ``"*"`` passed).
* ``format: date`` / ``date-time``: xgrammar's date allows day 31 in every month
  (``2020-02-31``). Both engines get ``format_patterns``' exact regex instead
  (``schema_rewrite.fold_format``); where it cannot be folded into one pattern
  (beside a ``pattern``, or lengths that cut a variable-length format) the
  schema goes to llguidance, which intersects them.
"""

from __future__ import annotations

from typing import Any

from specmask.mask_service.grammar.format_patterns import FORMAT_REGEXES
from specmask.mask_service.grammar.llguidance_check import STANDARD_FORMATS
from specmask.mask_service.grammar.schema_rewrite import XGRAMMAR_FORMATS, fold_format, types_of

_DATA_KEYS = ("const", "enum", "default", "examples", "example")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


# Formats JSON Schema defines; validators assert them, and maskbench labels instances
# that break them invalid. xgrammar treats the ones it does not know as plain strings
# (iri, regex, ...: "not-an-iri" and "*" passed).
_STANDARD_FORMATS = STANDARD_FORMATS


_NO_VALUE = object()


def _resolve(node: Any, root: Any) -> Any:
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


def _types(node: Any, parent: set[str] | None) -> set[str] | None:
    """JSON types a branch can take (None: unknown); "integer" is folded into "number"."""
    t = node.get("type") if isinstance(node, dict) else None
    values = None
    if isinstance(node, dict) and "const" in node:
        values = [node["const"]]
    elif isinstance(node, dict) and isinstance(node.get("enum"), list):
        values = node["enum"]
    if values is not None:
        found = {_json_type(v) for v in values}
    elif isinstance(t, str):
        found = {t}
    elif isinstance(t, list) and all(isinstance(x, str) for x in t):
        found = set(t)
    else:
        return parent
    found = {"number" if x == "integer" else x for x in found}
    return found & parent if parent is not None else found


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}[type(v)]


def _values(node: Any) -> list[Any] | None:
    if isinstance(node, dict) and "const" in node:
        return [node["const"]]
    if isinstance(node, dict) and isinstance(node.get("enum"), list):
        return node["enum"]
    return None


def _pair_disjoint(a: Any, b: Any, parent: set[str] | None, root: Any) -> bool:
    ta, tb = _types(a, parent), _types(b, parent)
    if ta is not None and tb is not None and not ta & tb:
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not any(x == y and type(x) is type(y) for x in va for y in vb):
        return True
    # Same single type, told apart by non-overlapping length or value ranges (inclusive bounds only).
    for t, lo_key, hi_key in (("string", "minLength", "maxLength"), ("number", "minimum", "maximum")):
        if ta == {t} and tb == {t} and isinstance(a, dict) and isinstance(b, dict):
            lo_a, hi_a, lo_b, hi_b = a.get(lo_key), a.get(hi_key), b.get(lo_key), b.get(hi_key)
            if _below(hi_a, lo_b) or _below(hi_b, lo_a):
                return True
    # Objects told apart by a required property with disjoint const/enum values (a discriminator).
    if isinstance(a, dict) and isinstance(b, dict):
        req = set(a.get("required") or []) & set(b.get("required") or [])
        pa, pb = a.get("properties") or {}, b.get("properties") or {}
        if not (isinstance(pa, dict) and isinstance(pb, dict)):
            return False
        for name in req:
            shared = isinstance(name, str) and name in pa and name in pb
            if shared and _pair_disjoint(_resolve(pa[name], root), _resolve(pb[name], root), None, root):
                return True
    return False


def _below(hi: Any, lo: Any) -> bool:
    num = (int, float)
    return (
        isinstance(hi, num)
        and isinstance(lo, num)
        and not isinstance(hi, bool)
        and not isinstance(lo, bool)
        and hi < lo
    )


def _provably_disjoint(schema: dict[str, Any], root: Any) -> bool:
    """Whether no value can match two ``oneOf`` branches (then ``anyOf`` semantics are exact)."""
    branches = schema["oneOf"]
    if not isinstance(branches, list) or not all(isinstance(b, dict) for b in branches):
        return False
    parent = _types(schema, None) if "type" in schema else None
    resolved = [_resolve(b, root) for b in branches]
    return all(
        _pair_disjoint(resolved[i], resolved[j], parent, root)
        for i in range(len(resolved))
        for j in range(i + 1, len(resolved))
    )


def _needs_escape(name: str) -> bool:
    return any(c in '"\\' or ord(c) < 0x20 for c in name)


def xgrammar_gap(schema: Any, path: str = "#", root: Any = None) -> str | None:
    """Why xgrammar would not enforce this schema exactly (first construct found), or None."""
    if root is None:
        root = schema
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            found = xgrammar_gap(sub, f"{path}/{i}", root)
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    if "oneOf" in schema and not _provably_disjoint(schema, root if root is not None else schema):
        return f"{path}/oneOf: xgrammar enforces 'oneOf' as 'anyOf' unless it proves the branches disjoint"
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in ("#",) and not ref.startswith("#/"):
        return f"{path}/$ref: xgrammar does not resolve the anchor reference {ref!r}"
    fmt = schema.get("format")
    if isinstance(fmt, str):
        if fmt in XGRAMMAR_FORMATS and "type" not in schema:
            return f"{path}/format: xgrammar ignores 'format' on a schema without 'type'"
        if fmt in FORMAT_REGEXES and types_of(schema.get("type")) & {"string"} and fold_format(schema) is None:
            # Folded, the format is format_patterns' exact regex; else xgrammar would use its own
            # (day 31 in every month) or drop the pattern or lengths beside it.
            return f"{path}/format: xgrammar cannot enforce {fmt!r} exactly beside pattern/minLength/maxLength"
        if fmt in _STANDARD_FORMATS and fmt not in XGRAMMAR_FORMATS:
            return f"{path}/format: xgrammar does not enforce the standard format {fmt!r}"
    props = schema.get("properties")
    if isinstance(props, dict):
        for name in props:
            if _needs_escape(name):
                return f"{path}/properties: xgrammar does not match the escaped property name {name!r}"
    for key, value in schema.items():
        if key in _DATA_KEYS:
            continue
        where = f"{path}/{key}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                found = xgrammar_gap(sub, f"{where}/{name}", root)
                if found:
                    return found
        elif isinstance(value, (dict, list)):
            found = xgrammar_gap(value, where, root)
            if found:
                return found
    return None
