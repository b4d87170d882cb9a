"""Tracing over the real stack: one request's spans across the orchestrator, the GPU worker
(a Ray actor process) and the mask service (a subprocess), in one trace that continues the
caller's ``traceparent``.

Its own stack (one mask replica, one worker, the tiny model pair) with
``--otlp-traces-endpoint`` on every tier. The orchestrator runs in this process, so its
spans go to the SDK's in-memory exporter (installed before the stack starts, which the
orchestrator then keeps); the worker and the mask service export over real OTLP/gRPC to a
collector this test serves on 127.0.0.1, which keeps what it receives in memory.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import httpx2 as httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from specmask.common import tracing
from specmask.orchestrator.client import build_request
from specmask.orchestrator.dev.local_stack import StackConfig
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2_grpc
from tests.e2e.stack import BOUNDED_SCHEMA, PROMPT, ThreadStack

pytestmark = pytest.mark.slow

MASK = "specmask.mask.v1.MaskService"
# The worker and the mask service export on the SDK's batch schedule (5 s by default).
EXPORT_WAIT_S = 60.0


@dataclass(frozen=True)
class Received:
    """One span a remote process exported, as the collector got it."""

    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root
    links: tuple[str, ...]  # linked span ids
    attributes: dict[str, Any]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver that keeps what it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[Received] = []

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        got = []
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    attributes = {a.key: _value(a.value) for a in s.attributes}
                    got.append(
                        Received(
                            resource.get("service.name", ""),
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            tuple(link.span_id.hex() for link in s.links),
                            attributes,
                        )
                    )
        with self._lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[Received]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind is not None else None


@dataclass
class TracedStack:
    stack: ThreadStack
    local: InMemorySpanExporter
    collector: Collector

    @property
    def http(self) -> str:
        assert self.stack.running is not None
        return f"http://127.0.0.1:{self.stack.running.server.http_port}"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedStack]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    local = InMemorySpanExporter()
    tracing.install(local, "specmask-orchestrator", batch=False)
    stack = None
    try:
        target, draft = build_tiny_model_pair(tmp_path_factory.mktemp("tracing-tiny"))
        config = StackConfig(
            target_dir=str(target),
            draft_dir=str(draft),
            mask_replicas=1,
            num_workers=1,
            log_dir=str(tmp_path_factory.mktemp("tracing-logs")),
            mask_args=("--otlp-traces-endpoint", endpoint),
        )
        stack = ThreadStack(config, max_batch=4, max_queue=8, http_port=0, otlp_traces_endpoint=endpoint).start()
        yield TracedStack(stack, local, collector)
    finally:
        if stack is not None:
            stack.stop()
        tracing.shutdown()
        server.stop(0)


def _traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def _local(traced: TracedStack, trace_id: str) -> list[ReadableSpan]:
    return [s for s in traced.local.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]


def _wait_remote(traced: TracedStack, trace_id: str, want: set[tuple[str, str]]) -> list[Received]:
    """The remote spans of ``trace_id`` once every (service, name) in ``want`` has arrived and
    every received span's parent has too. Each process exports on its own schedule, and a child
    span ends (and so ships) before its parent: a mask service span can arrive while the worker
    span it belongs to is still in the worker's export queue."""
    local_ids = {_sid(s) for s in _local(traced, trace_id)}
    deadline = time.monotonic() + EXPORT_WAIT_S
    while True:
        spans = traced.collector.of_trace(trace_id)
        known = local_ids | {s.span_id for s in spans}
        closed = all(s.parent_id in known or not s.parent_id for s in spans)
        if (want <= {(s.service, s.name) for s in spans} and closed) or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def _sid(span: ReadableSpan) -> str:
    return f"{span.context.span_id:016x}"


