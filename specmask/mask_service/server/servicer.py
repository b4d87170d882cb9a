"""gRPC servicer: translates protobuf <-> domain calls and maps errors to status codes. No logic."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from specmask.common import tracing
from specmask.mask_service.auth import CLIENT_METADATA_KEY
from specmask.mask_service.convert import grammar_from_proto
from specmask.mask_service.errors import GrammarError, MaskError
from specmask.mask_service.grammar.backends import enforcement_of, engine_name
from specmask.mask_service.server import metrics
from specmask.mask_service.server.compiler_cache import CompilerCache
from specmask.mask_service.server.draft_masks import DraftMaskEngine, DraftRequest
from specmask.mask_service.server.sessions import SessionStore
from specmask.mask_service.wire import ClientBeliefs
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2_grpc as pb_grpc
from specmask.proto.rpc_status import reason_from_class, status_for

logger = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_AFTER_METADATA_KEY = "retry-after-ms"
# The calls traced when their metadata carries a trace (common.tracing.server_span): named
# as OpenTelemetry's gRPC conventions name a server span, "package.Service/Method".
_SERVICE = pb.DESCRIPTOR.services_by_name["MaskService"].full_name
_RPC_ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": _SERVICE}


def _span_name(method: str) -> str:
    return f"{_SERVICE}/{method}"


def compile_owner(context: grpc.ServicerContext, owner: str) -> str:
    """Whose compile this is, for the compile queue's round-robin."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_METADATA_KEY and value:
            return str(value)[:256]
    if owner:
        return owner
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0]  # the host, not the ephemeral port


