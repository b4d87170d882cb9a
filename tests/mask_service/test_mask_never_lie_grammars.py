"""Never lie, grammar side: grammars that used to let "complete" output break them are refused or enforced.

Each finding is reproduced through the real mask service over loopback gRPC
(real xgrammar, and llguidance where the service picks it): a refusal is
INVALID_ARGUMENT with a human reason on both ValidateGrammar and OpenSession,
the server keeps serving, and a grammar that is accepted no longer accepts the
document that was returned as a lie.
"""

from __future__ import annotations

import json
import random
from typing import Any

import grpc
import jsonschema
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError
from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.backends import BACKENDS, XGrammarBackend
from specmask.mask_service.grammar.grammar_checks import engine_message
from specmask.orchestrator.errors import InvalidRequest
from specmask.orchestrator.grammar_check import MaskServiceGrammarChecker
from tests.mask_service.service_config import open_session_retrying

J = GrammarKind.JSON_SCHEMA
# The issue's schema: every key's value must be a string ("a" declared, the rest by pattern).
ISSUE_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string"}},
    "required": ["a"],
    "patternProperties": {".*": {"type": "string"}},
}
_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.fixture(scope="module", autouse=True)
def _warm(service, bpe_id: str) -> None:
    """One compile before the tests: a cold compile worker may answer "still compiling, retry"."""
    c = MaskServiceClient(f"127.0.0.1:{service.port}", deadline_s=60.0)
    try:
        c.close_session(open_session_retrying(c, bpe_id, GrammarSpec(J, '{"type": "boolean"}'), budget_s=120))
    finally:
        c.close()


def _json(schema: Any, strict: bool = True) -> GrammarSpec:
    return GrammarSpec(J, json.dumps(schema), strict=strict)


def _refused(client: MaskServiceClient, tid: str, spec: GrammarSpec) -> str:
    """Both RPCs refuse ``spec`` with INVALID_ARGUMENT; returns the reason (never Python's or C++'s internals)."""
    for call in (client.validate_grammar, client.open_session):
        with pytest.raises(MaskServiceError) as exc:
            call(tid, spec)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT, exc.value
        message = exc.value.message
        assert message.strip(), "empty reason"
        for internal in ("Check failed", "recursion depth", "Traceback", "codec can't"):
            assert internal not in message, message
    return message


def _still_serving(client: MaskServiceClient, tid: str) -> None:
    client.close_session(client.open_session(tid, _json({"type": "integer"})))


def _accepts(client: MaskServiceClient, tid: str, hf_tok: Any, spec: GrammarSpec, text: str) -> bool:
    """Whether the service's session for ``spec`` takes ``text`` then a stop token as a complete output."""
    info = client.open_session_info(tid, spec)
    tokens = hf_tok.encode(text, add_special_tokens=False) + [int(info.stop_token_ids[0])]
    try:
        return client.commit(info.session_id, 1, tokens)
    except MaskServiceError as exc:
        assert exc.code == grpc.StatusCode.FAILED_PRECONDITION, exc
        return False
    finally:
        client.close_session(info.session_id)


# Finding 3: languages that are empty or only the empty string "completed" with empty text.
EMPTY_LANGUAGES: list[tuple[GrammarSpec, str]] = [
    (_json({"anyOf": []}), "non-empty"),  # the 2020-12 metaschema refuses it first
    (_json({"oneOf": []}), "non-empty"),
    (_json({"$ref": "#"}), "matches nothing"),
    (_json(_CYCLE), "matches nothing"),
    (_json(_CYCLE, strict=False), "matches nothing"),
    (GrammarSpec(GrammarKind.REGEX, "[^\\s\\S]"), "matches nothing"),
    (GrammarSpec(GrammarKind.EBNF, "root ::= root"), "matches nothing"),
    (GrammarSpec(GrammarKind.LARK, "start: start"), "matches nothing"),
    (GrammarSpec(GrammarKind.EBNF, 'root ::= ""'), "only the empty string"),
    (GrammarSpec(GrammarKind.REGEX, "(?:)"), "only the empty string"),
    # Draft-07's metaschema allows an empty enum; the engines refuse it themselves.
    (_json({"$schema": "http://json-schema.org/draft-07/schema#", "enum": []}), "empty"),
]


