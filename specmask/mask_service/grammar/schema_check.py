"""Refuse JSON-Schema features that xgrammar 0.2.8 accepts but does not enforce.

Checked by hand against xgrammar 0.2.8: it compiles schemas using the keywords
below without error yet produces a grammar that ignores them, i.e. output that
does not validate. A constrained-decoding service must never silently
over-allow, so these are refused up front with INVALID_ARGUMENT:

* ``not``, ``if``/``then``/``else``             (boolean schema logic)
* ``uniqueItems: true``                         (needs whole-array memory)
* ``dependencies``, ``dependentRequired``, ``dependentSchemas``
* ``contains``, ``minContains``, ``maxContains``
* ``multipleOf``                                (not expressible as a regular language in general)
* ``unevaluatedProperties``, ``unevaluatedItems``
* ``$ref`` to anything but a local JSON pointer (``#...``); ``$dynamicRef``, ``$recursiveRef``
* ``pattern`` / ``patternProperties`` keys using lookaround or backreferences
* ``pattern`` together with ``minLength``/``maxLength`` (xgrammar drops the length bounds)
* ``allOf`` with more than one subschema (xgrammar compiles it to "any JSON
  value", warning "Support for allOf with multiple options is still ongoing"),
  and ``allOf`` next to other validation keywords (xgrammar keeps only one
  of the two: ``$ref``/``enum``/``anyOf`` win over ``allOf``, ``allOf`` over
  ``type`` and the rest)
* ``$ref``, ``const``, ``enum``, ``anyOf`` or ``oneOf`` next to other
  validation keywords (xgrammar keeps the first of ``$ref`` > ``const`` >
  ``enum`` > ``anyOf``/``oneOf`` and drops the rest), except a ``type`` that is
  redundant (the enum values / the ``$ref`` target all have it) or that
  ``schema_rewrite`` moves into every ``anyOf``/``oneOf`` branch or uses to
  filter an ``enum``; a ``const`` or ``enum`` with no value of that type, or a
  ``type`` no ``anyOf``/``oneOf`` branch can match, is unsatisfiable
* ``required`` names missing from ``properties`` (xgrammar ignores them) next to
  ``patternProperties`` or ``propertyNames``, or with ``additionalProperties:
  false`` (unsatisfiable); otherwise ``schema_rewrite`` adds them to ``properties``
* a ``format`` xgrammar enforces (email, date, date-time, uuid, ...; see
  ``schema_rewrite.XGRAMMAR_FORMATS``) together with ``pattern``/``minLength``/
  ``maxLength`` (xgrammar drops all three)

What can be enforced after a rewrite (JSON-safe patterns, format email /
json-pointer, minLength/maxLength strings without control characters, schemas
without a type) is done by ``schema_rewrite`` after this check.

Known and *not* refused: xgrammar treats ``oneOf`` whose branches it cannot
prove disjoint as ``anyOf`` (it logs a warning); refusing every ``oneOf``
would refuse a large share of real schemas.

A request that opts into checked mode (``GrammarSpec.checked``) gets, instead
of some of these refusals, a relaxation of the schema (``schema_relax``:
``uniqueItems``, ``not``, ``dependencies``/``dependent*``, ``if``/``then``/``else``,
``contains``/``min``/``maxContains`` dropped, ``oneOf`` -> ``anyOf``), compiled
through these same checks, and an end-of-request check against the original.

Annotation-only keywords (``title``, ``description``, ``examples``,
``default``, unknown ``format`` values) are not validation and are allowed.

Before any of that (``check_document``), the schema must be a valid
document of its own draft (``$schema``, default 2020-12): it is checked against
that draft's metaschema (``{"maxLength": -1}`` has no meaning, and xgrammar
would compile it into a grammar whose output breaks it). It may not nest deeper
than ``MAX_SCHEMA_DEPTH`` (the checks here recurse), hold a lone surrogate in
any string (not a character: the engine would emit invalid UTF-8 or fail in
C++) or a number that is not a finite double (``1e400`` parses as infinity).

Objects: xgrammar lets a key that matches a ``patternProperties``
pattern, a ``propertyNames`` schema or an ``additionalProperties`` schema also
be a declared property name, and gives a key that matches two patterns the
schema of either. Refused, because the output could then repeat a declared key
with a value of the wrong schema, or break one of two patterns' schemas:

* ``patternProperties`` next to ``additionalProperties`` other than ``false``
  (its key grammar is "any string", declared names and pattern keys included);
* ``patternProperties`` whose patterns have different subschemas (a key may
  match several; JSON Schema requires all of them, xgrammar enforces one);
* a declared property name that a ``patternProperties`` pattern matches (both
  schemas apply; xgrammar could also emit the name twice);
* ``propertyNames`` next to ``patternProperties`` (xgrammar drops it), next to
  declared properties when extra keys are allowed (its key grammar does not
  exclude declared names), or that a declared name does not satisfy (xgrammar
  emits declared names as written).

What remains possible, and why it is not a lie: a key that no declared name can
take (an ``additionalProperties`` key, whose grammar excludes the declared
names, or a key of the one pattern) may repeat, because a context-free grammar
cannot remember an unbounded set of keys already emitted. Each repetition's
value satisfies the same subschema, so the document validates whichever
duplicate a parser keeps. Declared properties never repeat.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.code_points import bad_code_point
from specmask.mask_service.grammar.llguidance_check import STANDARD_FORMATS
from specmask.mask_service.grammar.schema_rewrite import (
    XGRAMMAR_FORMATS,
    fold_format,
    is_stringish,
    is_subtype,
    push_type,
    types_of,
    value_has_type,
)

logger = logging.getLogger(__name__)

# Deepest nesting of JSON containers (objects/arrays) in a schema document,
# twice MaskBench's deepest (63). The checks and rewrites here, and jsonschema's
# metaschema check, recurse several Python frames per level; a schema within
# this limit that still exhausts the stack (deep ``items`` chains in the
# metaschema check) is refused with the same reason, never with Python's
# "maximum recursion depth exceeded". The service's configurable structural
# limits are checked before this and may be lower.
MAX_SCHEMA_DEPTH = 128
NESTING_TOO_DEEP = f"schema nesting too deep (limit {MAX_SCHEMA_DEPTH} nested objects/arrays)"

_REFUSED_KEYWORDS: dict[str, str] = {
    "not": "'not' is not enforced by the grammar engine",
    "if": "'if/then/else' is not enforced by the grammar engine",
    "then": "'if/then/else' is not enforced by the grammar engine",
    "else": "'if/then/else' is not enforced by the grammar engine",
    "dependencies": "'dependencies' is not enforced by the grammar engine",
    "dependentRequired": "'dependentRequired' is not enforced by the grammar engine",
    "dependentSchemas": "'dependentSchemas' is not enforced by the grammar engine",
    "contains": "'contains' is not enforced by the grammar engine",
    "minContains": "'minContains' is not enforced by the grammar engine",
    "maxContains": "'maxContains' is not enforced by the grammar engine",
    "multipleOf": "'multipleOf' is not enforced by the grammar engine",
    "unevaluatedProperties": "'unevaluatedProperties' is not enforced by the grammar engine",
    "unevaluatedItems": "'unevaluatedItems' is not enforced by the grammar engine",
    "$dynamicRef": "'$dynamicRef' is not supported",
    "$recursiveRef": "'$recursiveRef' is not supported",
}
# Keys whose value maps names -> subschemas.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
# Keys whose value is instance data, never a schema.
_DATA_KEYS = ("const", "enum", "default", "examples", "example")
_LOOKAROUND_OR_BACKREF = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")
# Keywords that constrain an instance (annotations, unknown keywords and $defs do not).
_VALIDATION_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "properties",
        "patternProperties",
        "additionalProperties",
        "unevaluatedProperties",
        "required",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "contains",
        "minContains",
        "maxContains",
        "minItems",
        "maxItems",
        "uniqueItems",
        "minLength",
        "maxLength",
        "pattern",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
    }
)


def _check_regex(regex: str, where: str) -> None:
    problem = bad_code_point(regex)
    if problem:
        raise GrammarError(f"invalid Unicode in the regex at {where}, {problem}")
    if _LOOKAROUND_OR_BACKREF.search(regex):
        raise GrammarError(f"{where}: regex {regex!r} uses lookaround or backreferences, which cannot be enforced")


_WINNERS = ("$ref", "const", "enum", "anyOf", "oneOf")  # the first one present is all xgrammar enforces


def _check_winner(schema: dict[str, Any], path: str, root: Any) -> None:
    winner = next((k for k in _WINNERS if k in schema), None)
    if winner is None:
        return
    siblings = set(_VALIDATION_KEYWORDS & schema.keys()) - {winner, "type"}
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in XGRAMMAR_FORMATS:
        siblings.add("format")
    if siblings:
        raise GrammarError(
            f"unsupported JSON Schema keyword at {path}/{winner}: '{winner}' next to {', '.join(sorted(siblings))} is "
            f"not enforced by the grammar engine (it keeps only '{winner}'); move them into the subschema"
        )
    if "type" not in schema:
        return
    t = schema["type"]
    if winner in ("const", "enum"):
        values = [schema["const"]] if winner == "const" else schema["enum"]
        if isinstance(values, list) and not any(value_has_type(v, t) for v in values):
            raise GrammarError(
                f"unsupported at {path}/{winner}: no '{winner}' value has the 'type' next to it (unsatisfiable schema)"
            )
    elif winner == "$ref":
        if not is_subtype(schema, t, root):
            raise GrammarError(
                f"unsupported JSON Schema keyword at {path}/$ref: 'type' next to '$ref' is not enforced by the grammar "
                "engine (it keeps only '$ref'); move the type into the referenced schema"
            )
    elif isinstance(schema[winner], list):
        push_type(schema[winner], t, root, f"{path}/{winner}")  # raises where the type cannot be moved in


def _check_required(schema: dict[str, Any], path: str) -> None:
    required = schema.get("required")
    if not isinstance(required, list) or not types_of(schema.get("type")) & {"object", None}:
        return
    props = schema.get("properties")
    missing = [r for r in required if isinstance(r, str) and not (isinstance(props, dict) and r in props)]
    if not missing:
        return
    if schema.get("additionalProperties") is False:
        raise GrammarError(
            f"unsupported at {path}/required: {missing[0]!r} is required but not in 'properties' and "
            "additionalProperties is false (unsatisfiable schema)"
        )
    for key in ("patternProperties", "propertyNames"):
        if key in schema:
            raise GrammarError(
                f"unsupported at {path}/required: {missing[0]!r} is required but not in 'properties', which is not "
                f"enforced by the grammar engine next to '{key}'; list it in 'properties'"
            )


def _matches(pattern: str, name: str, where: str) -> bool:
    """Whether a JSON Schema ``pattern`` (ECMA-262, unanchored) matches ``name``.

    Python's ``re.search`` stands in for ECMA-262 (the same as ``jsonschema``);
    xgrammar matches a pattern key in full with anchors ignored, a subset of
    this search. A pattern Python cannot read is assumed to match (refusing is
    the safe side).
    """
    try:
        return re.search(pattern, name) is not None
    except re.error:
        logger.debug("%s: pattern %r unreadable by Python re; assuming it matches %r", where, pattern, name)
        return True


def _check_object_keys(schema: dict[str, Any], path: str, root: Any) -> None:
    """The key-level refusals listed in the module docstring (patternProperties / propertyNames)."""
    props = p if isinstance(p := schema.get("properties"), dict) else {}
    extra = schema.get("additionalProperties", False)  # absent: no extras (strict), or rewritten to false
    patterns = schema.get("patternProperties")
    if isinstance(patterns, dict) and patterns:
        where = f"{path}/patternProperties"
        if extra is not False:
            raise GrammarError(
                f"unsupported at {where}: patternProperties next to additionalProperties other than false is not "
                "enforced by the grammar engine (its extra keys may take any name, a pattern's or a declared one); "
                "set additionalProperties to false or drop patternProperties"
            )
        if len({json.dumps(sub, sort_keys=True) for sub in patterns.values()}) > 1:
            raise GrammarError(
                f"unsupported at {where}: patternProperties with different subschemas per pattern is not enforced "
                "by the grammar engine (a key matching several patterns must satisfy all of them; the engine "
                "enforces one); use one pattern, or the same subschema for every pattern"
            )
        for name in props:
            for pattern in patterns:
                if isinstance(pattern, str) and _matches(pattern, name, where):
                    raise GrammarError(
                        f"unsupported at {where}: declared property {name!r} matches pattern {pattern!r}, which is not "
                        "enforced by the grammar engine (both subschemas apply, and the key could repeat); make the "
                        "pattern exclude the declared names"
                    )
    names = schema.get("propertyNames")
    if "propertyNames" not in schema or names is True or names == {}:
        return
    where = f"{path}/propertyNames"
    if isinstance(patterns, dict) and patterns:
        raise GrammarError(
            f"unsupported at {where}: propertyNames next to patternProperties is not enforced by the grammar engine "
            "(it drops propertyNames); put the constraint into the patterns"
        )
    if props and extra is not False:
        raise GrammarError(
            f"unsupported at {where}: propertyNames next to properties and additionalProperties is not enforced by "
            "the grammar engine (an extra key could repeat a declared name); set additionalProperties to false"
        )
    if props:
        validator = _validator_class(root)(root if isinstance(root, (dict, bool)) else {}).evolve(schema=names)
        for name in props:
            if not validator.is_valid(name):
                raise GrammarError(
                    f"unsupported at {where}: declared property {name!r} does not satisfy propertyNames (the grammar "
                    "engine would emit it anyway); rename it or drop it from properties"
                )


def _check_node(schema: dict[str, Any], path: str, root: Any = None) -> None:
    """Refusals that depend on a schema's keywords together rather than one keyword."""
    _check_winner(schema, path, root)
    _check_required(schema, path)
    if types_of(schema.get("type")) & {"object", None}:
        _check_object_keys(schema, path, root)
    all_of = schema.get("allOf")
    if isinstance(all_of, list):
        if len(all_of) > 1:
            raise GrammarError(
                f"unsupported JSON Schema keyword at {path}/allOf: 'allOf' with {len(all_of)} subschemas is not "
                "enforced by the grammar engine (it would allow any JSON value); merge them into one schema"
            )
        siblings = sorted(_VALIDATION_KEYWORDS & schema.keys())
        if siblings:
            raise GrammarError(
                f"unsupported JSON Schema keyword at {path}/allOf: 'allOf' next to {', '.join(siblings)} is not "
                "enforced by the grammar engine (it enforces one or the other, not both); move them into the subschema"
            )
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in XGRAMMAR_FORMATS and is_stringish(schema) and fold_format(schema) is None:
        dropped = [k for k in ("pattern", "minLength", "maxLength") if k in schema]
        if dropped:
            raise GrammarError(
                f"unsupported at {path}: 'format: {fmt}' combined with {'/'.join(dropped)} is not enforced "
                "by the grammar engine (it drops them for the format)"
            )