class MaskServicer(pb_grpc.MaskServiceServicer):
    def __init__(self, cache: CompilerCache, sessions: SessionStore, engine: DraftMaskEngine) -> None:
        self._cache = cache
        self._sessions = sessions
        self._engine = engine
        self._beliefs = ClientBeliefs()
        # A new epoch per process: clients see in responses when the server restarted.
        self.epoch = uuid.uuid4().hex

    def _guard(self, context: grpc.ServicerContext, fn: Callable[[], T], what: str) -> T:
        try:
            return fn()
        except MaskError as exc:
            logger.info("%s -> %s: %s", what, exc.code.name, exc.message)
            metrics.RPC_ERRORS.labels(exc.code.name).inc()
            retry_after = getattr(exc, "retry_after_s", None)
            # Back-off hint for RESOURCE_EXHAUSTED (compile queue): RetryInfo, and the plain trailer.
            trailers = () if retry_after is None else ((RETRY_AFTER_METADATA_KEY, str(int(retry_after * 1000))),)
            status = status_for(
                exc.code,
                exc.message,
                reason=reason_from_class(exc),  # e.g. GRAMMAR_TOO_COMPLEX (specmask/proto/rpc_status.py)
                bad_fields=(("grammar", exc.message),) if isinstance(exc, GrammarError) else (),
                retry_after_s=retry_after,
                extra_trailers=trailers,
            )
            context.abort_with_status(status)
        except Exception:
            logger.exception("%s failed", what)
            metrics.RPC_ERRORS.labels("INTERNAL").inc()
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {what}")
        raise AssertionError("unreachable")

    def _compile(self, target: pb.GrammarTarget, context: grpc.ServicerContext, owner: str = "") -> tuple[Any, bool]:
        spec = grammar_from_proto(target.grammar).without_budget()  # a budget is the session's
        remaining = context.time_remaining()  # None without a client deadline
        return self._cache.get(
            target.tokenizer_id,
            target.vocab_size or None,
            spec,
            owner=compile_owner(context, owner),
            wait_s=remaining,
        )

    def ValidateGrammar(
        self, request: pb.ValidateGrammarRequest, context: grpc.ServicerContext
    ) -> pb.ValidateGrammarResponse:
        def run() -> pb.ValidateGrammarResponse:
            entry, hit = self._compile(request.target, context)
            enforcement, relaxed = enforcement_of(entry.compiled)
            metrics.GRAMMAR_VALIDATIONS.labels(engine_name(entry.compiled, entry.backend), enforcement).inc()
            return pb.ValidateGrammarResponse(
                compiled_bytes=entry.size_bytes,
                cache_hit=hit,
                backend=engine_name(entry.compiled, entry.backend),
                enforcement=enforcement,
                relaxed=relaxed,
            )

        with tracing.server_span(_span_name("ValidateGrammar"), context.invocation_metadata, _RPC_ATTRIBUTES):
            return self._guard(context, run, "ValidateGrammar")

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext) -> pb.OpenSessionResponse:
        def run() -> pb.OpenSessionResponse:
            entry, _ = self._compile(request.target, context, request.owner)
            section = grammar_from_proto(request.target.grammar).reasoning
            s = self._sessions.open(
                entry,
                entry.vocab_size,
                owner=request.owner,
                request_id=request.request_id,
                section_budget=section if section is not None and section.max_tokens else None,
            )
            metrics.SESSIONS_OPENED.inc()
            # Off this RPC's path: the first forced request of the session then finds it built.
            self._engine.warm_forced(entry.key[0], entry.compiled.tokenizer_info)
            logger.info("%ssession %s opened (tokenizer %s)", s.log_prefix, s.session_id, request.target.tokenizer_id)
            stops = list(entry.compiled.tokenizer_info.stop_token_ids)
            return pb.OpenSessionResponse(
                session_id=s.session_id,
                vocab_size=s.vocab_size,
                num_mask_words=s.num_mask_words,
                stop_token_ids=stops,
                backend=engine_name(entry.compiled, entry.backend),
                enforcement=enforcement_of(entry.compiled)[0],
            )

        prefix = f"[request_id={request.request_id[:256]}] " if request.request_id else ""
        with tracing.server_span(_span_name("OpenSession"), context.invocation_metadata, _RPC_ATTRIBUTES):
            return self._guard(context, run, f"{prefix}OpenSession")

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        def run() -> pb.CommitResponse:
            s = self._sessions.get(request.session_id)
            with s.lock:
                applied = s.commit_locked(request.seq, list(request.tokens))
                return pb.CommitResponse(terminated=bool(s.matcher.is_terminated()), applied=applied)

        prefix = self._sessions.log_prefix_of(request.session_id)
        return self._guard(context, run, f"{prefix}Commit[{request.session_id}]")

    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext) -> pb.CloseSessionResponse:
        return self._guard(
            context,
            lambda: pb.CloseSessionResponse(existed=self._sessions.close(request.session_id, request.owner)),
            "CloseSession",
        )

    def ReleaseOwner(self, request: pb.ReleaseOwnerRequest, context: grpc.ServicerContext) -> pb.ReleaseOwnerResponse:
        return self._guard(
            context, lambda: pb.ReleaseOwnerResponse(closed=self._sessions.release_owner(request.owner)), "ReleaseOwner"
        )

    def SessionCount(self, request: pb.SessionCountRequest, context: grpc.ServicerContext) -> pb.SessionCountResponse:
        return pb.SessionCountResponse(count=len(self._sessions))

    def DraftMasks(self, request: pb.DraftMasksRequest, context: grpc.ServicerContext) -> pb.DraftMasksResponse:
        def run() -> pb.DraftMasksResponse:
            t0 = time.perf_counter()
            reqs = [
                DraftRequest(
                    session_id=it.session_id,
                    draft_tokens=list(it.draft_tokens),
                    commit_tokens=list(it.commit_tokens),
                    commit_seq=it.commit_seq,
                    last_row_only=it.last_row_only,
                    forced_up_to=it.forced_up_to,
                    forced_rows=it.forced_rows,
                    shared_spellings=it.shared_spellings,
                )
                for it in request.items
            ]
            outcomes, width = self._engine.run(reqs)
            resp = pb.DraftMasksResponse(num_mask_words=width, server_epoch=self.epoch)
            rows = []
            for req, out in zip(reqs, outcomes):
                r = resp.results.add(
                    num_rows=out.num_rows,
                    num_grammar_accepted=out.num_grammar_accepted,
                    terminated=out.terminated,
                    forced_tokens=out.forced_tokens,
                    forced_at_stop=out.forced_at_stop,
                    num_forced_rows=len(out.forced_rows),
                )
                if out.error is not None:
                    r.error_code = out.error.code.value[0]  # the status's number (grpc.StatusCode value)
                    r.error_message = out.error.message
                    logger.info(
                        "%sDraftMasks[%s] -> %s: %s",
                        self._sessions.log_prefix_of(req.session_id),
                        req.session_id,
                        out.error.code.name,
                        out.error.message,
                    )
                    metrics.RPC_ERRORS.labels(out.error.code.name).inc()
                rows.extend(out.rows)
                rows.extend(out.forced_rows)  # row_ids: the item's rows, then its forced rows
            self._beliefs.encode_response_rows(request.client_id, request.dict_generation, rows, resp)
            metrics.DRAFT_ROWS.inc(len(rows))
            metrics.NEW_ROWS.inc(len(resp.new_rows))
            metrics.DRAFT_CALL_SECONDS.observe(time.perf_counter() - t0)
            return resp

        with tracing.server_span(_span_name("DraftMasks"), context.invocation_metadata, _RPC_ATTRIBUTES) as span:
            response = self._guard(context, run, "DraftMasks")
            if span.recording:
                span.set_attributes(
                    {"specmask.mask.items": len(request.items), "specmask.mask.rows": len(response.row_ids)}
                )
            return response
