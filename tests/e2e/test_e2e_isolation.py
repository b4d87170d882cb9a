"""One user's grammar never fails another user's request (per-item isolation in DraftMasks).

Grammars whose forced continuation runs through multi-byte UTF-8 characters once made
the mask service fail the whole batched DraftMasks call, and with it every request
batched beside them. Sent together through the whole tiny stack, the harmless requests
complete, and so do the ones with non-ASCII grammars.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import ThreadStack

pytestmark = pytest.mark.slow

HARMLESS = {"type": "array", "items": {"type": "integer"}}
OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _non_ascii() -> list[pb.Grammar]:
    return [
        pb.Grammar(json_schema=json.dumps({"type": "string", "pattern": "^[é-ü]+$"})),
        pb.Grammar(regex="😀+"),
        pb.Grammar(ebnf='root ::= "é" | "😀" "+"'),
        pb.Grammar(json_schema=json.dumps(OBJ), separators=pb.JsonSeparators(item=" , ", key=" : ")),
    ]


def _run(address: str, req: pb.GenerateRequest) -> pb.GenerateResponse:
    with OrchestratorClient(address) as client:
        return client.generate(req)


def test_non_ascii_grammars_fail_nobody(stack: ThreadStack) -> None:
    reqs = []
    for i in range(3):
        reqs.append(build_request("x", schema=HARMLESS, max_tokens=24, seed=i, temperature=1.0, request_id=f"ok-{i}"))
    for i, grammar in enumerate(_non_ascii()):
        req = build_request("x", max_tokens=24, seed=i, temperature=1.0, request_id=f"utf8-{i}")
        req.grammar.CopyFrom(grammar)
        reqs.append(req)
    for _ in range(2):  # twice: batches form differently under load
        with ThreadPoolExecutor(len(reqs)) as pool:
            results = list(pool.map(lambda r: _run(stack.address, r), reqs))
        for req, res in zip(reqs, results):
            assert not res.error, (req.request_id, res.error)
            assert res.finish_reason in (pb.FINISH_REASON_GRAMMAR_COMPLETE, pb.FINISH_REASON_LENGTH), (
                req.request_id,
                res,
            )
        for res in results[:3]:  # and the harmless ones are right
            if res.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE:
                assert all(isinstance(v, int) for v in json.loads(res.text))


def test_non_json_whitespace_separator_is_refused(stack: ThreadStack) -> None:
    """U+2028 is whitespace to Python but not to JSON: such a separator can never give JSON."""
    import grpc

    req = build_request("x", schema=OBJ, max_tokens=24)
    req.grammar.separators.CopyFrom(pb.JsonSeparators(item=",", key=":\u2028"))
    with OrchestratorClient(stack.address) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "separator" in (err.value.details() or "")
