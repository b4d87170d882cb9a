"""What one generation request's trace says (specmask.common.tracing; docs/operations.md#tracing).

* The request span (SERVER): from the HTTP or gRPC handler's admission to its last
  byte, continuing the caller's ``traceparent``. Named as the call is (``POST
  /v1/chat/completions``, ``specmask.orchestrator.v1.OrchestratorService/Generate``),
  with vLLM's ``gen_ai.*`` attribute names where vLLM has one (request id, model,
  sampling, token counts, finish reason, latencies) and ``specmask.*`` for the rest
  (grammar, speculation).
* ``specmask.admission``: ``Engine.submit``, validation and the mask service's
  ``ValidateGrammar`` (whose server span is its child) up to the request's queueing.
* ``specmask.iteration``: one per worker iteration the request rode in, from the
  orchestrator's ``iterate`` call to its answer, with what the step did for it. Its
  context goes to the worker in the call's arguments: the worker's span for the
  iteration (``specmask.worker.iterate``) is the child of the oldest traced request's
  iteration span and links the others' (one call serves the whole batch), and the
  mask-service calls it makes are its children.

A span per request per iteration, not an event on the request span: the iteration's
duration and the worker and mask-service spans under it are what explains a slow
request, and an event can parent nothing. It costs the serving loop tens of
microseconds per traced request per iteration, so the spans are made only for
requests the sampler kept (a sampled-out request's iteration costs one attribute
read); docs/operations.md says how to sample.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager

from specmask.common import tracing
from specmask.common.tracing import NO_SPAN, Carrier, Span, SpanKind
from specmask.gpu_worker.types import FinishReason, StepOutput
from specmask.orchestrator.request import Request
from specmask.orchestrator.types import GenerationRequest

ADMISSION_SPAN = "specmask.admission"
ITERATION_SPAN = "specmask.iteration"


def start_request(
    name: str,
    incoming: Mapping[str, str] | Iterable[tuple[str, str]] | None,
    req: GenerationRequest,
    model: str,
    attributes: Mapping[str, str] | None = None,
) -> Span:
    """The request's span, a child of the caller's trace context among ``incoming`` (headers
    or metadata), not yet current. ``NO_SPAN`` while tracing is off."""
    if not tracing.enabled():
        return NO_SPAN
    sampling = req.sampling
    return tracing.start_span(
        name,
        parent=tracing.extract(incoming),
        kind=SpanKind.SERVER,
        attributes={
            **(attributes or {}),
            "gen_ai.request.id": req.request_id,
            "gen_ai.response.model": model,
            "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "specmask.grammar.kind": req.grammar.kind.value if req.grammar is not None else "none",
        },
    )


def admission(span: Span) -> AbstractContextManager[Span]:
    """Around ``Engine.submit``: the admission span, current inside (so ValidateGrammar's
    metadata carries it). A refusal (any exception) fails and ends the request span too:
    the handler answers at once. The shared no-op scope for ``NO_SPAN``."""
    return NO_SPAN.activate() if span is NO_SPAN else _admission(span)


@contextmanager
def _admission(span: Span) -> Iterator[Span]:
    with span.activate():
        child = tracing.start_span(ADMISSION_SPAN, parent=span)
        try:
            with child.activate():
                yield child
        except BaseException as exc:
            why = _refusal(exc)
            child.fail(why)
            child.end()
            span.fail(why)
            span.end()
            raise
        child.end()


def attach(span: Span, request: Request) -> None:
    """The admitted request carries its span: the engine's iteration spans are its children."""
    if span is NO_SPAN:
        return
    request.trace = span
    seq = request.seq
    span.set_attributes(
        {
            "gen_ai.usage.prompt_tokens": len(seq.prompt_token_ids),
            "gen_ai.request.max_tokens": seq.sampling.max_tokens,  # the default filled in
            "specmask.speculation.k": seq.speculation.k if seq.speculation.enabled else 0,
        }
    )
    if request.grammar is not None:
        span.set("specmask.grammar.enforcement", request.grammar.enforcement)
        span.set("specmask.grammar.backend", request.grammar.backend or None)