@pytest.mark.parametrize("spec,word", EMPTY_LANGUAGES, ids=[f"empty{i}" for i in range(len(EMPTY_LANGUAGES))])
def test_empty_languages_refused(client: MaskServiceClient, bpe_id: str, spec: GrammarSpec, word: str) -> None:
    message = _refused(client, bpe_id, spec)
    assert word in message, message
    _still_serving(client, bpe_id)


def test_orchestrator_validation_surfaces_refusal(service, registry, bpe_id: str) -> None:
    vocab_size = registry.info(bpe_id, None).vocab_size
    checker = MaskServiceGrammarChecker(
        (f"127.0.0.1:{service.port}",), tokenizer_id=bpe_id, vocab_size=vocab_size, deadline_s=20.0, max_retries=1
    )
    try:
        for spec, word in (EMPTY_LANGUAGES[2], EMPTY_LANGUAGES[6], (_json({"type": "string", "maxLength": -1}), "-1")):
            with pytest.raises(InvalidRequest) as exc:
                checker.check(spec)
            assert word in str(exc.value), exc.value
        checker.check(_json({"type": "string"}))
    finally:
        checker.close()


# Finding 3 (related) and 4: metaschema violations, numbers, nesting and engine messages.
BAD_SCHEMAS: list[tuple[Any, str]] = [
    ({"type": "string", "maxLength": -1}, "maxLength: -1 is less than the minimum of 0"),
    ({"type": "strnig"}, "metaschema"),
    ({"type": "object", "required": "a"}, "#/required"),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "minimum": "1"}, "draft-04"),
]


@pytest.mark.parametrize("schema,word", BAD_SCHEMAS, ids=[f"meta{i}" for i in range(len(BAD_SCHEMAS))])
def test_metaschema_first(client: MaskServiceClient, bpe_id: str, schema: Any, word: str) -> None:
    message = _refused(client, bpe_id, _json(schema))
    assert word in message and "invalid JSON Schema" in message, message


def test_huge_number_has_a_reason(client: MaskServiceClient, bpe_id: str) -> None:
    spec = GrammarSpec(J, '{"type": "number", "minimum": 1e400}')
    assert "1e400" in _refused(client, bpe_id, spec)  # the reason used to be empty


def test_deep_nesting_has_a_reason(client: MaskServiceClient, bpe_id: str) -> None:
    for depth, head, tail in ((500, '{"type":"object","properties":{"a":', "}}"), (127, '{"items":', "}")):
        text = head * depth + '{"type":"integer"}' + tail * depth  # json.dumps itself cannot nest 1,000 deep
        message = _refused(client, bpe_id, GrammarSpec(J, text))
        # The service's configurable limit (limits.py) may answer first, in its own words.
        assert "deep" in message and "limit" in message, message
    _still_serving(client, bpe_id)


def test_engine_message_strips_internals() -> None:
    raw = RuntimeError(
        "[03:41:43] /project/cpp/json_schema_converter.cc:936: Check failed: (val <= MAX_INT64_AS_DOUBLE) is "
        "false: Integer exceeds maximum limit\n"
    )
    assert engine_message(raw) == "Integer exceeds maximum limit"
    assert engine_message(RuntimeError("")) == "the grammar engine refused it without a reason (RuntimeError)"


