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
  Likewise object keywords (``required``, ``minProperties``, ``maxProperties``,
  ``propertyNames``, ``patternProperties``) add ``"object"`` and array keywords
  (``minItems``, ``maxItems``, ``additionalItems``) add ``"array"``.
* ``required`` names missing from ``properties`` (xgrammar ignores them): each
  is added to ``properties`` with the ``additionalProperties`` schema (``{}``
  if none), which is the same constraint. (``schema_check`` refuses it next to
  ``patternProperties``/``propertyNames`` or ``additionalProperties: false``.)
* ``type`` next to ``anyOf``/``oneOf`` (xgrammar drops the ``type``): pushed
  into every branch (``T and (A or B)`` is ``(T and A) or (T and B)``, and the
  same for "exactly one of"); a branch's own type is intersected with it, a
  branch's enum/const is filtered to values of that type, and a branch that
  cannot match is dropped. ``type`` next to ``enum`` filters the values.
* Draft-04 boolean ``exclusiveMinimum``/``exclusiveMaximum``: the numeric
  form of the same bound (``_numeric_exclusive_bounds``).
* Non-strict mode only (``strict=False``): ``additionalProperties: false`` is
  added to objects whose extra keys ``patternProperties`` (or ``propertyNames``
  beside declared properties) govern; see ``_close_keys``.

