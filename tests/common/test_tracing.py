"""specmask.common.tracing: off costs nothing and imports nothing; on, context crosses
threads, gRPC metadata and carriers, recorded by the SDK's in-memory exporter."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind as OtelKind
from opentelemetry.trace import StatusCode

from specmask.common import tracing
from specmask.common.tracing import NO_SPAN, SpanKind

# ``spans``: tracing on with an in-memory exporter (tests/tracing_fixtures.py).

# A valid W3C traceparent, sampled: version 00, trace id, parent span id, flags 01.
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def test_off_imports_no_opentelemetry_and_returns_the_no_op_span() -> None:
    """Every process role with tracing off: no opentelemetry module is imported at all."""
    probe = """
import sys
from specmask.common import tracing
import specmask.orchestrator.engine, specmask.orchestrator.api.grpc_server, specmask.orchestrator.api.http.app
import specmask.mask_service.server.servicer, specmask.gpu_worker.masks
assert not tracing.enabled()
assert tracing.configure(None, "x") is False and tracing.configure("", "x") is False
s = tracing.start_span("x", attributes={"a": 1})
assert s is tracing.NO_SPAN and not s.recording and s.carrier() == {}
with tracing.span("x") as inner, tracing.server_span("y", lambda: [("traceparent", "bad")]) as server:
    assert inner is tracing.NO_SPAN and server is tracing.NO_SPAN
f = len
assert tracing.bind(f) is f and tracing.grpc_metadata() == ()
assert tracing.start_batch_span("b", [{"traceparent": "x"}]) is tracing.NO_SPAN
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_flag_without_the_extra_is_a_clear_start_up_error() -> None:
    """Without the OpenTelemetry packages: off works, and asking for tracing names the extra."""
    probe = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, Block())
import importlib.util
importlib.util.find_spec = lambda name, package=None: None if name.startswith("opentelemetry") else 1
from specmask.common import tracing
tracing.check_installed(None)
assert tracing.configure(None, "x") is False
for call in (lambda: tracing.check_installed("http://h:4317"), lambda: tracing.configure("http://h:4317", "x")):
    try:
        call()
    except RuntimeError as exc:
        assert "specmask[tracing]" in str(exc), exc
    else:
        raise AssertionError("no error")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_extract_reads_only_bounded_w3c_headers() -> None:
    assert tracing.extract({"Traceparent": TRACEPARENT, "X-Other": "y"}) == {"traceparent": TRACEPARENT}
    pairs = [("traceparent", TRACEPARENT), ("tracestate", "k=v"), ("authorization", "secret")]
    assert tracing.extract(pairs) == {"traceparent": TRACEPARENT, "tracestate": "k=v"}
    assert tracing.extract([("tracestate", "k=v")]) == {}  # a state without a parent is nothing
    assert tracing.extract({"traceparent": "0" * 10_000}) == {}  # oversized: dropped, never forwarded
    assert tracing.extract({"traceparent": TRACEPARENT, "tracestate": "k=" + "v" * 600}) == {"traceparent": TRACEPARENT}
    assert tracing.extract(None) == {}
    multi = "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7,t@sys=x"
    assert tracing.extract({"traceparent": TRACEPARENT, "tracestate": multi})["tracestate"] == multi
    for hostile in ("a=1\r\nInjected: yes", "vendor=é", "no-equals", "a=1,b=\x00", "UPPER=1"):
        assert tracing.extract({"traceparent": TRACEPARENT, "tracestate": hostile}) == {"traceparent": TRACEPARENT}
    assert tracing.extract([("traceparent", b"\x00")]) == {}  # gRPC binary metadata is not text  # type: ignore[list-item]


def test_a_span_continues_an_incoming_traceparent(spans: InMemorySpanExporter) -> None:
    span = tracing.start_span("req", parent=tracing.extract({"traceparent": TRACEPARENT}), kind=SpanKind.SERVER)
    assert span.recording
    child = tracing.start_span("child", parent=span, attributes={"n": 3, "unset": None})
    child.end()
    span.end()
    by_name = {s.name: s for s in spans.get_finished_spans()}
    req, kid = by_name["req"], by_name["child"]
    assert f"{req.context.trace_id:032x}" == TRACE_ID
    assert f"{req.parent.span_id:016x}" == PARENT_ID and req.kind is OtelKind.SERVER
    assert kid.parent.span_id == req.context.span_id and kid.context.trace_id == req.context.trace_id
    assert dict(kid.attributes) == {"n": 3}


