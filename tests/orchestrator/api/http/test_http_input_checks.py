"""Body checks before parsing: lone surrogates anywhere are found with their path."""

from __future__ import annotations

import json

import pytest

from specmask.orchestrator.api.http.errors import ApiError
from specmask.orchestrator.api.http.input_checks import find_lone_surrogate, refuse_lone_surrogates


def test_lone_surrogates_are_found_with_their_path() -> None:
    body = json.loads('{"messages":[{"role":"user","content":"ok"},{"role":"user","content":"a\\udc00"}]}')
    assert find_lone_surrogate(body) == "messages.1.content"
    assert find_lone_surrogate(json.loads('{"guided_json":{"properties":{"\\ud800":{}}}}')) == (
        "guided_json.properties.\ud800"
    )
    assert find_lone_surrogate(json.loads('{"stop":["x","\\ud800"]}')) == "stop.1"


def test_pairs_and_plain_text_pass() -> None:
    assert find_lone_surrogate(json.loads('{"a":"\\ud83d\\ude00 é 中","b":[1,2.5,true,null]}')) is None


def test_refusal_is_a_400_naming_the_field() -> None:
    with pytest.raises(ApiError) as exc:
        refuse_lone_surrogates(json.loads('{"prompt":"\\ud800"}'))
    assert exc.value.status == 400 and exc.value.param == "prompt" and "surrogate" in exc.value.message
