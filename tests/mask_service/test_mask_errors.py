"""Every error path returns its status code, and the server keeps serving afterwards."""

from __future__ import annotations

import json

import grpc
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient, MaskServiceError
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2_grpc as pb_grpc

OK = GrammarSpec(GrammarKind.REGEX, "[a-z]+")
BAD_GRAMMARS = [
    GrammarSpec(GrammarKind.REGEX, "(unclosed"),
    GrammarSpec(GrammarKind.REGEX, "(?=a)a"),
    GrammarSpec(GrammarKind.EBNF, "root ::= "),
    GrammarSpec(GrammarKind.EBNF, 'no_root ::= "a"'),
    GrammarSpec(GrammarKind.LARK, "start: undefined_rule"),
    GrammarSpec(GrammarKind.JSON_SCHEMA, "{not json"),
    GrammarSpec(GrammarKind.JSON_SCHEMA, "[1, 2]"),
    GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "foo"})),
    GrammarSpec(GrammarKind.JSON_SCHEMA, ""),
]
REFUSED_SCHEMAS = [
    {"not": {"type": "string"}},
    {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    {"type": "array", "uniqueItems": True},
    {"type": "object", "dependencies": {"a": ["b"]}},
    {"type": "object", "properties": {"x": {"type": "array", "contains": {"type": "integer"}}}},
    {"$ref": "https://example.com/schema.json"},
    {"type": "string", "pattern": "^(?!abc).*$"},
    {"type": "object", "patternProperties": {"(?<=a)b": {"type": "integer"}}},
    {"$defs": {"a": {"not": {"type": "string"}}}, "$ref": "#/$defs/a"},
]
# xgrammar does not enforce these; llguidance does (instance-checked by bench.coverage
# and tests/mask_service/test_llguidance_backend.py), so the service picks it.
REFUSED_BY_XGRAMMAR_ONLY = [
    {"type": "integer", "multipleOf": 3},
    {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5},
]


def _assert_code(fn, code: grpc.StatusCode) -> MaskServiceError:
    with pytest.raises(MaskServiceError) as exc:
        fn()
    assert exc.value.code == code, exc.value
    return exc.value


def test_invalid_grammars(client: MaskServiceClient, bpe_id: str) -> None:
    for spec in BAD_GRAMMARS:
        err = _assert_code(lambda: client.validate_grammar(bpe_id, spec), grpc.StatusCode.INVALID_ARGUMENT)
        assert err.message
        _assert_code(lambda: client.open_session(bpe_id, spec), grpc.StatusCode.INVALID_ARGUMENT)
    for schema in REFUSED_SCHEMAS:
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
        err = _assert_code(lambda: client.open_session(bpe_id, spec), grpc.StatusCode.INVALID_ARGUMENT)
        assert "unsupported" in err.message or "lookaround" in err.message
    for schema in REFUSED_BY_XGRAMMAR_ONLY:
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), backend="xgrammar")
        err = _assert_code(lambda: client.open_session(bpe_id, spec), grpc.StatusCode.INVALID_ARGUMENT)
        assert "unsupported" in err.message
        info = client.open_session_info(bpe_id, GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema)))
        assert info.backend == "llguidance"
        client.close_session(info.session_id)
    # Allowed: local refs, annotations, uniqueItems false.
    client.validate_grammar(
        bpe_id,
        GrammarSpec(
            GrammarKind.JSON_SCHEMA,
            json.dumps(
                {
                    "$defs": {"a": {"type": "integer"}},
                    "type": "object",
                    "properties": {"v": {"$ref": "#/$defs/a", "description": "not a keyword: not"}},
                    "uniqueItems": False,
                }
            ),
        ),
    )
    client.validate_grammar(bpe_id, OK)  # still serving


