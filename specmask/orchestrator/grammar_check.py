"""Grammar validation through the mask service (ValidateGrammar), before any GPU work.

The orchestrator asks the same engine the workers will use, so a grammar that
passes here compiles for the worker's session too (the compiled grammar is
then already in the replica's cache). The router fails over between replicas;
each call has a deadline and bounded retries. Concurrent checks of one grammar
for one client share one call (single_flight.py), so a burst with a schema the
replica has not compiled yet waits on its compile once, not once per request.
The tier's answers are kept for a while (verdict_cache.py), so a grammar it has
judged recently costs no round trip at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from specmask.common.grammar_spec import GrammarSpec
from specmask.gpu_worker.mask_errors import MASK_TIER_UNAVAILABLE
from specmask.mask_service.client.mask_client import MaskServiceError
from specmask.mask_service.client.router import MaskRouter
from specmask.orchestrator.errors import GrammarTimeout, InvalidRequest, Overloaded, Unavailable
from specmask.orchestrator.single_flight import SingleFlight
from specmask.orchestrator.types import GrammarReport
from specmask.orchestrator.verdict_cache import VerdictCache

logger = logging.getLogger(__name__)


class MaskServiceGrammarChecker:
    """``validation.GrammarChecker`` backed by the mask-service replicas."""

    def __init__(
        self,
        addresses: tuple[str, ...],
        *,
        tokenizer_id: str,
        vocab_size: int,
        deadline_s: float,
        max_retries: int,
        verdicts: VerdictCache | None = None,
    ) -> None:
        self._router = MaskRouter(list(addresses), deadline_s=deadline_s, max_retries=max_retries)
        self.verdicts = verdicts if verdicts is not None else VerdictCache()
        # Whether a mask replica answers health now (the readiness probe's view, set by the
        # server): a cached acceptance is used only then (verdict_cache.py).
        self.tier_reachable: Callable[[], bool] = lambda: True
        self._tokenizer_id = tokenizer_id
        self._vocab_size = vocab_size
        # Keyed by (grammar, client): a client's burst shares its own call, and the
        # replica's per-owner compile fairness still sees every client that asks.
        self._flights: SingleFlight[GrammarReport] = SingleFlight()

    def check(self, spec: GrammarSpec, client: str = "") -> GrammarReport:
        """``client``: the end client (orchestrator.client_identity), the replica's compile-queue owner."""
        key = spec.cache_key()
        cached = self.verdicts.get(key, tier_reachable=self.tier_reachable())  # raises a cached refusal
        if cached is not None:
            return cached
        return self._flights.run((key, client), lambda: self._check(spec, client, key))

    def _check(self, spec: GrammarSpec, client: str, key: str) -> GrammarReport:
        """Ask the tier; keep its verdict under ``key`` (``spec.cache_key()``, as ``check`` looked it up)."""
        try:
            resp = self._router.validate_grammar(self._tokenizer_id, spec, self._vocab_size, client=client)
        except MaskServiceError as exc:
            if exc.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                # The mask service's reason (e.g. GRAMMAR_TOO_COMPLEX) reaches the client as is.
                reason = exc.reason or "GRAMMAR_INVALID"
                refusal = InvalidRequest(f"grammar refused: {exc.message}", reason=reason, field="grammar")
                self.verdicts.refused(key, refusal)
                raise refusal from None
            if exc.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise GrammarTimeout(f"grammar validation timed out: {exc.message}") from None
            if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                # The compile queue is full or the grammar is still compiling: back off and
                # retry (a grammar over a limit or over budget is INVALID_ARGUMENT above).
                raise Overloaded(f"mask service busy compiling grammars: {exc.message}") from None
            # The router's text names replica addresses: it goes to the log, not to the client.
            logger.warning("grammar validation failed (%s): %s", exc.code.name, exc.message)
            raise Unavailable(
                f"{MASK_TIER_UNAVAILABLE}: no mask service replica could validate the grammar; retry"
            ) from None
        report = GrammarReport(
            enforcement=resp.enforcement or "exact", backend=resp.backend, relaxed=tuple(resp.relaxed)
        )
        self.verdicts.accepted(key, report)
        return report

    def release_sessions(self, owner: str) -> int:
        """Close every mask session a lost GPU worker (``owner``) left open, on every
        reachable replica; returns how many. Blocking (gRPC): call off the event loop."""
        return self._router.release_owner(owner)

    def close(self) -> None:
        self._router.close()
