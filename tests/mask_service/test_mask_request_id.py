"""The request id a session is opened with is named in the service's log lines about it."""

from __future__ import annotations

import logging

import grpc
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError

SPEC = GrammarSpec(GrammarKind.REGEX, "[0-9]+")


def _lines(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


def test_session_lines_name_the_request_id(
    client: MaskServiceClient, bpe_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specmask.mask_service")
    sid = client.open_session(bpe_id, SPEC, request_id="req-trace-1")
    opened = _lines(caplog, f"session {sid} opened")
    assert opened and opened[0].startswith("[request_id=req-trace-1] "), opened

    with pytest.raises(MaskServiceError) as info:
        client.commit(sid, 1, [10**6])  # outside the vocabulary: a failed commit
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    failed = _lines(caplog, f"Commit[{sid}]")
    assert failed and failed[0].startswith("[request_id=req-trace-1] "), failed

    client.close_session(sid)
    closed = _lines(caplog, f"session {sid} closed")
    assert closed and closed[0].startswith("[request_id=req-trace-1] "), closed


def test_session_without_request_id_logs_no_prefix_and_long_ids_are_refused(
    client: MaskServiceClient, bpe_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specmask.mask_service")
    sid = client.open_session(bpe_id, SPEC)
    opened = _lines(caplog, f"session {sid} opened")
    assert opened and opened[0].startswith(f"session {sid} opened"), opened
    client.close_session(sid)

    with pytest.raises(MaskServiceError) as info:
        client.open_session(bpe_id, SPEC, request_id="x" * 257)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id is 257 characters" in info.value.message