# Finding 3 (related) and 4: invalid Unicode in grammar literals produced invalid UTF-8 or a C++ "Check failed".
BAD_UNICODE: list[GrammarSpec] = [
    GrammarSpec(GrammarKind.EBNF, 'root ::= "\\uD800"'),
    GrammarSpec(GrammarKind.EBNF, 'root ::= "a" [\\u{DC00}-\\u{DCFF}]'),
    GrammarSpec(GrammarKind.EBNF, 'root ::= "\\uD83D\\uDE00"'),  # a pair as two escapes: not combined
    GrammarSpec(GrammarKind.REGEX, "x\\uDFFF"),
    GrammarSpec(GrammarKind.LARK, 'start: "\\ud800"'),
    GrammarSpec(GrammarKind.LARK, "start: /\\ud800/"),
    GrammarSpec(GrammarKind.EBNF, 'root ::= "\\U00110000"'),
    GrammarSpec(J, '{"const": "\\ud800"}'),
    GrammarSpec(J, '{"enum": ["ok", "\\udc00"]}'),
    GrammarSpec(J, '{"type": "object", "properties": {"\\ud800": {}}}'),
    GrammarSpec(J, json.dumps({"type": "string", "pattern": "^\\uD800$"})),
]


@pytest.mark.parametrize("spec", BAD_UNICODE, ids=[f"unicode{i}" for i in range(len(BAD_UNICODE))])
def test_invalid_unicode_refused(client: MaskServiceClient, bpe_id: str, spec: GrammarSpec) -> None:
    message = _refused(client, bpe_id, spec)
    assert "invalid Unicode" in message and ("surrogate" in message or "U+10FFFF" in message), message


def test_unfaithfully_printed_class_refused(client: MaskServiceClient, bpe_id: str) -> None:
    """xgrammar prints [\\^x] as [^x]; the grammar is re-parsed from its print, so it is refused, not negated."""
    for spec in (GrammarSpec(GrammarKind.REGEX, "a[\\^x]"), GrammarSpec(GrammarKind.EBNF, 'root ::= [\\^x] "y"')):
        assert "escaped '^'" in _refused(client, bpe_id, spec)
    client.close_session(client.open_session(bpe_id, GrammarSpec(GrammarKind.REGEX, "a[x\\^]|\\[\\^")))


def test_valid_unicode_still_accepted(client: MaskServiceClient, bpe_id: str, hf_tok) -> None:
    ok = [
        GrammarSpec(GrammarKind.EBNF, 'root ::= "\\U0001F600" | "\\\\uD800"'),  # an escaped backslash, then text
        GrammarSpec(GrammarKind.REGEX, "[\\u00e9\\u{1F600}]+"),
        GrammarSpec(J, json.dumps({"const": "\U0001f600 é"})),
    ]
    for spec in ok:
        client.close_session(client.open_session(bpe_id, spec))
    assert _accepts(client, bpe_id, hf_tok, ok[0], "\U0001f600")


# Finding 1: allow_additional_properties (strict=False) with patternProperties beside properties.
# Each (schema, strict, lie): the lie is a document the grammar returned as complete, or could have.
LIES: list[tuple[Any, bool, str]] = [
    (ISSUE_SCHEMA, False, '{"a":"US407","customer":{"id":9663844}}'),  # the issue's output
    (ISSUE_SCHEMA, False, '{"a":"x","a":5}'),
    (ISSUE_SCHEMA, True, '{"a":"x","a":5}'),
    ({**ISSUE_SCHEMA, "patternProperties": {"^x": {"type": "string"}}}, False, '{"a":"x","x":1}'),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, False, '{"x":[2]}'),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}, False, '{"b":1}'),
    (
        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "propertyNames": {"maxLength": 2}},
        True,
        '{"xyz":1}',
    ),
]


@pytest.mark.parametrize("schema,strict,lie", LIES, ids=[f"lie{i}" for i in range(len(LIES))])
def test_object_lies_are_refused_or_rejected(
    client: MaskServiceClient, bpe_id: str, hf_tok, schema: Any, strict: bool, lie: str
) -> None:
    """Whichever engine the service picks, the grammar is refused or no longer accepts the lie."""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(lie), schema)  # it is a lie (json.loads keeps the last duplicate)
    spec = _json(schema, strict)
    try:
        client.validate_grammar(bpe_id, spec)
    except MaskServiceError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT and exc.message, exc
        return
    assert not _accepts(client, bpe_id, hf_tok, spec, lie)


