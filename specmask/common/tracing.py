"""Optional OpenTelemetry tracing; the one module that imports opentelemetry.

Off by default. ``--otlp-traces-endpoint URL`` (``specmask orchestrator``, which hands
it to its GPU workers, and ``specmask mask-service``) turns it on for that process:
spans are batched and sent to an OTLP/gRPC collector on a thread of their own, off the
serving path. The standard ``OTEL_*`` variables the SDK reads still apply (sampler,
batch sizes, resource attributes); ``service.name`` is the process's role.

While tracing is off every helper returns after one module-level check, with the shared
``NO_SPAN`` or the input unchanged: no span objects, no context copies, no metadata,
and opentelemetry is never imported, so an install without the ``tracing`` extra runs
unchanged and one with it pays nothing until asked.

Context crosses processes as W3C trace context (``traceparent``, ``tracestate``):
read from HTTP headers and gRPC metadata, written to gRPC metadata (mask-service
calls), and carried as a ``Carrier`` dict in Ray call arguments (the orchestrator's
``iterate`` call to a GPU worker). Within a process it is OpenTelemetry's context
(contextvars), which a thread pool does not carry: work handed to one is wrapped with
``bind``. A span is never left current across an ``await`` that can suspend into
another request, nor across a generator's ``yield``: callers activate a span only
around code that runs to completion in one task or thread.
"""

from __future__ import annotations

import contextvars
import enum
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# The headers of W3C trace context, lower-case: gRPC metadata keys are, and HTTP headers
# are matched case-insensitively.
CONTEXT_HEADERS = (TRACEPARENT, TRACESTATE)
# The W3C limit on a tracestate header; a longer one is dropped, never forwarded, so a
# client cannot make every mask-service call of its request carry kilobytes.
MAX_TRACESTATE_CHARS = 512
# traceparent is exactly 55 characters in version 00; later versions may append fields.
MAX_TRACEPARENT_CHARS = 256

_MISSING = "--otlp-traces-endpoint needs the OpenTelemetry packages: pip install 'specmask[tracing]'"
# --otlp-traces-endpoint, as every command that takes it explains it (vLLM's flag name).
OTLP_ENDPOINT_HELP = (
    "send OpenTelemetry trace spans to this OTLP/gRPC collector (http://host:4317; https:// for TLS); "
    "off by default (needs the tracing extra; docs/operations.md#tracing)"
)

