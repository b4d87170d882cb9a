"""Random JSON Schemas for draft distillation: the prompts whose constrained outputs the draft learns.

The generator is seeded and self-contained: it never reads a schema collection,
so benchmark sets (maskbench, the JSON-Schema-Test-Suite) stay unseen by the
draft. It draws the shapes real API and config schemas have: objects of named
properties (strings with formats, enums and lengths, bounded integers and
numbers, booleans, nullable unions), arrays of scalars or objects, nested
objects, descriptions and titles, ``required`` lists and closed objects.
"""

from __future__ import annotations

import random
from typing import Any

# Field names common in API payloads, configs and records.
_NAMES = [
    "id",
    "name",
    "title",
    "description",
    "email",
    "url",
    "username",
    "first_name",
    "last_name",
    "age",
    "price",
    "quantity",
    "status",
    "type",
    "version",
    "count",
    "total",
    "created_at",
    "updated_at",
    "date",
    "timestamp",
    "enabled",
    "active",
    "tags",
    "items",
    "category",
    "label",
    "value",
    "key",
    "code",
    "message",
    "level",
    "priority",
    "score",
    "rating",
    "color",
    "size",
    "width",
    "height",
    "weight",
    "address",
    "city",
    "country",
    "zip",
    "phone",
    "company",
    "role",
    "permissions",
    "owner",
    "author",
    "content",
    "body",
    "summary",
    "notes",
    "path",
    "file",
    "format",
    "language",
    "currency",
    "amount",
    "balance",
    "start",
    "end",
    "duration",
    "timeout",
    "retries",
    "host",
    "port",
    "protocol",
    "region",
    "zone",
    "image",
    "tag",
    "mode",
    "state",
    "source",
    "target",
    "parent",
    "children",
    "metadata",
    "settings",
    "options",
    "config",
    "user_id",
    "order_id",
    "product_id",
    "sku",
    "uuid",
    "slug",
    "latitude",
    "longitude",
    "year",
    "month",
    "day",
    "hour",
    "minute",
    "enabled_features",
]
_CAMEL = ("isPublic", "createdBy", "maxItems", "displayName", "lastModified", "itemCount", "apiVersion", "userName")
_WORDS = [
    "the",
    "user",
    "account",
    "order",
    "product",
    "item",
    "record",
    "entry",
    "resource",
    "service",
    "request",
    "response",
    "event",
    "object",
    "identifier",
    "unique",
    "value",
    "name",
    "of",
    "for",
    "a",
    "an",
    "and",
    "or",
    "in",
    "to",
    "is",
]
_ENUMS = (
    ("active", "inactive", "pending"),
    ("low", "medium", "high"),
    ("red", "green", "blue"),
    ("GET", "POST", "PUT", "DELETE"),
    ("draft", "published", "archived"),
    ("small", "medium", "large", "xlarge"),
    ("info", "warning", "error", "critical"),
    ("admin", "editor", "viewer"),
    ("USD", "EUR", "GBP", "JPY"),
    ("daily", "weekly", "monthly"),
)
_FORMATS = ("date-time", "email", "uri", "date", "uuid", "ipv4")


def _description(rng: random.Random) -> str:
    words = rng.sample(_WORDS, rng.randint(3, 7))
    return (" ".join(words)).capitalize() + "."


def _name(rng: random.Random) -> str:
    return rng.choice(_CAMEL) if rng.random() < 0.15 else rng.choice(_NAMES)


def _scalar(rng: random.Random) -> dict[str, Any]:
    kind = rng.choices(("string", "integer", "number", "boolean", "enum", "format"), (5, 3, 2, 2, 2, 2))[0]
    schema: dict[str, Any]
    if kind == "string":
        schema = {"type": "string"}
        if rng.random() < 0.3:
            schema["maxLength"] = rng.choice((8, 16, 32, 64, 128))
        if rng.random() < 0.2:
            schema["minLength"] = 1
    elif kind == "integer":
        schema = {"type": "integer"}
        if rng.random() < 0.5:
            lo = rng.choice((0, 1, -100))
            schema["minimum"] = lo
            if rng.random() < 0.6:
                schema["maximum"] = lo + rng.choice((10, 100, 1000, 65535))
    elif kind == "number":
        schema = {"type": "number"}
        if rng.random() < 0.4:
            schema["minimum"] = 0
    elif kind == "boolean":
        schema = {"type": "boolean"}
    elif kind == "enum":
        schema = {"type": "string", "enum": list(rng.choice(_ENUMS))}
    else:
        schema = {"type": "string", "format": rng.choice(_FORMATS)}
    if rng.random() < 0.1 and "enum" not in schema:
        schema["type"] = [schema["type"], "null"]
    return schema


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth < 2 and roll < 0.15:
        return _object(rng, depth + 1)
    if depth < 2 and roll < 0.3:
        items = _object(rng, depth + 1) if rng.random() < 0.4 else _scalar(rng)
        schema: dict[str, Any] = {"type": "array", "items": items}
        if rng.random() < 0.4:
            schema["maxItems"] = rng.choice((3, 5, 10))
        if rng.random() < 0.3:
            schema["minItems"] = 1
        return schema
    return _scalar(rng)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    count = rng.randint(1, 6 if depth == 0 else 4)
    names: list[str] = []
    while len(names) < count:
        n = _name(rng)
        if n not in names:
            names.append(n)
    properties: dict[str, Any] = {}
    for n in names:
        prop = _value(rng, depth)
        if rng.random() < 0.3:
            prop = {"description": _description(rng), **prop}
        properties[n] = prop
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    required = [n for n in names if rng.random() < 0.7]
    if required:
        schema["required"] = required
    if rng.random() < 0.4:
        schema["additionalProperties"] = False
    return schema


def random_schema(rng: random.Random) -> dict[str, Any]:
    """One schema: an object (occasionally titled and described) with 1-6 properties, nested up to 2 deep."""
    schema = _object(rng, 0)
    if rng.random() < 0.3:
        schema = {"title": _name(rng).replace("_", " ").title(), **schema}
    if rng.random() < 0.2:
        schema = {"$schema": "http://json-schema.org/draft-07/schema#", **schema}
    return schema


def random_schemas(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]