def test_request_errors(client: MaskServiceClient, bpe_id: str, service) -> None:
    _assert_code(lambda: client.open_session("tok-unknown", OK), grpc.StatusCode.INVALID_ARGUMENT)
    _assert_code(lambda: client.open_session(bpe_id, OK, vocab_size=10), grpc.StatusCode.INVALID_ARGUMENT)
    _assert_code(lambda: client.draft_masks([DraftMaskItem("nope", [])]), grpc.StatusCode.NOT_FOUND)
    _assert_code(lambda: client.commit("nope", 1, [1]), grpc.StatusCode.NOT_FOUND)
    sid = client.open_session(bpe_id, OK)
    _assert_code(lambda: client.commit(sid, 1, [10**6]), grpc.StatusCode.INVALID_ARGUMENT)
    _assert_code(lambda: client.commit(sid, 1, [-1]), grpc.StatusCode.INVALID_ARGUMENT)
    _assert_code(lambda: client.commit(sid, 0, [1]), grpc.StatusCode.INVALID_ARGUMENT)
    _assert_code(lambda: client.draft_masks([DraftMaskItem(sid, [600])]), grpc.StatusCode.INVALID_ARGUMENT)
    _assert_code(
        lambda: client.draft_masks([DraftMaskItem(sid, [], commit_tokens=[9999], commit_seq=1)]),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    # One bad item does not fail the others' commits: a retry without it works.
    sid2 = client.open_session(bpe_id, OK)
    stub = pb_grpc.MaskServiceStub(grpc.insecure_channel(f"127.0.0.1:{service.port}"))
    resp = stub.DraftMasks(
        pb.DraftMasksRequest(
            items=[pb.DraftMaskItem(session_id="nope"), pb.DraftMaskItem(session_id=sid2, draft_tokens=[1])]
        )
    )
    assert resp.results[0].error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert resp.results[1].error_code == 0 and resp.results[1].num_rows == 2
    # Unspecified grammar kind over raw proto.
    with pytest.raises(grpc.RpcError) as raw:
        stub.OpenSession(pb.OpenSessionRequest(target=pb.GrammarTarget(tokenizer_id=bpe_id)))
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    from prometheus_client import REGISTRY

    assert (REGISTRY.get_sample_value("specmask_mask_errors_total", {"code": "NOT_FOUND"}) or 0) >= 2
    # Still serving.
    assert client.draft_masks([DraftMaskItem(sid, [])])[0].bitmask.shape[0] == 1
    client.close_session(sid)
    client.close_session(sid)  # closing twice is fine


def test_padded_vocab_session(client: MaskServiceClient, bpe_id: str) -> None:
    sid = client.open_session(bpe_id, OK, vocab_size=640)
    res = client.draft_masks([DraftMaskItem(sid, [620])])[0]  # a padding id: valid id, grammar rejects it
    assert res.bitmask.shape == (2, 20) and res.num_grammar_accepted == 0
    assert not res.bitmask.numpy()[0].view("uint32")[19]  # padding ids never allowed


def test_health_and_reflection(service) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    health = health_pb2_grpc.HealthStub(channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service="specmask.mask.v1.MaskService"), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(
        stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    )
    names = {s.name for s in replies[0].list_services_response.service}
    assert "specmask.mask.v1.MaskService" in names


def test_compile_timeout_then_serving(bpe_dir, registry, bpe_id) -> None:
    from specmask.mask_service.server.server import build_service
    from tests.mask_service.service_config import make_config

    handle = build_service(make_config(bpe_dir, compile_timeout_s=1e-6), registry)
    handle.server.start()
    try:
        with MaskServiceClient(f"127.0.0.1:{handle.port}", deadline_s=20.0, max_retries=0) as c:
            big = GrammarSpec(GrammarKind.EBNF, "root ::= " + " | ".join(f'"w{i}x{i * 7}"' for i in range(3000)))
            # Over budget is "too complex" (INVALID_ARGUMENT): no retry or failover can help,
            # and DEADLINE_EXCEEDED would make a router mark this healthy replica dead.
            _assert_code(lambda: c.validate_grammar(bpe_id, big), grpc.StatusCode.INVALID_ARGUMENT)
            assert c.session_count() == 0  # still serving
    finally:
        handle.stop(grace_s=0)