# One tracestate list member, by the W3C grammar: a key (lower-case, optionally tenant@system),
# "=", then a value of printable ASCII without "," or "=", not ending in a space.
_TRACESTATE_MEMBER = re.compile(
    r"[a-z0-9][_0-9a-z\-*/]{0,240}(@[a-z][_0-9a-z\-*/]{0,13})?=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)

# W3C trace context as headers (traceparent, and tracestate when there is one).
Carrier = dict[str, str]
AttributeValue = str | bool | int | float | tuple[str, ...]
Attributes = Mapping[str, AttributeValue | None]  # None: left unset


class SpanKind(enum.Enum):
    """OpenTelemetry's span kinds this code uses."""

    INTERNAL = "internal"
    SERVER = "server"  # the handling of a request that arrived from another process


class Span:
    """A span handle. This base class is the no-op span (``NO_SPAN``) every helper returns
    while tracing is off, or for work that belongs to no trace; callers never branch on it."""

    __slots__ = ()

    @property
    def recording(self) -> bool:
        """Whether attributes set on it are kept (off, or sampled out: False)."""
        return False

    def set(self, key: str, value: AttributeValue | None) -> None:
        """Set one attribute (None: left unset)."""

    def set_attributes(self, attributes: Attributes) -> None:
        """Set several attributes."""

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        """Record a point in time on the span."""

    def fail(self, message: str) -> None:
        """Mark the span's operation failed, with a one-line reason."""

    def end(self) -> None:
        """End the span (idempotent)."""

    def carrier(self) -> Carrier:
        """This span's context as W3C headers, for another process to continue ({} = none)."""
        return {}

    def activate(self) -> AbstractContextManager[Span]:
        """A context manager under which this span is the current one (its children's parent)."""
        return _NO_ACTIVATION


class _Activation(AbstractContextManager[Span]):
    """``with span.activate():`` for the no-op span: nothing to attach."""

    __slots__ = ()

    def __enter__(self) -> Span:
        return NO_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


NO_SPAN = Span()
_NO_ACTIVATION = _Activation()


@dataclass(frozen=True)
class _Tracing:
    """What an enabled process holds: its provider (its own, never the global one, so tests
    can switch tracing on and off in one process), its tracer and the W3C propagator."""

    provider: Any  # opentelemetry.sdk.trace.TracerProvider
    tracer: Any  # opentelemetry.trace.Tracer
    propagator: Any  # TraceContextTextMapPropagator
    service_name: str


_state: _Tracing | None = None
_lock = threading.Lock()


def enabled() -> bool:
    return _state is not None


def check_installed(endpoint: str | None) -> None:
    """RuntimeError, naming the extra to install, when ``endpoint`` asks for tracing and the
    OpenTelemetry packages are not there; imports nothing (a start-up check before any work)."""
    import importlib.util

    if endpoint and importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is None:
        raise RuntimeError(_MISSING)


def configure(endpoint: str | None, service_name: str) -> bool:
    """Switch tracing on for this process, exporting to the OTLP/gRPC ``endpoint``
    (``http://host:4317``; ``https://`` for TLS); None or "" leaves it off. Returns whether
    tracing is on. A process where it is on already (``install``: a test's in-memory
    exporter) keeps what it has."""
    if not endpoint:
        return enabled()
    with _lock:
        if _state is not None:
            logger.info("tracing already on (%s); not re-configured for %s", _state.service_name, endpoint)
            return True
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:  # the flag was given without the extra: say how to get it
        raise RuntimeError(_MISSING) from exc
    install(OTLPSpanExporter(endpoint=endpoint), service_name)
    logger.info("tracing on: %s spans to %s", service_name, endpoint)
    return True


def install(exporter: SpanExporter, service_name: str, *, batch: bool = True) -> None:
    """Switch tracing on with ``exporter`` (``configure`` uses OTLP; tests pass an in-memory
    one). ``batch``: export on the SDK's background thread (False: synchronously as each
    span ends, for tests that read spans back at once)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    global _state
    with _lock:
        if _state is not None:
            raise RuntimeError(f"tracing is already on in this process ({_state.service_name})")
        # The sampler is the SDK's default unless OTEL_TRACES_SAMPLER names another:
        # parent-based, so a caller's sampled flag decides, and everything else is sampled.
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        _state = _Tracing(provider, provider.get_tracer("specmask"), TraceContextTextMapPropagator(), service_name)


def shutdown() -> None:
    """Export what is buffered and switch tracing off (process exit, tests)."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None:
        state.provider.shutdown()


# ---- context in and out ------------------------------------------------------


def _valid_tracestate(value: str) -> bool:
    """Whether ``value`` is a W3C tracestate list. The SDK drops a malformed one too, but logs
    a warning quoting it: a client's header would then write what it likes (newlines
    included) into the server's log on every request."""
    return all(not m or _TRACESTATE_MEMBER.fullmatch(m) for m in (part.strip(" \t") for part in value.split(",")))


def extract(headers: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Carrier:
    """The W3C trace context among incoming ``headers`` (HTTP headers or gRPC metadata
    pairs); {} when there is none, or it is oversized. A malformed or oversized tracestate
    is dropped (the traceparent alone still continues the trace). Reads nothing else."""
    if headers is None:
        return {}
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    carrier: Carrier = {}
    for key, value in pairs:
        name = key.lower()
        if not isinstance(value, str):
            continue
        if name == TRACEPARENT:
            ok = len(value) <= MAX_TRACEPARENT_CHARS
        else:
            ok = name == TRACESTATE and len(value) <= MAX_TRACESTATE_CHARS and _valid_tracestate(value)
        if ok:
            carrier[name] = value
    return carrier if TRACEPARENT in carrier else {}


def grpc_metadata() -> tuple[tuple[str, str], ...]:
    """The current context as gRPC metadata for an outgoing call; () while off or outside any span."""
    state = _state
    if state is None:
        return ()
    carrier: Carrier = {}
    state.propagator.inject(carrier)
    return tuple(carrier.items())


def bind(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn`` run in the caller's current context, for a thread pool (which does not carry it):
    calls it makes (gRPC metadata, child spans) then belong to the caller's span. Unchanged
    while tracing is off. Each call of ``bind`` copies the context once; run its result on one
    thread at a time."""
    if _state is None:
        return fn
    context = contextvars.copy_context()

    def bound(*args: P.args, **kwargs: P.kwargs) -> T:
        return context.run(fn, *args, **kwargs)

    return bound


# ---- spans -------------------------------------------------------------------


def current_span() -> Span:
    """The current span (``NO_SPAN`` while off, or outside any span)."""
    state = _state
    if state is None:
        return NO_SPAN
    from opentelemetry import trace

    span = trace.get_current_span()
    return _OtelSpan(span) if span.get_span_context().is_valid else NO_SPAN


def start_span(
    name: str,
    *,
    parent: Span | Carrier | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
    links: Iterable[Carrier] = (),
) -> Span:
    """A started span, not made current (``activate`` does that); the caller ends it.

    ``parent``: a span of this process, a carrier from another (a new trace when it holds
    none), or None for the current span. A ``NO_SPAN`` parent (work that belongs to no
    trace) gives ``NO_SPAN``. ``links``: the contexts of other traces the work also
    served (a batch)."""
    state = _state
    if state is None or parent is NO_SPAN:
        return NO_SPAN
    from opentelemetry import trace

    if isinstance(parent, _OtelSpan):
        context = trace.set_span_in_context(parent.otel)
    elif isinstance(parent, dict):
        context = state.propagator.extract(parent)
    else:
        context = None  # the current one
    otel_links = []
    for carrier in links:
        linked = trace.get_current_span(state.propagator.extract(carrier)).get_span_context()
        if linked.is_valid:
            otel_links.append(trace.Link(linked))
    span = state.tracer.start_span(
        name, context=context, kind=_otel_kind(kind), attributes=_clean(attributes), links=otel_links
    )
    return _OtelSpan(span)


def scope(span: Span) -> AbstractContextManager[Span]:
    """``with tracing.scope(span):``: ``span`` current inside the block, ended (and marked
    failed by an exception) at its end. The shared no-op scope for ``NO_SPAN``."""
    return _NO_ACTIVATION if span is NO_SPAN else _span_scope(span)


@contextmanager
def _span_scope(span: Span) -> Iterator[Span]:
    with span.activate():
        try:
            yield span
        except BaseException as exc:
            span.fail(_one_line(exc))
            raise
        finally:
            span.end()


def start_batch_span(name: str, carriers: Sequence[Carrier], attributes: Attributes | None = None) -> Span:
    """A span for work done for several traces at once (a worker's iteration over a batch):
    the child of the first carrier's span, linked to the others' (a span has one parent).
    ``NO_SPAN`` while off or with no carrier."""
    if _state is None or not carriers:
        return NO_SPAN
    return start_span(name, parent=carriers[0], kind=SpanKind.SERVER, attributes=attributes, links=carriers[1:])


def span(
    name: str, *, kind: SpanKind = SpanKind.INTERNAL, attributes: Attributes | None = None
) -> AbstractContextManager[Span]:
    """``with tracing.span(name) as s:``: a child of the current span, current inside the
    block, ended (and marked failed by an exception) at its end. The no-op scope while off."""
    if _state is None:
        return _NO_ACTIVATION
    return _span_scope(start_span(name, kind=kind, attributes=attributes))


def server_span(
    name: str,
    incoming: Callable[[], Iterable[tuple[str, str]] | None],
    attributes: Attributes | None = None,
) -> AbstractContextManager[Span]:
    """``with tracing.server_span(name, context.invocation_metadata) as s:``: the handling of
    a call from another process of this system, continuing the trace its metadata carries.
    A call that carries none belongs to no trace and gets the no-op scope: an internal
    service continues traces, it never starts one per call (every untraced DraftMasks would
    be a trace of its own). ``incoming`` is called only while tracing is on, so a server pays
    nothing for reading its metadata while it is off."""
    if _state is None:
        return _NO_ACTIVATION
    carrier = extract(incoming())
    if not carrier:
        return _NO_ACTIVATION
    return _span_scope(start_span(name, parent=carrier, kind=SpanKind.SERVER, attributes=attributes))


class _OtelSpan(Span):
    __slots__ = ("otel",)

    def __init__(self, span: Any) -> None:
        self.otel = span  # opentelemetry.trace.Span

    @property
    def recording(self) -> bool:
        return bool(self.otel.is_recording())

    def set(self, key: str, value: AttributeValue | None) -> None:
        if value is not None:
            self.otel.set_attribute(key, value)

    def set_attributes(self, attributes: Attributes) -> None:
        self.otel.set_attributes(_clean(attributes))

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        self.otel.add_event(name, _clean(attributes))

    def fail(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.otel.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        self.otel.end()  # the SDK warns and ignores a second end; callers end once

    def carrier(self) -> Carrier:
        state = _state
        if state is None:
            return {}
        from opentelemetry import trace

        carrier: Carrier = {}
        state.propagator.inject(carrier, context=trace.set_span_in_context(self.otel))
        return carrier

    def activate(self) -> AbstractContextManager[Span]:
        return _attached(self)


@contextmanager
def _attached(span: _OtelSpan) -> Iterator[Span]:
    from opentelemetry import context, trace

    token = context.attach(trace.set_span_in_context(span.otel))
    try:
        yield span
    finally:
        context.detach(token)


def _otel_kind(kind: SpanKind) -> Any:
    from opentelemetry.trace import SpanKind as OtelKind

    return {SpanKind.INTERNAL: OtelKind.INTERNAL, SpanKind.SERVER: OtelKind.SERVER}[kind]


def _clean(attributes: Attributes | None) -> dict[str, AttributeValue] | None:
    """Attributes without the unset ones (None is not an OpenTelemetry attribute value)."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:256]