def test_http_request_is_one_trace_across_all_tiers(traced: TracedStack) -> None:
    traceparent, trace_id, parent_id = _traceparent()
    request_id = "traced-" + secrets.token_hex(4)
    body = {
        "model": traced.stack.running.config.model_name,  # type: ignore[union-attr]
        "prompt": PROMPT,
        "max_tokens": 48,
        "temperature": 0.0,
        "guided_json": BOUNDED_SCHEMA,
    }
    headers = {"traceparent": traceparent, "tracestate": "vendor=1", "X-Request-Id": request_id}
    resp = httpx.post(f"{traced.http}/v1/completions", json=body, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]

    local = _local(traced, trace_id)
    (root,) = [s for s in local if s.name == "POST /v1/completions"]
    assert root.kind is SpanKind.SERVER and root.parent is not None
    assert f"{root.parent.span_id:016x}" == parent_id  # continues the caller's span
    assert root.attributes is not None
    attrs = dict(root.attributes)
    assert attrs["gen_ai.request.id"] == request_id
    assert attrs["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] > 0
    assert attrs["specmask.grammar.kind"] == "json_schema"
    assert attrs["gen_ai.response.finish_reasons"] in (("grammar_complete",), ("stop",), ("length",))
    assert attrs["specmask.speculation.drafts_proposed"] >= attrs["specmask.speculation.drafts_accepted"] >= 0
    assert attrs["http.route"] == "/v1/completions"
    assert root.status.is_ok

    (admission,) = [s for s in local if s.name == "specmask.admission"]
    iterations = [s for s in local if s.name == "specmask.iteration"]
    assert admission.parent is not None and admission.parent.span_id == root.context.span_id
    assert iterations and all(s.parent is not None and s.parent.span_id == root.context.span_id for s in iterations)
    assert (
        sum(int((s.attributes or {}).get("specmask.iteration.new_tokens", 0)) for s in iterations)
        == (usage["completion_tokens"])
    )

    remote = _wait_remote(
        traced,
        trace_id,
        {
            ("specmask-gpu-worker", "specmask.worker.iterate"),
            ("specmask-mask-service", f"{MASK}/DraftMasks"),
            ("specmask-mask-service", f"{MASK}/ValidateGrammar"),
            ("specmask-mask-service", f"{MASK}/OpenSession"),
        },
    )
    worker = [s for s in remote if s.name == "specmask.worker.iterate"]
    assert worker, [(s.service, s.name) for s in remote]
    iteration_ids = {_sid(s) for s in iterations}
    assert all(s.parent_id in iteration_ids for s in worker)  # each continues an iteration span
    worker_ids = {s.span_id for s in worker}
    masks = [s for s in remote if s.service == "specmask-mask-service"]
    draft_masks = [s for s in masks if s.name == f"{MASK}/DraftMasks"]
    assert draft_masks and all(s.parent_id in worker_ids for s in draft_masks)
    assert all(s.attributes["specmask.mask.items"] >= 1 for s in draft_masks)
    (validate,) = [s for s in masks if s.name == f"{MASK}/ValidateGrammar"]
    assert validate.parent_id == _sid(admission)  # the grammar's check, inside admission
    (open_session,) = [s for s in masks if s.name == f"{MASK}/OpenSession"]
    assert open_session.parent_id in worker_ids


def test_grpc_stream_continues_metadata_and_untraced_calls_record_nothing(traced: TracedStack) -> None:
    traceparent, trace_id, parent_id = _traceparent()
    # A second, equal grammar: the verdict cache answers admission, so no ValidateGrammar.
    request = build_request(PROMPT, schema=BOUNDED_SCHEMA, temperature=0.0, max_tokens=48, request_id="traced-grpc")
    with grpc.insecure_channel(traced.stack.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        chunks = list(stub.GenerateStream(request, metadata=(("traceparent", traceparent),), timeout=300))
    assert chunks and chunks[-1].finish_reason and not chunks[-1].error

    local = _local(traced, trace_id)
    (root,) = [s for s in local if s.name == "specmask.orchestrator.v1.OrchestratorService/GenerateStream"]
    assert root.parent is not None and f"{root.parent.span_id:016x}" == parent_id
    assert dict(root.attributes or {})["rpc.method"] == "GenerateStream"
    assert any(s.name == "specmask.iteration" for s in local)
    remote = _wait_remote(traced, trace_id, {("specmask-mask-service", f"{MASK}/DraftMasks")})
    assert any(s.name == f"{MASK}/DraftMasks" for s in remote)

    # Every span the mask service sent belongs to a trace some request started: its untraced
    # calls (session closes, the readiness probe's health checks) record nothing.
    traced_ids = {f"{s.context.trace_id:032x}" for s in traced.local.get_finished_spans()}
    from_masks = [s for s in traced.collector.spans if s.service == "specmask-mask-service"]
    assert from_masks and {s.trace_id for s in from_masks} <= traced_ids


def test_request_without_traceparent_starts_its_own_trace(traced: TracedStack) -> None:
    before = {f"{s.context.trace_id:032x}" for s in traced.local.get_finished_spans()}
    body = {"model": traced.stack.running.config.model_name, "prompt": PROMPT, "max_tokens": 4}  # type: ignore[union-attr]
    resp = httpx.post(f"{traced.http}/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    new = [s for s in traced.local.get_finished_spans() if f"{s.context.trace_id:032x}" not in before]
    (root,) = [s for s in new if s.name == "POST /v1/completions"]
    assert root.parent is None
    assert dict(root.attributes or {})["specmask.grammar.kind"] == "none"


def test_refused_request_fails_its_request_and_admission_spans(traced: TracedStack) -> None:
    traceparent, trace_id, _ = _traceparent()
    body = {
        "model": traced.stack.running.config.model_name,  # type: ignore[union-attr]
        "prompt": PROMPT,
        "max_tokens": 4,
        "guided_regex": "(unclosed",
    }
    resp = httpx.post(f"{traced.http}/v1/completions", json=body, headers={"traceparent": traceparent}, timeout=300)
    assert resp.status_code == 400, resp.text
    local = _local(traced, trace_id)
    (root,) = [s for s in local if s.name == "POST /v1/completions"]
    (admission,) = [s for s in local if s.name == "specmask.admission"]
    assert not root.status.is_ok and not admission.status.is_ok
    assert (admission.status.description or "").startswith("INVALID_ARGUMENT")
    assert admission.parent is not None and admission.parent.span_id == root.context.span_id
    assert not [s for s in local if s.name == "specmask.iteration"]  # it never reached a worker