def check_schema(schema: Any, path: str = "#", root: Any = None) -> None:
    """Raise GrammarError at the first refused feature; return None if the schema is acceptable."""
    if root is None:
        root = schema
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            check_schema(sub, f"{path}/{i}", root)
        return
    if not isinstance(schema, dict):
        return
    _check_node(schema, path, root)
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in _DATA_KEYS:
            continue
        if key in _REFUSED_KEYWORDS:
            raise GrammarError(f"unsupported JSON Schema keyword at {where}: {_REFUSED_KEYWORDS[key]}")
        if key == "uniqueItems" and value is True:
            raise GrammarError(f"unsupported JSON Schema keyword at {where}: 'uniqueItems: true' is not enforced")
        if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
            raise GrammarError(
                f"unsupported $ref at {where}: only local references ('#/...') are resolved, got {value!r}"
            )
        if key == "pattern" and isinstance(value, str):
            _check_regex(value, where)
            if "minLength" in schema or "maxLength" in schema:
                raise GrammarError(
                    f"unsupported at {path}: 'pattern' combined with minLength/maxLength is not enforced"
                )
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                if key == "patternProperties":
                    _check_regex(name, f"{where}/{name}")
                check_schema(sub, f"{where}/{name}", root)
            continue
        if isinstance(value, (dict, list)):
            check_schema(value, where, root)