def finish(request: Request) -> None:
    """End the request's span with how it went (the handler's ``finally``: after the last
    byte, a stream's included). A request still running here was cut off by its client."""
    span = request.trace
    if span is NO_SPAN:
        return
    request.trace = NO_SPAN  # ended once, whichever path gets here first
    usage = request.usage
    reason = request.finish_reason
    span.set_attributes(
        {
            "gen_ai.usage.prompt_tokens": usage.prompt_tokens,
            "gen_ai.usage.completion_tokens": usage.completion_tokens,
            "gen_ai.response.finish_reasons": (reason.name.lower() if reason is not None else "client_gone",),
            "specmask.speculation.drafts_proposed": usage.drafts_proposed,
            "specmask.speculation.drafts_accepted": usage.drafts_accepted,
            "specmask.speculation.acceptance_rate": usage.acceptance_rate,
            "specmask.target_forwards": usage.target_forwards,
            "specmask.mask_wait_s": usage.mask_time_s,
            "specmask.attempts": request.attempts,
        }
    )
    now = time.monotonic()
    admitted, scheduled, first = request.admitted_time, request.scheduled_time, request.first_token_time
    if admitted is not None and scheduled is not None:
        span.set("gen_ai.latency.time_in_queue", scheduled - admitted)
    if first is not None:
        span.set("gen_ai.latency.time_to_first_token", first - request.arrival_time)
    span.set("gen_ai.latency.e2e", (request.finish_time or now) - request.arrival_time)
    if reason is FinishReason.GRAMMAR_VIOLATION:
        # Its reason may quote the output (a schema error names the offending value); spans
        # carry no output text, so the reason stays in the request's log line.
        span.fail(reason.name)
    elif reason is FinishReason.ERROR:
        span.fail(request.error or reason.name)
    span.end()


class IterationTraces:
    """The ``specmask.iteration`` spans of one ``iterate`` call: one per traced request of
    the worker's batch. ``NO_ITERATION`` (no spans, no call arguments) while tracing is off
    or no request of the batch is traced."""

    __slots__ = ("_spans",)

    def __init__(self, spans: dict[str, Span]) -> None:
        self._spans = spans  # request id -> its iteration span, oldest request first

    @staticmethod
    def start(worker: int, running: Mapping[str, Request]) -> IterationTraces:
        if not tracing.enabled():
            return NO_ITERATION
        spans: dict[str, Span] = {}
        for request_id, request in running.items():
            if request.trace.recording:
                spans[request_id] = tracing.start_span(
                    ITERATION_SPAN,
                    parent=request.trace,
                    attributes={"specmask.worker": worker, "specmask.iteration.batch_size": len(running)},
                )
        return IterationTraces(spans) if spans else NO_ITERATION

    @property
    def call_args(self) -> tuple[dict[str, Carrier], ...]:
        """Extra positional arguments of the ``iterate`` call: the spans' carriers (none: ())."""
        if not self._spans:
            return ()
        return ({request_id: span.carrier() for request_id, span in self._spans.items()},)

    def end(self, outputs: Sequence[StepOutput] = (), *, failure: str | None = None) -> None:
        if not self._spans:
            return
        by_id = {out.seq_id: out for out in outputs}
        for request_id, span in self._spans.items():
            out = by_id.get(request_id)
            if out is not None:
                span.set_attributes(
                    {
                        "specmask.iteration.new_tokens": len(out.new_token_ids),
                        "specmask.speculation.drafts_proposed": out.drafts_proposed,
                        "specmask.speculation.drafts_accepted": out.drafts_accepted,
                        "specmask.mask_wait_s": out.mask_time_s,
                    }
                )
                if out.finish_reason is not None:
                    span.set("specmask.iteration.finish_reason", out.finish_reason.name.lower())
            elif failure is None:
                span.set("specmask.iteration.new_tokens", 0)  # sat the step out (session opening, prefill)
            if failure is not None:
                span.fail(failure)
            span.end()


NO_ITERATION = IterationTraces({})


def _refusal(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    name = getattr(code, "name", None) or type(exc).__name__
    return f"{name}: {getattr(exc, 'message', None) or exc}"[:256]
