"""Trace context over real gRPC on 127.0.0.1: the mask client's calls carry the caller's span
in their metadata, the worker's mask threads (gpu_worker.masks) carry the submitting one's,
and the service continues traced calls only. Client and service share this process, so one
in-memory exporter sees both ends."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from specmask.common import tracing
from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.masks import MaskChannel
from specmask.mask_service.client.mask_client import DraftMaskItem, MaskServiceClient
from specmask.mask_service.server.server import MaskServiceHandle

# ``spans``: tracing on with an in-memory exporter (tests/tracing_fixtures.py).
SPEC = GrammarSpec(GrammarKind.REGEX, "[0-9]+")
MASK = "specmask.mask.v1.MaskService"


def _named(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def test_client_calls_continue_the_current_span(
    spans: InMemorySpanExporter, client: MaskServiceClient, bpe_id: str
) -> None:
    with tracing.span("admission") as admission:
        assert admission.recording
        client.validate_grammar(bpe_id, SPEC)
    (validate,) = _named(spans, f"{MASK}/ValidateGrammar")
    (parent,) = _named(spans, "admission")
    assert validate.kind is SpanKind.SERVER
    assert validate.parent is not None and validate.parent.span_id == parent.context.span_id
    assert validate.context.trace_id == parent.context.trace_id

    sid = client.open_session(bpe_id, SPEC)  # outside any span: the service records nothing
    client.draft_masks([DraftMaskItem(session_id=sid, draft_tokens=[])])
    client.close_session(sid)
    assert {s.name for s in spans.get_finished_spans()} == {"admission", f"{MASK}/ValidateGrammar"}


def test_worker_mask_threads_carry_the_iteration_span(
    spans: InMemorySpanExporter, service: MaskServiceHandle, bpe_id: str, hf_tok: object
) -> None:
    vocab_size = len(hf_tok)  # type: ignore[arg-type]
    channel = MaskChannel.connect(
        [f"127.0.0.1:{service.port}"], tokenizer_id=bpe_id, vocab_size=vocab_size, deadline_s=120.0
    )
    try:
        with tracing.span("specmask.worker.iterate"):
            opened = channel.open_session_async(SPEC).result(timeout=120)
            results, _ = channel.draft_masks_async([DraftMaskItem(opened.session_id, [])]).result(timeout=120)
        assert len(results) == 1
        untraced, _ = channel.draft_masks_async([DraftMaskItem(opened.session_id, [])]).result(timeout=120)
        assert len(untraced) == 1
    finally:
        channel.close()
    (iteration,) = _named(spans, "specmask.worker.iterate")
    (open_session,) = _named(spans, f"{MASK}/OpenSession")
    (draft_masks,) = _named(spans, f"{MASK}/DraftMasks")  # the untraced call left none
    for child in (open_session, draft_masks):
        assert child.parent is not None and child.parent.span_id == iteration.context.span_id
    assert dict(draft_masks.attributes or {})["specmask.mask.items"] == 1
