"""The one table of how errors look on the wire (orchestrator.api.error_table): every kind has a
row, refusals end the RPC with their status, failures are reported in the response, and HTTP
reports a failure by its kind, never by its message's words."""

from __future__ import annotations

import grpc
import pytest

from specmask.gpu_worker.mask_errors import MASK_TIER_UNAVAILABLE, MaskFailure, describe_mask_failure
from specmask.gpu_worker.types import MIN_TOKENS_UNREACHABLE, ErrorKind, FinishReason
from specmask.mask_service.client.mask_client import MaskServiceError
from specmask.orchestrator.api.error_table import FAILED, REFUSED
from specmask.orchestrator.api.http.responses import finish_error
from specmask.orchestrator.errors import RequestError


def _refusals() -> list[type[RequestError]]:
    found, todo = [], [RequestError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def test_every_kind_has_a_row() -> None:
    # Every status a refusal can name has its HTTP answer, and the table has no row nothing names.
    assert set(REFUSED) == {cls.code for cls in _refusals()}
    assert set(FAILED) == set(ErrorKind)


def test_refusals_are_errors_on_both_wires() -> None:
    for code, http in REFUSED.items():
        assert code is not grpc.StatusCode.OK and http.status >= 400, code


def test_failures_are_reported_in_the_response_and_are_http_errors() -> None:
    for kind, wire in FAILED.items():
        assert wire.grpc is grpc.StatusCode.OK, kind  # the response's finish_reason and error say it
        assert wire.http.status >= 400, kind


@pytest.mark.parametrize(
    ("kind", "status", "code", "param"),
    [
        (ErrorKind.INTERNAL, 500, "generation_failed", None),
        (ErrorKind.MASK_TIER_UNAVAILABLE, 503, "mask_tier_unavailable", None),
        (ErrorKind.MIN_TOKENS_UNREACHABLE, 400, None, "min_tokens"),
    ],
)
def test_an_error_finish_is_reported_by_its_kind(kind: ErrorKind, status: int, code: str | None, param) -> None:
    error = finish_error(FinishReason.ERROR, "whatever the words", kind)
    assert error is not None and error.status == status
    assert error.body()["error"]["code"] == code and error.param == param
    assert "whatever the words" in error.message


def test_the_words_alone_decide_nothing() -> None:
    """A message that merely starts like a typed one is a server failure unless its kind says else."""
    for words in (f"{MIN_TOKENS_UNREACHABLE}: x", f"{MASK_TIER_UNAVAILABLE}: y"):
        error = finish_error(FinishReason.ERROR, words)
        assert error is not None and error.status == 500 and error.message.startswith("generation failed")


def test_a_grammar_violation_is_never_reported_as_anything_else() -> None:
    for kind in (None, *ErrorKind):
        error = finish_error(FinishReason.GRAMMAR_VIOLATION, "grammar violation: x", kind)
        assert error is not None and error.status == 500 and error.body()["error"]["type"] == "grammar_violation"
    assert ErrorKind.of(FinishReason.GRAMMAR_VIOLATION, ErrorKind.MIN_TOKENS_UNREACHABLE) is ErrorKind.GRAMMAR_VIOLATION


def test_successes_and_cancels_have_no_kind() -> None:
    for reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.GRAMMAR_COMPLETE, FinishReason.CANCELLED):
        assert ErrorKind.of(reason, ErrorKind.INTERNAL) is None
    assert ErrorKind.of(FinishReason.ERROR) is ErrorKind.INTERNAL
    cancelled = finish_error(FinishReason.CANCELLED, None)
    assert cancelled is not None and cancelled.status == 503


def test_mask_failures_are_typed_where_they_are_worded() -> None:
    down = describe_mask_failure(MaskServiceError(grpc.StatusCode.UNAVAILABLE, "ipv4:127.0.0.1:1"), "computing masks")
    refused = describe_mask_failure(MaskServiceError(grpc.StatusCode.INVALID_ARGUMENT, "bad"), "computing masks")
    assert down.kind is ErrorKind.MASK_TIER_UNAVAILABLE and down.message.startswith(MASK_TIER_UNAVAILABLE)
    assert "127.0.0.1" not in down.message
    assert refused.kind is ErrorKind.INTERNAL
    assert describe_mask_failure(RuntimeError("boom"), "opening").kind is ErrorKind.INTERNAL
    # Words that merely look like the tier's carry no kind of their own: only the typed one counts.
    lookalike = MaskFailure.internal(f"{MASK_TIER_UNAVAILABLE}: but the service answered")
    error = finish_error(FinishReason.ERROR, lookalike.message, lookalike.output("s").error_kind)
    assert error is not None and error.status == 500
