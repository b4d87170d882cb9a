"""Rewrite JSON Schemas (and xgrammar's grammar for them) into ones xgrammar 0.2.8 enforces.

Runs after ``schema_check`` has refused what cannot be enforced at all. Every
rewrite here gives a grammar that is *equal or stricter* than the schema (each
accepted document validates against the original schema); none loosens it.
Checked by hand against xgrammar 0.2.8 and by tests/mask_service/test_mask_schema_rewrite.py:

* ``pattern`` and ``patternProperties`` keys: re-emitted JSON-safe by
  ``json_regex.json_safe_pattern`` (xgrammar can emit raw ``"``, ``\\`` and
  control characters for some patterns).
* ``format``: ``email`` (xgrammar's quoted local part admits invalid JSON
  escapes such as ``\\a``), ``json-pointer`` and ``relative-json-pointer``
  (raw control characters, ``"`` and ``\\``) become an equivalent-or-stricter
  JSON-safe ``pattern``. The other formats xgrammar knows use JSON-safe
  characters only.
* Schemas with no ``type`` that xgrammar would treat as "any value" although
  they carry string or number keywords (``{"minLength": 3}``,
  ``{"minimum": 0}``): xgrammar drops those keywords, so the type they
  constrain is added (``"string"``, ``"number"`` or both), which is stricter.

And one repair on xgrammar's output rather than its input:
``minLength``/``maxLength`` strings compile to ``[^"\\\\\\r\\n]{m,n}``, which admits
raw U+0000-U+001F. ``repair_ebnf`` narrows that class to ``[^\\0-\\x1f"\\\\]``,
keeping xgrammar's cheap counted repetition (a ``pattern`` doing the same costs
about maxLength x vocabulary at compile time: ~20 s for maxLength 4096 on GPT-2).
Length is still counted in code points, and escapes stay unavailable inside
length-limited strings (stricter, always valid).
"""

from __future__ import annotations

from typing import Any

from mask_service.errors import GrammarError
from mask_service.json_regex import json_safe_pattern

# Formats xgrammar 0.2.8 turns into a regex (any other value is ignored, i.e. a
# plain string). With one of these, xgrammar ignores pattern/minLength/maxLength.
XGRAMMAR_FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
        "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    }
)
_JSON_CHAR = r'[^"\\\x00-\x1f'  # prefix of a negated class of JSON-safe characters
_ATEXT = r"[A-Za-z0-9_!#$%&'*+/=?^`{|}~-]"
_DOMAIN = r"[A-Za-z0-9](?:[-A-Za-z0-9]*[A-Za-z0-9])?(?:\.[A-Za-z0-9][-A-Za-z0-9]*[A-Za-z0-9])*"
_POINTER = rf"(?:/(?:{_JSON_CHAR}/~]|~[01])*)*"
# Stricter-or-equal replacements for the formats whose xgrammar regex is not JSON-safe.
FORMAT_PATTERNS = {
    # xgrammar's email regex minus the quoted-string local part.
    "email": rf"^{_ATEXT}+(?:\.{_ATEXT}+)*@{_DOMAIN}$",
    "json-pointer": rf"^{_POINTER}$",
    "relative-json-pointer": rf"^(?:0|[1-9][0-9]*)(?:#|{_POINTER})$",
}

# Keys that make xgrammar parse a schema as something other than "any value".
_DISPATCH_KEYS = frozenset(
    {
        "type", "$ref", "const", "enum", "anyOf", "oneOf", "allOf", "properties", "additionalProperties",
        "unevaluatedProperties", "items", "prefixItems", "unevaluatedItems",
    }
)
_STRING_KEYS = ("minLength", "maxLength", "pattern")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_DATA_KEYS = ("const", "enum", "default", "examples", "example")


def is_stringish(schema: dict[str, Any]) -> bool:
    """Whether a string instance could be checked by this schema's string keywords."""
    t = schema.get("type")
    return t is None or t == "string" or (isinstance(t, list) and "string" in t)


def _rewrite_node(node: dict[str, Any], path: str, property_names: bool) -> dict[str, Any]:
    out = dict(node)
    if not (_DISPATCH_KEYS & out.keys()):
        inferred = []
        if any(k in out for k in _NUMBER_KEYS) and not property_names:
            inferred.append("number")
        if any(k in out for k in _STRING_KEYS):
            inferred.append("string")
        if inferred:
            out["type"] = inferred[0] if len(inferred) == 1 else inferred
    t = out.get("type")
    if t == "string" or (isinstance(t, list) and "string" in t) or (property_names and t is None):
        fmt = out.get("format")  # on a schema without a type, xgrammar ignores format
        if isinstance(fmt, str) and fmt in FORMAT_PATTERNS and "pattern" not in out:
            del out["format"]
            out["pattern"] = FORMAT_PATTERNS[fmt]
    if isinstance(out.get("pattern"), str):
        out["pattern"] = json_safe_pattern(out["pattern"], f"{path}/pattern")
    return out


def _walk(schema: Any, path: str, property_names: bool = False) -> Any:
    if isinstance(schema, list):
        return [_walk(sub, f"{path}/{i}") for i, sub in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in _rewrite_node(schema, path, property_names).items():
        where = f"{path}/{key}"
        if key in _DATA_KEYS or key == "pattern":
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            sub = {}
            for name, s in value.items():
                new_name = json_safe_pattern(name, f"{where}/{name}") if key == "patternProperties" else name
                if new_name in sub:
                    raise GrammarError(f"unsupported patternProperties at {where}: two keys become {new_name!r} when made JSON-safe")
                sub[new_name] = _walk(s, f"{where}/{name}")
            out[key] = sub
        elif isinstance(value, (dict, list)):
            out[key] = _walk(value, where, property_names=key == "propertyNames")
        else:
            out[key] = value
    return out


def rewrite_schema(schema: Any) -> Any:
    """The schema with the rewrites above applied (a new object; the input is not modified).

    Raises GrammarError where a pattern cannot be made JSON-safe.
    """
    return _walk(schema, "#")


# xgrammar 0.2.8 prints the character rule of a minLength/maxLength string as
# `name ::= (([^\"\\\r\n]))`; the replacement also excludes U+0000-U+001F.
_LENGTH_CHAR_CLASS = '(([^\\"\\\\\\r\\n]))'
_SAFE_CHAR_CLASS = '(([^\\0-\\x1f\\"\\\\]))'


def needs_ebnf_repair(ebnf: str) -> bool:
    return _LENGTH_CHAR_CLASS in ebnf


def repair_ebnf(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema with the length-limited string character class made JSON-safe."""
    lines = []
    for line in ebnf.splitlines():
        name, sep, body = line.partition(" ::= ")
        if sep and body == _LENGTH_CHAR_CLASS:
            line = f"{name} ::= {_SAFE_CHAR_CLASS}"
        lines.append(line)
    return "\n".join(lines) + "\n"
