"""Errors carry google.rpc.Status details a client can branch on (specmask/proto/rpc_status.py), over
real gRPC: a grammar over the compile budget is INVALID_ARGUMENT with ErrorInfo reason
GRAMMAR_TOO_COMPLEX (never DEADLINE_EXCEEDED), a refused grammar names the field at fault,
and the orchestrator's grammar check hands the reason on."""

from __future__ import annotations

import grpc
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2_grpc as pb_grpc
from specmask.proto.rpc_status import DOMAIN, details_of

BIG = GrammarSpec(GrammarKind.EBNF, "root ::= " + " | ".join(f'"w{i}x{i * 7}"' for i in range(3000)))


@pytest.fixture
def tight_server(bpe_dir, registry):
    """A replica whose compile budget no grammar of size meets."""
    from specmask.mask_service.server.server import build_service
    from tests.mask_service.service_config import make_config

    handle = build_service(make_config(bpe_dir, compile_timeout_s=1e-6), registry)
    handle.server.start()
    yield f"127.0.0.1:{handle.port}"
    handle.stop(grace_s=0)


def _raw_validate(address: str, bpe_id: str, spec: GrammarSpec) -> grpc.RpcError:
    from specmask.mask_service.convert import grammar_to_proto

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.MaskServiceStub(channel)
        req = pb.ValidateGrammarRequest(target=pb.GrammarTarget(tokenizer_id=bpe_id, grammar=grammar_to_proto(spec)))
        with pytest.raises(grpc.RpcError) as info:
            stub.ValidateGrammar(req, timeout=20)
    return info.value


def test_too_complex_is_invalid_argument_with_reason(tight_server: str, bpe_id: str) -> None:
    err = _raw_validate(tight_server, bpe_id, BIG)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = details_of(err)
    assert (details.reason, details.domain) == ("GRAMMAR_TOO_COMPLEX", DOMAIN)
    assert [f for f, _ in details.field_violations] == ["grammar"]
    assert details.retry_after_s is None  # retrying cannot help
    # The Python client surfaces the reason too.
    with (
        MaskServiceClient(tight_server, deadline_s=20.0, max_retries=0) as client,
        pytest.raises(MaskServiceError) as info,
    ):
        client.validate_grammar(bpe_id, BIG)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT and info.value.reason == "GRAMMAR_TOO_COMPLEX"


def test_refused_grammar_names_the_field(tight_server: str, bpe_id: str) -> None:
    err = _raw_validate(tight_server, bpe_id, GrammarSpec(GrammarKind.REGEX, "(unclosed"))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = details_of(err)
    assert details.reason.startswith("GRAMMAR") and details.field_violations[0][0] == "grammar"


def test_orchestrator_grammar_check_keeps_the_reason(tight_server: str, bpe_id: str) -> None:
    from specmask.orchestrator.errors import InvalidRequest
    from specmask.orchestrator.grammar_check import MaskServiceGrammarChecker

    checker = MaskServiceGrammarChecker(
        (tight_server,), tokenizer_id=bpe_id, vocab_size=0, deadline_s=20.0, max_retries=0
    )
    try:
        with pytest.raises(InvalidRequest) as info:
            checker.check(BIG)
    finally:
        checker.close()
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.reason, info.value.field) == ("GRAMMAR_TOO_COMPLEX", "grammar")