# The xgrammar side in detail (the service may route these to another engine; the refusals are xgrammar's).
XGRAMMAR_REFUSED: list[tuple[Any, bool, str]] = [
    (ISSUE_SCHEMA, False, "declared property 'a' matches pattern"),
    (ISSUE_SCHEMA, True, "declared property 'a' matches pattern"),
    (
        {
            "type": "object",
            "patternProperties": {"^x": {"type": "integer"}},
            "additionalProperties": {"type": "string"},
        },
        True,
        "additionalProperties other than false",
    ),
    (
        {"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": True},
        False,
        "additionalProperties other than false",
    ),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}, "y$": {}}}, True, "different subschemas"),
    (
        {"type": "object", "properties": {"a": {}}, "propertyNames": {"maxLength": 3}, "additionalProperties": {}},
        True,
        "could repeat a declared name",
    ),
    ({"type": "object", "properties": {"abcd": {}}, "propertyNames": {"maxLength": 3}}, True, "'abcd' does not"),
    (
        {"type": "object", "patternProperties": {"^x": {}}, "propertyNames": {"maxLength": 2}},
        False,
        "drops propertyNames",
    ),
]


@pytest.mark.parametrize("schema,strict,word", XGRAMMAR_REFUSED, ids=[f"xg{i}" for i in range(len(XGRAMMAR_REFUSED))])
def test_xgrammar_object_refusals(registry, bpe_id: str, schema: Any, strict: bool, word: str) -> None:
    compiler = XGrammarBackend.make_compiler(registry.info(bpe_id, None), 1)
    with pytest.raises(GrammarError) as exc:
        BACKENDS["xgrammar"].compile(compiler, _json(schema, strict))
    assert word in exc.value.message and "unsupported" in exc.value.message, exc.value.message


# Accepted by xgrammar in non-strict mode; random walks must never complete with an invalid document
# or a repeated declared key (json.loads would silently keep one of the two).
NON_STRICT_WALKED: list[Any] = [
    {**ISSUE_SCHEMA, "patternProperties": {"^x[0-9]$": {"type": "string"}}},
    {"type": "object", "patternProperties": {"^k[a-c]$": {"type": "integer"}}, "minProperties": 1},
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
    {
        "type": "object",
        "properties": {"id": {"type": "integer"}},
        "required": ["id"],
        "propertyNames": {"maxLength": 4},
    },
    {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False, "required": ["a"]},
]


@pytest.mark.parametrize("index", range(len(NON_STRICT_WALKED)))
def test_non_strict_walks_validate(registry, bpe_id: str, index: int) -> None:
    import numpy as np
    import xgrammar as xgr

    schema = NON_STRICT_WALKED[index]
    info = registry.info(bpe_id, None)
    compiled = BACKENDS["xgrammar"].compile(XGrammarBackend.make_compiler(info, 1), _json(schema, strict=False))
    vocab = [bytes(t) for t in info.decoded_vocab]
    stops = set(info.stop_token_ids)
    declared = set(schema.get("properties", {}))
    closing = np.array([any(c in t for c in b'"}') for t in vocab] + [False] * (info.vocab_size - len(vocab)))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    rng = random.Random(index)
    completed = 0
    for _ in range(25):
        matcher = xgr.GrammarMatcher(compiled)
        out = b""
        for step in range(80):
            matcher.fill_next_token_bitmask(bitmask)
            allowed = np.unpackbits(bitmask.numpy()[0].view(np.uint8), bitorder="little")[: info.vocab_size]
            ids = np.nonzero(allowed)[0]
            assert ids.size, f"dead end after {out!r}"
            if any(int(i) in stops for i in ids) and rng.random() < 0.5:
                break
            pool = ids[closing[ids]] if rng.random() < min(0.9, 0.2 + step / 30) and closing[ids].any() else ids
            tok = int(pool[rng.randrange(pool.size)])
            if tok in stops:
                break
            assert matcher.accept_token(tok)
            out += vocab[tok]
        else:
            continue
        dups: list[str] = []

        def pairs_hook(pairs: list[tuple[str, Any]], dups: list[str] = dups) -> dict[str, Any]:
            keys = [k for k, _ in pairs]
            dups.extend(k for k in set(keys) if keys.count(k) > 1)
            return dict(pairs)

        doc = json.loads(out.decode("utf-8"), object_pairs_hook=pairs_hook)
        assert not set(dups) & declared, f"declared key repeated in {out!r}"
        jsonschema.validate(doc, schema)
        completed += 1
    assert completed >= 5, completed


