"""The demo's real-model cases are well-formed schemas the grammar engine accepts, and its
validity check is real (a wrong document fails it)."""

from __future__ import annotations

import jsonschema
import pytest

from specmask.mask_service.grammar.schema_check import check_schema
from specmask.orchestrator.dev.demo import REAL_CASES, _check, real_cases, speedup_words


@pytest.mark.parametrize(("name", "ask", "schema"), REAL_CASES, ids=[c[0] for c in REAL_CASES])
def test_demo_schemas_are_valid_and_enforceable(name: str, ask: str, schema: dict) -> None:
    jsonschema.validators.validator_for(schema).check_schema(schema)
    check_schema(schema)  # raises for anything the engine would refuse or not enforce
    assert ask


def test_demo_check_rejects_wrong_documents() -> None:
    schema = REAL_CASES[0][2]
    assert _check(schema, '{"name":"A","age":3,"occupation":"x","city":"y"}') == (True, "")
    assert not _check(schema, '{"name":"A","age":-3,"occupation":"x","city":"y"}')[0]
    assert not _check(schema, '{"name":"A"')[0]


def test_real_cases_are_chat_prompts() -> None:
    assert all(c.prompt[-1]["role"] == "user" for c in real_cases())


def test_speedup_is_never_a_slowdown_called_faster() -> None:
    assert speedup_words(2.8, 2.0) == "1.40x faster"
    assert speedup_words(2.0, 2.0) == "1.00x faster"
    assert speedup_words(2.6, 3.02) == "1.16x slower"