def _validator_class(schema: Any) -> Any:
    """The jsonschema validator class of a schema's draft (``$schema``; 2020-12 if absent or unknown)."""
    from jsonschema import Draft202012Validator
    from jsonschema.validators import validator_for

    return validator_for(schema, default=Draft202012Validator)


def _pointer(parts: Any) -> str:
    return "#" + "".join(f"/{p}" for p in parts)


def _lone_surrogate(text: str) -> str | None:
    for ch in text:
        if 0xD800 <= ord(ch) <= 0xDFFF:
            return f"U+{ord(ch):04X}"
    return None


def check_document(schema: Any) -> None:
    """Refuse a schema document that is too deep, holds invalid Unicode or non-finite numbers.

    Iterative (no recursion), so it is safe on any depth ``json.loads`` returns;
    run it before everything else here, which recurses.
    """
    stack: list[tuple[Any, int, str]] = [(schema, 1, "#")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            bad = _lone_surrogate(value)
            if bad:
                raise GrammarError(
                    f"invalid Unicode at {path}: a lone surrogate ({bad}) is not a character and cannot be "
                    "encoded as UTF-8; use a valid code point (a surrogate pair escapes one character above U+FFFF)"
                )
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise GrammarError(
                f"unsupported number at {path}: {value!r} is not a finite number (a literal such as 1e400 "
                "overflows a double); use a value within about +-1.8e308"
            )
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(NESTING_TOO_DEEP)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            where = f"{path}/{key}"
            if isinstance(key, str) and _lone_surrogate(key):
                raise GrammarError(
                    f"invalid Unicode at {path}: the key {key!r} holds a lone surrogate ({_lone_surrogate(key)}), "
                    "which is not a character and cannot be encoded as UTF-8"
                )
            stack.append((child, depth + 1, where))


def _meaningful(error: Any) -> bool:
    """Whether a metaschema error changes what the schema means.

    Repeated values in enum/required/type (older drafts' metaschemas say
    ``uniqueItems``) do not, and the engines handle them: not a refusal, also
    when they are the only reason one branch of a metaschema ``anyOf`` failed.
    """
    if error.validator == "uniqueItems":
        return False
    if error.validator in ("anyOf", "oneOf") and error.context:
        branches: dict[Any, list[Any]] = {}
        for sub in error.context:
            branches.setdefault(sub.relative_schema_path[0], []).append(sub)
        return all(any(_meaningful(sub) for sub in subs) for subs in branches.values())
    return True


def _metaschema_error(cls: Any, schema: Any) -> Any:
    """The most relevant meaningful error of ``schema`` against ``cls``'s metaschema, or None."""
    from jsonschema.exceptions import best_match

    meta_cls = _validator_class(cls.META_SCHEMA)
    try:
        return best_match(e for e in meta_cls(cls.META_SCHEMA).iter_errors(schema) if _meaningful(e))
    except RecursionError:
        raise GrammarError(f"{NESTING_TOO_DEEP}: it nests too deep to check against its metaschema") from None


def check_metaschema(schema: Any) -> None:
    """Refuse a schema that is not a valid document of its draft.

    The draft is its ``$schema``. Without one (or with one jsonschema does not
    know) the dialect is unspecified, so any published draft will do (2020-12
    first, then 2019-09, 7, 6, 4): real schemas without ``$schema`` use
    draft-07's ``items: [...]`` or draft-04's boolean ``exclusiveMinimum``, and
    refusing them would help no one; ``maxLength: -1`` or ``anyOf: []`` is
    invalid in every draft. Validated *without* format checks: the metaschema
    marks ``pattern`` as ``format: regex``, and a format checker would refuse
    ECMA-262 patterns that Python's ``re`` cannot read (``[\\w-.]``), which
    ``json_regex`` handles.
    """
    from jsonschema import Draft4Validator, Draft6Validator, Draft7Validator, Draft201909Validator
    from jsonschema.validators import validator_for

    cls = _validator_class(schema)
    error = _metaschema_error(cls, schema)
    if error is None:
        return
    declared = isinstance(schema, dict) and validator_for(schema, default=None) is not None
    if not declared:
        for other in (Draft201909Validator, Draft7Validator, Draft6Validator, Draft4Validator):
            if _metaschema_error(other, schema) is None:
                return
    draft = cls.META_SCHEMA.get("$id") or cls.META_SCHEMA.get("id") or cls.__name__
    raise GrammarError(
        f"invalid JSON Schema at {_pointer(error.absolute_path)}: {error.message} "
        f"(checked against the metaschema of {draft}{'' if declared else ' and every earlier draft'})"
    )


# Formats JSON Schema defines (draft 2020-12, 7.3). Any other value is an annotation that
# every validator ignores; these assert something, and the end check must be able to verify it.
ASSERTED_FORMATS = STANDARD_FORMATS


def verifiable_formats() -> frozenset[str]:
    """The formats this runtime's ``jsonschema`` can check (its optional checker packages,
    ``jsonschema[format-nongpl]``, decide which; a missing package silently drops one)."""
    import jsonschema

    return frozenset(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)


def unverifiable_formats(schema: Any) -> list[str]:
    """Standard ``format`` values in ``schema`` that the end check could not verify, sorted."""
    known = verifiable_formats()
    found: set[str] = set()
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in ASSERTED_FORMATS and fmt not in known:
            found.add(fmt)
        for key, value in node.items():
            if key in _DATA_KEYS:
                continue
            if key in (*_SCHEMA_MAPS, "dependentSchemas") and isinstance(value, dict):
                stack.extend(value.values())  # names are not keywords
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return sorted(found)


def check_formats(schema: Any) -> None:
    """Refuse a schema whose ``format`` the output check could not verify: waving it through
    would return unchecked text as complete (fail closed, never silently open)."""
    missing = unverifiable_formats(schema)
    if missing:
        raise GrammarError(
            f"format {', '.join(repr(f) for f in missing)} cannot be verified by this server's output check "
            "(its checker is not installed), so it is refused rather than not enforced"
        )