And one repair on xgrammar's output rather than its input:
``minLength``/``maxLength`` strings compile to ``[^"\\\\\\r\\n]{m,n}``, which admits
raw U+0000-U+001F. ``repair_ebnf`` narrows that class to ``[^\\0-\\x1f"\\\\]``,
keeping xgrammar's cheap counted repetition (a ``pattern`` doing the same costs
about maxLength x vocabulary at compile time, far past the compile budget for
a long maximum).
Length is still counted in code points, and escapes stay unavailable inside
length-limited strings (stricter, always valid).
"""

from __future__ import annotations

import math
from typing import Any

from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.format_patterns import FORMAT_REGEXES, LENGTH_BOUNDED, pattern_for
from specmask.mask_service.grammar.json_regex import json_safe_pattern

# Formats xgrammar 0.2.8 turns into a regex (any other value is ignored, i.e. a
# plain string). With one of these, xgrammar ignores pattern/minLength/maxLength.
XGRAMMAR_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
_JSON_CHAR = r'[^"\\\x00-\x1f'  # prefix of a negated class of JSON-safe characters
_POINTER = rf"(?:/(?:{_JSON_CHAR}/~]|~[01])*)*"
# Stricter-or-equal replacements for the formats whose engine regex is not JSON-safe, or is
# looser than what the end check verifies (each caught violation costs the caller a request):
# the standard formats of format_patterns (exact against the end check's checkers, see there)
# and the two JSON pointers.
FORMAT_PATTERNS = {
    **{fmt: f"^{regex}$" for fmt, regex in FORMAT_REGEXES.items()},
    "json-pointer": rf"^{_POINTER}$",
    # No 0 followed by another digit: the end check's reading (jsonschema's checker refuses
    # "100"), stricter than the draft's non-negative integer.
    "relative-json-pointer": rf"^(?:0|[1-9]+0?)(?:#|{_POINTER})$",
}


# Keys that make xgrammar parse a schema as something other than "any value".
_DISPATCH_KEYS = frozenset(
    {
        "type",
        "$ref",
        "const",
        "enum",
        "anyOf",
        "oneOf",
        "allOf",
        "properties",
        "additionalProperties",
        "unevaluatedProperties",
        "items",
        "prefixItems",
        "unevaluatedItems",
    }
)
_STRING_KEYS = ("minLength", "maxLength", "pattern")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_OBJECT_KEYS = ("required", "minProperties", "maxProperties", "propertyNames", "patternProperties")
_ARRAY_KEYS = ("minItems", "maxItems", "additionalItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_DATA_KEYS = ("const", "enum", "default", "examples", "example")


def is_stringish(schema: dict[str, Any]) -> bool:
    """Whether a string instance could be checked by this schema's string keywords."""
    t = schema.get("type")
    return t is None or t == "string" or (isinstance(t, list) and "string" in t)


_JSON_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")


def types_of(t: Any) -> set[Any]:
    """The type names a ``type`` value allows; {None} when it is absent (any type)."""
    if t is None:
        return {None}
    return {x for x in (t if isinstance(t, list) else [t]) if isinstance(x, str)}


def value_has_type(value: Any, t: Any) -> bool:
    """Whether a JSON value is an instance of ``type`` t (a name or list of names)."""
    for name in types_of(t):
        if name is None:
            return True
        if (name == "null" and value is None) or (name == "boolean" and isinstance(value, bool)):
            return True
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name in ("number", "integer") and is_number and (name == "number" or float(value).is_integer()):
            return True
        if (name, type(value)) in (("string", str), ("array", list), ("object", dict)):
            return True
    return False


def _intersect(a: Any, b: Any) -> list[str]:
    out = []
    ta, tb = types_of(a), types_of(b)
    for name in _JSON_TYPES:
        if (name in ta or None in ta or (name == "integer" and "number" in ta)) and (
            name in tb or None in tb or (name == "integer" and "number" in tb)
        ):
            out.append(name)
    if "number" in out and "integer" in out:
        out.remove("integer")
    return out


def resolve_ref(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` points to, or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def only_types(schema: Any, root: Any, depth: int = 0) -> set[str] | None:
    """Type names every instance of schema has (integer counted as number too); None if unknown."""
    if not isinstance(schema, dict) or depth > 20:
        return None
    if "$ref" in schema:
        return only_types(resolve_ref(root, schema["$ref"]), root, depth + 1)
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        return {n for v in values for n in _JSON_TYPES if value_has_type(v, n)}
    branches = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(branches, list):
        sets = [only_types(b, root, depth + 1) for b in branches]
        return None if any(s is None for s in sets) else set().union(*(s for s in sets if s is not None))
    if "type" in schema and None not in types_of(schema["type"]):
        names = types_of(schema["type"])
        return names | ({"number"} if "integer" in names else set())
    return None


def is_subtype(schema: Any, t: Any, root: Any) -> bool:
    """Whether every instance of schema is already of ``type`` t."""
    names = only_types(schema, root)
    allowed = types_of(t)
    if "number" in allowed:
        allowed = allowed | {"integer"}
    return names is not None and (names - {"number"} <= allowed if "integer" in names else names <= allowed)


def push_type(branches: list[Any], t: Any, root: Any, path: str) -> list[Any]:
    """anyOf/oneOf branches each narrowed to ``type`` t (unsatisfiable ones dropped); GrammarError if not possible."""
    out = []
    for i, branch in enumerate(branches):
        if branch is True:
            branch = {}
        if not isinstance(branch, dict):
            continue  # false: matches nothing
        if is_subtype(branch, t, root):
            out.append(branch)
            continue
        if any(k in branch for k in ("$ref", "anyOf", "oneOf", "allOf")):
            raise GrammarError(
                f"unsupported JSON Schema keyword at {path}/{i}: 'type' next to anyOf/oneOf is not enforced by the "
                "grammar engine and cannot be moved into this branch; move the type into every branch"
            )
        branch = dict(branch)
        if "const" in branch or isinstance(branch.get("enum"), list):
            values = [branch["const"]] if "const" in branch else branch["enum"]
            kept = [v for v in values if value_has_type(v, t)]
            if not kept:
                continue
            branch.pop("const", None)
            branch["enum"] = kept
            out.append(branch)
            continue
        narrowed = _intersect(t, branch.get("type"))
        if not narrowed:
            continue
        branch["type"] = narrowed[0] if len(narrowed) == 1 else narrowed
        out.append(branch)
    if not out:
        raise GrammarError(f"unsupported at {path}: no branch can match the 'type' next to it (unsatisfiable schema)")
    return out


def _close_keys(out: dict[str, Any]) -> None:
    """Non-strict mode: an object whose extra keys are governed by patternProperties or propertyNames gets
    ``additionalProperties: false`` when it has none.

    xgrammar's non-strict grammar for such an object lets an extra key take any
    name (a pattern's, or a declared property's) with any value, so
    ``{"a": "x", "a": 5}`` or a pattern key with a value of the wrong type came
    out. With the explicit ``false`` it builds the strict grammar,
    where extra keys are the pattern keys with the pattern's schema: stricter
    than "any extra key", never looser. A schema whose own
    ``additionalProperties`` is false stays false; one with a schema or ``true``
    next to patternProperties is refused by ``schema_check``.
    """
    if "additionalProperties" in out or not types_of(out.get("type")) & {"object", None}:
        return
    has_patterns = isinstance(out.get("patternProperties"), dict) and bool(out["patternProperties"])
    has_names = out.get("propertyNames") not in (None, True, {}) and bool(out.get("properties"))
    if has_patterns or has_names:
        out["additionalProperties"] = False


def _numeric_exclusive_bounds(out: dict[str, Any]) -> None:
    """Draft-04 boolean ``exclusiveMinimum``/``exclusiveMaximum`` in their numeric form (draft 6+).

    ``{"minimum": 5, "exclusiveMinimum": true}`` means > 5, the same as
    ``{"exclusiveMinimum": 5}``; xgrammar only reads the numeric form and failed
    with a bare "Value must be a number". (The metaschema check lets the boolean
    form through only for draft-04 schemas.)
    """
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        flag = out.get(exclusive)
        if not isinstance(flag, bool):
            continue
        del out[exclusive]
        value = out.get(bound)
        if flag and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[exclusive] = out.pop(bound)


def _rewrite_node(
    node: dict[str, Any], path: str, property_names: bool, root: Any = None, strict: bool = True
) -> dict[str, Any]:
    out = dict(node)
    if not strict and not property_names:
        _close_keys(out)
    _numeric_exclusive_bounds(out)
    if not (_DISPATCH_KEYS & out.keys()):
        inferred = []
        if any(k in out for k in _NUMBER_KEYS) and not property_names:
            inferred.append("number")
        if any(k in out for k in _STRING_KEYS):
            inferred.append("string")
        if any(k in out for k in _OBJECT_KEYS) and not property_names:
            inferred.append("object")
        if any(k in out for k in _ARRAY_KEYS) and not property_names:
            inferred.append("array")
        if inferred:
            out["type"] = inferred[0] if len(inferred) == 1 else inferred
    for combinator in ("anyOf", "oneOf"):
        if "type" in out and isinstance(out.get(combinator), list):
            out[combinator] = push_type(out[combinator], out["type"], root, f"{path}/{combinator}")
            del out["type"]
            break
    else:
        if "type" in out and isinstance(out.get("enum"), list) and "const" not in out and "$ref" not in out:
            out["enum"] = [v for v in out["enum"] if value_has_type(v, out["type"])]
    if isinstance(out.get("required"), list) and types_of(out.get("type")) & {"object", None}:
        props = out.get("properties")
        missing = [r for r in out["required"] if isinstance(r, str) and not (isinstance(props, dict) and r in props)]
        if missing:
            extra = out.get("additionalProperties")
            out["properties"] = {
                **(props if isinstance(props, dict) else {}),
                **{r: (extra if isinstance(extra, dict) else {}) for r in missing},
            }
    t = out.get("type")
    if t == "string" or (isinstance(t, list) and "string" in t) or (property_names and t is None):
        # On a schema without a type, xgrammar ignores format (backends_routing sends it on).
        folded = fold_format(out)
        if folded is not None:
            out = folded
    if isinstance(out.get("pattern"), str):
        out["pattern"] = json_safe_pattern(out["pattern"], f"{path}/pattern")
    return out


def _walk(schema: Any, path: str, property_names: bool = False, root: Any = None, strict: bool = True) -> Any:
    if isinstance(schema, list):
        return [_walk(sub, f"{path}/{i}", root=root, strict=strict) for i, sub in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in _rewrite_node(schema, path, property_names, root, strict).items():
        where = f"{path}/{key}"
        if key in _DATA_KEYS or key == "pattern":
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            sub = {}
            for name, s in value.items():
                new_name = json_safe_pattern(name, f"{where}/{name}") if key == "patternProperties" else name
                if new_name in sub:
                    raise GrammarError(
                        f"unsupported patternProperties at {where}: two keys become {new_name!r} when made JSON-safe"
                    )
                sub[new_name] = _walk(s, f"{where}/{name}", root=root, strict=strict)
            out[key] = sub
        elif isinstance(value, (dict, list)):
            out[key] = _walk(value, where, property_names=key == "propertyNames", root=root, strict=strict)
        else:
            out[key] = value
    return out


def rewrite_schema(schema: Any, strict: bool = True) -> Any:
    """The schema with the rewrites above applied (a new object; the input is not modified).

    ``strict`` is the service's strict mode (``GrammarSpec.strict``); in
    non-strict mode ``_close_keys`` applies too. Raises GrammarError where a
    pattern cannot be made JSON-safe.
    """
    return _walk(schema, "#", root=schema, strict=strict)


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


def fold_format(node: dict[str, Any]) -> dict[str, Any] | None:
    """``node`` with its ``format`` (and ``minLength``/``maxLength``) replaced by one ``pattern``
    of exactly the same strings, or None where that is not possible: no such format, a
    ``pattern`` beside it (an intersection of two regexes), or lengths that cut a format of
    variable length (``format_patterns.pattern_for``). Strings only, as both keywords are."""
    fmt = node.get("format")
    if not isinstance(fmt, str) or fmt not in FORMAT_PATTERNS or "pattern" in node:
        return None
    lo, hi = node.get("minLength", 0), node.get("maxLength", math.inf)
    if fmt in FORMAT_REGEXES:
        if not (isinstance(lo, int) and isinstance(hi, (int, float))):
            return None
        pattern = pattern_for(fmt, lo, hi)
    else:  # the JSON pointers: no lengths folded in
        pattern = FORMAT_PATTERNS[fmt] if "minLength" not in node and "maxLength" not in node else None
    if pattern is None:
        return None
    out = {k: v for k, v in node.items() if k not in ("format", "minLength", "maxLength")}
    out["pattern"] = pattern
    return out


# Formats whose engine grammar (xgrammar's and llguidance's built-in regexes) is looser than
# or different from what the end check verifies: both engines get format_patterns' regex.
TIGHTENED_FORMATS = tuple(FORMAT_REGEXES)


def _tighten_node(node: dict[str, Any]) -> dict[str, Any]:
    """llguidance: a standard format as format_patterns' regex. Folded with the lengths where
    exact (``fold_format``); else the regex beside the lengths (llguidance intersects a
    pattern with lengths); beside a caller's pattern, an ``allOf`` branch (llguidance
    intersects the two regexes) on a plain string schema, else the format is left to llguidance."""
    fmt = node.get("format")
    if fmt not in TIGHTENED_FORMATS or not types_of(node.get("type")) & {"string", None}:
        return node
    if fmt in LENGTH_BOUNDED:
        return _length_bounded(node, fmt)
    folded = fold_format(node)
    if folded is not None:
        return folded
    out = {k: v for k, v in node.items() if k != "format"}
    if "pattern" not in node:
        out["pattern"] = FORMAT_PATTERNS[fmt]
        return out
    if node.get("type") != "string":
        return node
    all_of = node.get("allOf")
    out["allOf"] = [*(all_of if isinstance(all_of, list) else []), {"pattern": FORMAT_PATTERNS[fmt]}]
    return out


def _length_bounded(node: dict[str, Any], fmt: str) -> dict[str, Any]:
    """llguidance: a LENGTH_BOUNDED format as its regex beside its maximum length (the
    caller's maxLength where smaller), in an ``allOf`` branch beside a caller's pattern."""
    regex, longest = LENGTH_BOUNDED[fmt]
    out = {k: v for k, v in node.items() if k != "format"}
    bound: dict[str, Any] = {"pattern": f"^{regex}$", "maxLength": longest}
    if "pattern" not in node:
        out.update(bound)
        given = node.get("maxLength")
        if isinstance(given, (int, float)) and not isinstance(given, bool) and given < longest:
            out["maxLength"] = given
        return out
    if node.get("type") != "string":
        return node
    all_of = node.get("allOf")
    out["allOf"] = [*(all_of if isinstance(all_of, list) else []), bound]
    return out


def tighten_formats(schema: Any) -> Any:
    """A copy of ``schema`` where each string schema's ``format`` in TIGHTENED_FORMATS becomes
    format_patterns' regex (``_tighten_node``): the same language as the end check's, or a smaller one."""
    if isinstance(schema, list):
        return [tighten_formats(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: tighten_formats(sub) for name, sub in value.items()}
        else:
            out[key] = tighten_formats(value)
    return _tighten_node(out)