# Found while fixing finding 3: xgrammar's character classes admit the surrogate block, so a JSON
# string accepted the bytes ED A0 80 (not UTF-8) one byte-token at a time.
SURROGATE_BYTES_REFUSED: list[tuple[GrammarSpec, bytes]] = [
    (_json({"type": "string"}), b'"'),
    (_json({"type": "string", "maxLength": 3}), b'"'),
    (_json({"type": "object", "additionalProperties": {"type": "string"}}), b'{"'),
    (_json({"type": "object", "properties": {"a": {"type": "string"}}}, strict=False), b'{"a":"'),
    (GrammarSpec(GrammarKind.ANY_JSON), b'["'),
    (GrammarSpec(GrammarKind.REGEX, "[^a]{1,8}"), b""),
    (GrammarSpec(GrammarKind.REGEX, "x.+"), b"x"),
    (GrammarSpec(GrammarKind.EBNF, 'root ::= "<" [^>]* ">"'), b"<"),
    (GrammarSpec(GrammarKind.LARK, "start: /[^a]+/"), b""),
]


@pytest.mark.parametrize(
    "spec,prefix", SURROGATE_BYTES_REFUSED, ids=[f"bytes{i}" for i in range(len(SURROGATE_BYTES_REFUSED))]
)
def test_json_strings_never_take_surrogate_bytes(
    client: MaskServiceClient, registry, bpe_id: str, spec: GrammarSpec, prefix: bytes
) -> None:
    vocab = [bytes(t) for t in registry.info(bpe_id, None).decoded_vocab]
    single = {t[0]: i for i, t in enumerate(vocab) if len(t) == 1}
    sid = client.open_session(bpe_id, spec)
    try:
        assert not client.commit(sid, 1, [single[b] for b in prefix + "é".encode()])  # a real character is fine
        assert not client.commit(sid, 2, [single[0xED]])  # lead byte of U+D000..U+DFFF: still possible
        with pytest.raises(MaskServiceError) as exc:
            client.commit(sid, 3, [single[0xA0]])  # ED A0: a surrogate
        assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert not client.commit(sid, 3, [single[0x80], single[0x80]])  # ED 80 80 = U+D000, a real character
    finally:
        client.close_session(sid)


def test_draft04_exclusive_bounds_enforced(registry, bpe_id: str) -> None:
    """Draft-04's boolean exclusiveMinimum/Maximum failed with a bare "Value must be a number"."""
    import xgrammar as xgr

    info = registry.info(bpe_id, None)
    compiler = XGrammarBackend.make_compiler(info, 1)
    draft4 = "http://json-schema.org/draft-04/schema#"
    cases = [
        ({"$schema": draft4, "type": "integer", "minimum": 5, "exclusiveMinimum": True}, {"6"}),
        ({"$schema": draft4, "type": "integer", "minimum": 5, "exclusiveMinimum": False}, {"5", "6"}),
        ({"$schema": draft4, "type": "number", "maximum": 5, "exclusiveMaximum": True}, {"4", "4.5"}),
    ]
    for schema, complete in cases:
        compiled = BACKENDS["xgrammar"].compile(compiler, _json(schema))
        for text in ("4", "4.5", "5", "5.0", "6"):
            m = xgr.GrammarMatcher(compiled)
            done = m.accept_string(text) and m.accept_token(info.stop_token_ids[0])
            assert done == (text in complete), (schema, text)
            if done:
                jsonschema.validate(json.loads(text), schema)
