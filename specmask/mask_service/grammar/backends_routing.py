"""Which engine may take a JSON schema: constructs xgrammar compiles but does not enforce exactly.

``schema_check`` refuses what xgrammar 0.2.8 would silently ignore when xgrammar
is the only engine. With llguidance beside it, the selector (backends.py) can do
better than refuse: a schema holding one of the constructs below skips xgrammar
and goes to llguidance, which enforces it or refuses it itself. Each entry was
found by ``python -m bench.coverage`` on the JSON-Schema-Test-Suite (draft
2020-12), where xgrammar accepted an instance the schema rejects:

* ``oneOf`` whose branches we cannot prove disjoint (``oneof_disjoint``:
  types, values, ranges, a discriminator, a required property the other
  branch closes out, literal pattern prefixes): xgrammar falls back to
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

from specmask.mask_service.grammar.format_patterns import FORMAT_REGEXES, LENGTH_BOUNDED
from specmask.mask_service.grammar.llguidance_check import STANDARD_FORMATS
from specmask.mask_service.grammar.oneof_disjoint import provably_disjoint
from specmask.mask_service.grammar.schema_rewrite import XGRAMMAR_FORMATS, fold_format, types_of

_DATA_KEYS = ("const", "enum", "default", "examples", "example")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


# Formats JSON Schema defines; validators assert them, and maskbench labels instances
# that break them invalid. xgrammar treats the ones it does not know as plain strings
# (iri, regex, ...: "not-an-iri" and "*" passed).
_STANDARD_FORMATS = STANDARD_FORMATS


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
    if "oneOf" in schema and not provably_disjoint(schema, root, assume_objects=True):
        return f"{path}/oneOf: xgrammar enforces 'oneOf' as 'anyOf' unless it proves the branches disjoint"
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in ("#",) and not ref.startswith("#/"):
        return f"{path}/$ref: xgrammar does not resolve the anchor reference {ref!r}"
    fmt = schema.get("format")
    if isinstance(fmt, str):
        if fmt in XGRAMMAR_FORMATS and "type" not in schema:
            return f"{path}/format: xgrammar ignores 'format' on a schema without 'type'"
        if fmt in LENGTH_BOUNDED and types_of(schema.get("type")) & {"string"}:
            return f"{path}/format: xgrammar enforces a bounded subset of {fmt!r} (a regex with no length)"
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
