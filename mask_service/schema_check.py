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

Known and *not* refused: xgrammar treats ``oneOf`` whose branches it cannot
prove disjoint as ``anyOf`` (it logs a warning); refusing every ``oneOf``
would refuse a large share of real schemas.

Annotation-only keywords (``title``, ``description``, ``examples``,
``default``, unknown ``format`` values) are not validation and are allowed.
"""

from __future__ import annotations

import re
from typing import Any

from mask_service.errors import GrammarError

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


def _check_regex(regex: str, where: str) -> None:
    if _LOOKAROUND_OR_BACKREF.search(regex):
        raise GrammarError(f"{where}: regex {regex!r} uses lookaround or backreferences, which cannot be enforced")


def check_schema(schema: Any, path: str = "#") -> None:
    """Raise GrammarError at the first refused feature; return None if the schema is acceptable."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            check_schema(sub, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in _DATA_KEYS:
            continue
        if key in _REFUSED_KEYWORDS:
            raise GrammarError(f"unsupported JSON Schema keyword at {where}: {_REFUSED_KEYWORDS[key]}")
        if key == "uniqueItems" and value is True:
            raise GrammarError(f"unsupported JSON Schema keyword at {where}: 'uniqueItems: true' is not enforced")
        if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
            raise GrammarError(f"unsupported $ref at {where}: only local references ('#/...') are resolved, got {value!r}")
        if key == "pattern" and isinstance(value, str):
            _check_regex(value, where)
            if "minLength" in schema or "maxLength" in schema:
                raise GrammarError(f"unsupported at {path}: 'pattern' combined with minLength/maxLength is not enforced")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                if key == "patternProperties":
                    _check_regex(name, f"{where}/{name}")
                check_schema(sub, f"{where}/{name}")
            continue
        if isinstance(value, (dict, list)):
            check_schema(value, where)
