"""Deterministic synthetic JSON documents generated from the toy schemas.

Documents are compact (`separators=(",", ":")`), the same bytes the grammar's
default whitespace produces, and each training example is
`prompt_for(name) + document` followed by the EOS token (added at tokenisation).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specmask.gpu_worker.toy.schemas import Schema, prompt_for
from specmask.gpu_worker.toy.values import string_generator

# The corpus's JSON separators. NB: xgrammar's compile_json_schema with
# any_whitespace=False and separators=None defaults to (", ", ": "), NOT this;
# grammars for the toy models must pass separators=JSON_SEPARATORS (or allow
# any whitespace) or every document the models learned is rejected at its first ",".
JSON_SEPARATORS: tuple[str, str] = (",", ":")

# Probability that an optional property / nullable value is emitted / non-null.
_P_OPTIONAL_PRESENT = 0.7
_P_NOT_NULL = 0.7


@dataclass(frozen=True)
class Example:
    schema_name: str
    prompt: str  # text before the document
    document: str  # compact JSON; the model must emit this, then EOS


def generate_value(schema: Schema, rng: random.Random, schema_name: str, prop: str = "") -> Any:
    """One value valid under `schema` (the subset of JSON Schema used in schemas.py)."""
    if "anyOf" in schema:
        options = schema["anyOf"]
        non_null = [o for o in options if o.get("type") != "null"]
        has_null = len(non_null) < len(options)
        if has_null and rng.random() >= _P_NOT_NULL:
            return None
        return generate_value(rng.choice(non_null), rng, schema_name, prop)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        required = set(schema.get("required", ()))
        out: dict[str, Any] = {}
        # Schema order: xgrammar emits properties in this order.
        for key, sub in schema["properties"].items():
            if key in required or rng.random() < _P_OPTIONAL_PRESENT:
                out[key] = generate_value(sub, rng, schema_name, key)
        return out
    if kind == "array":
        n = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 4))
        return [generate_value(schema["items"], rng, schema_name, prop) for _ in range(n)]
    if kind == "integer":
        return rng.randint(schema.get("minimum", 0), schema.get("maximum", 1000))
    if kind == "number":
        lo, hi = schema.get("minimum", 0.0), schema.get("maximum", 1000.0)
        # Two decimals, clamped: rounding must not leave the [lo, hi] range.
        return min(max(round(rng.uniform(lo, hi), 2), lo), hi)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        return string_generator(schema_name, prop)(rng)
    if kind == "null":
        return None
    raise ValueError(f"unsupported schema node in toy corpus: {schema!r}")


def dumps_compact(obj: Any) -> str:
    # ensure_ascii=False: UTF-8 text such as "Müller" stays as the bytes a model emits.
    return json.dumps(obj, separators=JSON_SEPARATORS, ensure_ascii=False)


def generate_examples(schemas: Mapping[str, Schema], num: int, seed: int) -> list[Example]:
    """`num` examples, schemas drawn uniformly; same (schemas, num, seed) -> same list."""
    rng = random.Random(seed)
    names = sorted(schemas)
    out = []
    for _ in range(num):
        name = rng.choice(names)
        doc = dumps_compact(generate_value(schemas[name], rng, name))
        out.append(Example(schema_name=name, prompt=prompt_for(name, schemas[name]), document=doc))
    return out