def test_garbage_traceparent_starts_a_new_trace(spans: InMemorySpanExporter) -> None:
    for bad in ("00-zz-xx-01", "ff-" + TRACE_ID + "-" + PARENT_ID + "-01", "00-" + "0" * 32 + "-" + PARENT_ID + "-01"):
        tracing.start_span("req", parent={"traceparent": bad}).end()
    roots = spans.get_finished_spans()
    assert len(roots) == 3 and all(s.parent is None for s in roots)
    assert len({s.context.trace_id for s in roots}) == 3


def test_unsampled_caller_records_nothing_but_still_propagates(spans: InMemorySpanExporter) -> None:
    span = tracing.start_span("req", parent={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"})
    assert not span.recording
    assert span.carrier()["traceparent"].startswith(f"00-{TRACE_ID}-")  # downstream sees "not sampled"
    span.end()
    assert spans.get_finished_spans() == ()


def test_scope_marks_an_exception_failed_and_ends_the_span(spans: InMemorySpanExporter) -> None:
    with pytest.raises(ValueError), tracing.span("work"):
        raise ValueError("boom\nsecond line")
    (work,) = spans.get_finished_spans()
    assert work.status.status_code is StatusCode.ERROR and work.status.description == "ValueError: boom"


def test_bind_carries_the_context_into_a_thread_pool(spans: InMemorySpanExporter) -> None:
    """The worker's mask I/O thread: calls made there belong to the submitting span."""
    with ThreadPoolExecutor(2) as pool, tracing.span("iteration") as it:
        bound = pool.submit(tracing.bind(tracing.grpc_metadata)).result()
        unbound = pool.submit(tracing.grpc_metadata).result()
        carrier = it.carrier()
    assert unbound == ()
    assert dict(bound) == carrier
    (iteration,) = spans.get_finished_spans()
    assert carrier["traceparent"].split("-")[2] == f"{iteration.context.span_id:016x}"


def test_server_span_continues_only_traced_calls(spans: InMemorySpanExporter) -> None:
    """An internal service never starts a trace per call: untraced calls record nothing."""
    with tracing.server_span("svc/Untraced", lambda: [("other", "x")]) as untraced:
        assert untraced is NO_SPAN
    with tracing.server_span("svc/Traced", lambda: [("traceparent", TRACEPARENT)], {"rpc.system": "grpc"}) as s:
        assert s.recording
    (traced,) = spans.get_finished_spans()
    assert traced.name == "svc/Traced" and traced.kind is OtelKind.SERVER
    assert f"{traced.parent.span_id:016x}" == PARENT_ID


def test_batch_span_has_the_first_parent_and_links_the_rest(spans: InMemorySpanExporter) -> None:
    a, b, c = (tracing.start_span(n) for n in "abc")
    batch = tracing.start_batch_span("batch", [a.carrier(), b.carrier(), c.carrier(), {}])
    batch.end()
    for s in (a, b, c):
        s.end()
    got = {s.name: s for s in spans.get_finished_spans()}
    assert got["batch"].parent.span_id == got["a"].context.span_id
    assert [link.context.span_id for link in got["batch"].links] == [got["b"].context.span_id, got["c"].context.span_id]


def test_concurrent_binds_do_not_share_a_context(spans: InMemorySpanExporter) -> None:
    """Each request's context stays its own when many threads run bound calls at once."""
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with tracing.span(f"r{i}") as s:
                got = dict(tracing.bind(tracing.grpc_metadata)())
                assert got == s.carrier()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({s.context.trace_id for s in spans.get_finished_spans()}) == 16


def test_install_twice_is_refused_and_configure_keeps_the_first(spans: InMemorySpanExporter) -> None:
    with pytest.raises(RuntimeError, match="already on"):
        tracing.install(InMemorySpanExporter(), "other")
    assert tracing.configure("http://127.0.0.1:1", "other") is True  # a test's exporter stays
    tracing.start_span("kept").end()
    assert [s.name for s in spans.get_finished_spans()] == ["kept"]
    assert spans.get_finished_spans()[0].resource.attributes["service.name"] == "test"
