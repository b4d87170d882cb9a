"""JSON Schemas the toy models are trained on, and held-out ones they never see.

TRAIN_SCHEMAS drive the synthetic training corpus. HELDOUT_SCHEMAS use key
names and structures that appear nowhere in training, so the worker benchmark
can measure grammar-aware vs grammar-blind drafting where the draft model has
no prior (a test checks the key sets are disjoint).

Every object lists its properties in the order documents emit them: xgrammar's
JSON-schema grammar fixes property order to schema order, and the corpus
generator (corpus.py) walks `properties` in the same order. All schemas compile
with xgrammar and every generated document validates with `jsonschema` (tests).
"""

from __future__ import annotations

import json
from typing import Any

Schema = dict[str, Any]


def _obj(properties: dict[str, Schema], optional: tuple[str, ...] = ()) -> Schema:
    """A closed object; every property required unless named in `optional`."""
    return {
        "type": "object",
        "properties": properties,
        "required": [k for k in properties if k not in optional],
        "additionalProperties": False,
    }


def _arr(items: Schema, lo: int, hi: int) -> Schema:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def _int(lo: int, hi: int) -> Schema:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float) -> Schema:
    return {"type": "number", "minimum": lo, "maximum": hi}


def _enum(*values: str) -> Schema:
    return {"type": "string", "enum": list(values)}


_STR: Schema = {"type": "string"}
_BOOL: Schema = {"type": "boolean"}

_ADDRESS = _obj({"street": _STR, "city": _STR, "zip": _STR, "country": _STR})

TRAIN_SCHEMAS: dict[str, Schema] = {
    "user": _obj(
        {
            "id": _int(1, 99999),
            "name": _STR,
            "email": _STR,
            "age": _int(18, 90),
            "active": _BOOL,
            "role": _enum("admin", "editor", "viewer"),
        }
    ),
    "address": _ADDRESS,
    "product": _obj(
        {
            "id": _int(1, 99999),
            "name": _STR,
            "price": _num(0.5, 2000),
            "currency": _enum("USD", "EUR", "GBP"),
            "in_stock": _BOOL,
            "tags": _arr(_STR, 0, 4),
        }
    ),
    "order": _obj(
        {
            "order_id": _int(1000, 999999),
            "customer": _obj({"id": _int(1, 99999), "name": _STR, "email": _STR}),
            "items": _arr(
                _obj({"product_id": _int(1, 99999), "quantity": _int(1, 20), "price": _num(0.5, 2000)}),
                1,
                4,
            ),
            "total": _num(0.5, 20000),
            "status": _enum("pending", "paid", "shipped", "delivered", "cancelled"),
        }
    ),
    "event": _obj(
        {
            "event_id": _int(1, 999999),
            "type": _enum("click", "view", "purchase", "signup", "logout"),
            "timestamp": _STR,
            "user_id": _int(1, 99999),
            "properties": _obj({"page": _STR, "duration_ms": _int(0, 60000)}, optional=("duration_ms",)),
        }
    ),
    "customer_profile": _obj(
        {
            "id": _int(1, 99999),
            "name": _STR,
            "email": _STR,
            "phone": _STR,
            "address": _ADDRESS,
            "newsletter": _BOOL,
        },
        optional=("phone",),
    ),
    "blog_post": _obj(
        {
            "id": _int(1, 99999),
            "title": _STR,
            "author": _obj({"name": _STR, "email": _STR}),
            "tags": _arr(_STR, 1, 5),
            "published": _BOOL,
            "views": _int(0, 1000000),
        }
    ),
    "invoice": _obj(
        {
            "invoice_id": _STR,
            "customer": _obj({"id": _int(1, 99999), "name": _STR}),
            "lines": _arr(_obj({"description": _STR, "amount": _num(0.5, 5000)}), 1, 4),
            "total": _num(0.5, 20000),
            "currency": _enum("USD", "EUR", "GBP"),
            "paid": _BOOL,
        }
    ),
    "review": _obj(
        {
            "product_id": _int(1, 99999),
            "user_id": _int(1, 99999),
            "rating": _int(1, 5),
            "title": _STR,
            "comment": _STR,
            "verified": _BOOL,
        }
    ),
    "employee": _obj(
        {
            "id": _int(1, 99999),
            "name": _STR,
            "department": _enum("engineering", "sales", "marketing", "support", "finance"),
            "salary": _int(30000, 250000),
            "manager_id": _int(1, 99999),
            "skills": _arr(_STR, 0, 5),
        },
        optional=("manager_id",),
    ),
    "shipment": _obj(
        {
            "tracking_number": _STR,
            "carrier": _enum("UPS", "FedEx", "DHL", "USPS"),
            "status": _enum("pending", "in_transit", "delivered", "returned"),
            "weight_kg": _num(0.1, 100),
            "destination": _ADDRESS,
        }
    ),
    "task": _obj(
        {
            "id": _int(1, 99999),
            "title": _STR,
            "done": _BOOL,
            "priority": _enum("low", "medium", "high"),
            "assignee": {"anyOf": [_STR, {"type": "null"}]},
            "subtasks": _arr(_obj({"title": _STR, "done": _BOOL}), 0, 3),
        }
    ),
}

