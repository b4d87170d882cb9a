"""Cheap structural limits on a grammar, checked before anything is compiled.

xgrammar's compile cost grows much faster than a schema's size: an object with
10,000 optional integer properties (~300 KB) compiled for many minutes and
reached gigabytes; deep nesting and very large enums are slow too. The
compile worker (compile_pool) bounds what any compile may cost, but a schema
that is plainly out of range is refused here in microseconds, with a message
that names the limit, before it takes a compile slot at all.

The counts are taken over the schema *document* (one iterative walk, no
recursion, so a 100k-deep document cannot overflow the Python stack):

* ``properties``: the sum of ``len(properties)`` over every subschema;
* ``nesting depth``: JSON containers (objects and arrays) inside each other;
* ``enum values``: the largest single ``enum`` list;
* ``bytes``: the UTF-8 size of the grammar text (every grammar kind).

Defaults sit well above the largest real-world schemas in MaskBench (8,176
schemas: at most 850 properties, 63 containers deep, a 1,554-value enum,
62 KB compact), and well below the pathological cases above.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from specmask.common.config_flags import flag
from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import GrammarError

DEFAULT_MAX_SCHEMA_BYTES = 512 * 1024
DEFAULT_MAX_PROPERTIES = 2000
DEFAULT_MAX_NESTING_DEPTH = 128
DEFAULT_MAX_ENUM_VALUES = 4096


class GrammarLimitError(GrammarError):
    """The grammar exceeds a structural limit of this service (INVALID_ARGUMENT: retrying cannot help)."""


@dataclass(frozen=True)
class GrammarLimits:
    """The limits; each field is a flag of `specmask mask-service`."""

    max_schema_bytes: int = field(
        default=DEFAULT_MAX_SCHEMA_BYTES, metadata=flag("UTF-8 bytes of a grammar's text, every grammar kind")
    )
    max_properties: int = field(
        default=DEFAULT_MAX_PROPERTIES,
        metadata=flag("JSON Schema properties, summed over every subschema", name="--max-schema-properties"),
    )
    max_nesting_depth: int = field(
        default=DEFAULT_MAX_NESTING_DEPTH,
        metadata=flag("JSON containers (objects, arrays) inside each other in a schema", name="--max-schema-depth"),
    )
    max_enum_values: int = field(default=DEFAULT_MAX_ENUM_VALUES, metadata=flag("values of the largest enum"))

    def __post_init__(self) -> None:
        for name in ("max_schema_bytes", "max_properties", "max_nesting_depth", "max_enum_values"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class SchemaShape:
    """What the walk measured (also useful in logs)."""

    num_properties: int
    nesting_depth: int
    max_enum_values: int


def measure_schema(schema: Any, limits: GrammarLimits) -> SchemaShape:
    """Walk a parsed JSON document once; stop early (and refuse) as soon as a limit is passed."""
    props = depth = enum = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
            p = value.get("properties")
            if isinstance(p, dict):
                props += len(p)
                if props > limits.max_properties:
                    raise GrammarLimitError(
                        f"schema has more than {limits.max_properties} properties in total "
                        f"(limit max_properties={limits.max_properties})"
                    )
            e = value.get("enum")
            if isinstance(e, list) and len(e) > enum:
                enum = len(e)
                if enum > limits.max_enum_values:
                    raise GrammarLimitError(
                        f"schema has an enum of {enum} values (limit max_enum_values={limits.max_enum_values})"
                    )
        elif isinstance(value, list):
            children = value
        else:
            continue
        depth = max(depth, level)
        if depth > limits.max_nesting_depth:
            raise GrammarLimitError(
                f"schema nests more than {limits.max_nesting_depth} objects/arrays deep "
                f"(limit max_nesting_depth={limits.max_nesting_depth})"
            )
        stack.extend((child, level + 1) for child in children)
    return SchemaShape(props, depth, enum)


def check_limits(spec: GrammarSpec, limits: GrammarLimits) -> SchemaShape | None:
    """Refuse ``spec`` with GrammarLimitError if it is out of range; returns the JSON schema's shape.

    Malformed JSON is left to the backend (which owns that message); only the
    parser's own recursion limit is turned into a nesting refusal here.
    """
    size = len(spec.text.encode("utf-8", "surrogatepass"))
    if size > limits.max_schema_bytes:
        raise GrammarLimitError(
            f"{spec.kind.value} grammar is {size} bytes (limit max_schema_bytes={limits.max_schema_bytes})"
        )
    if spec.kind is not GrammarKind.JSON_SCHEMA:
        return None
    try:
        schema = json.loads(spec.text)
    except RecursionError:
        raise GrammarLimitError(
            f"schema nests too deep to parse (limit max_nesting_depth={limits.max_nesting_depth})"
        ) from None
    except ValueError:
        return None
    return measure_schema(schema, limits)