HELDOUT_SCHEMAS: dict[str, Schema] = {
    "flight_booking": _obj(
        {
            "pnr": _STR,
            "passenger": _obj({"given_names": _STR, "surname": _STR, "frequent_flyer": _BOOL}),
            "segments": _arr(
                _obj(
                    {
                        "flight_no": _STR,
                        "origin_iata": _STR,
                        "dest_iata": _STR,
                        "cabin": _enum("economy", "premium", "business", "first"),
                    }
                ),
                1,
                3,
            ),
            "fare_eur": _num(20, 9000),
        }
    ),
    "sensor_reading": _obj(
        {
            "sensor_uuid": _STR,
            "kind": _enum("thermometer", "hygrometer", "barometer", "lux"),
            "celsius": _num(-40, 60),
            "battery_pct": _int(0, 100),
            "calibrated": _BOOL,
        }
    ),
    "recipe": _obj(
        {
            "dish": _STR,
            "servings": _int(1, 12),
            "ingredients": _arr(_obj({"ingredient": _STR, "grams": _int(1, 2000)}), 1, 5),
            "vegetarian": _BOOL,
            "cuisine": _enum("italian", "japanese", "mexican", "indian", "french"),
        }
    ),
    "git_commit": _obj(
        {
            "sha": _STR,
            "committer": _obj({"handle": _STR, "gpg_signed": _BOOL}),
            "message": _STR,
            "files_changed": _int(1, 400),
            "insertions": _int(0, 20000),
            "deletions": _int(0, 20000),
        }
    ),
    "weather_forecast": _obj(
        {
            "station": _STR,
            "days": _arr(
                _obj(
                    {
                        "weekday": _enum("mon", "tue", "wed", "thu", "fri", "sat", "sun"),
                        "high_c": _int(-30, 50),
                        "low_c": _int(-40, 40),
                        "precip_mm": _num(0, 300),
                    }
                ),
                1,
                4,
            ),
            "alert": {"anyOf": [_STR, {"type": "null"}]},
        }
    ),
    "library_loan": _obj(
        {
            "isbn13": _STR,
            "borrower_card": _int(100000, 999999),
            "due_in_days": _int(1, 60),
            "renewals_left": _int(0, 3),
            "overdue": _BOOL,
        }
    ),
}

# What the model sees before a document. Fixed text (no randomness) so the
# bench and demo prompt exactly like the corpus does.
PROMPT_TEMPLATE = "Generate JSON for schema {name}:\n"


def prompt_for(name: str, schema: Schema | None = None) -> str:
    """The prompt that precedes a document of schema `name`.

    `schema` is accepted so callers can switch to schema-aware prompts without
    changing call sites; the toy models are trained on name-only prompts.
    """
    del schema
    return PROMPT_TEMPLATE.format(name=name)


def all_schemas() -> dict[str, Schema]:
    return {**TRAIN_SCHEMAS, **HELDOUT_SCHEMAS}


def schema_json(schema: Schema) -> str:
    """The schema as the text a GrammarSpec(kind=JSON_SCHEMA) carries."""
    return json.dumps(schema, separators=(",", ":"))


def property_names(schema: Schema) -> set[str]:
    """Every property name at any depth (used to check train/held-out are disjoint)."""
    names: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        props = node.get("properties", {})
        names.update(props)
        stack.extend(props.values())
        if "items" in node:
            stack.append(node["items"])
        stack.extend(node.get("anyOf", ()))
    return names
