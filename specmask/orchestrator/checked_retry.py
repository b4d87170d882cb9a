"""Finishing a grammar request: the end-of-request check, and checked mode's resampling.

Never lie: a grammar request the worker reports GRAMMAR_COMPLETE (or a stop string ended:
STOP) is finished only after ``output_check`` accepts its final text against the caller's
grammar, on an executor of its own (off the loop); otherwise, or if the check itself fails,
it finishes with GRAMMAR_VIOLATION and a typed error, counted in
``specmask_grammar_violations`` and logged with the grammar's hash. In checked mode (a
relaxation masked the output) a failed check instead queues the request again with a fresh
seed while attempts are left (``end_outcome``, ``fresh_seed``). See docs/design.md,
"Who runs what", and docs/grammars.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from specmask.gpu_worker.types import FinishReason, SamplingParams
from specmask.orchestrator.detokenizer import Decoder
from specmask.orchestrator.kept_tokens import KeptToken, decoder_for, finder, kept_in
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.output_check import OutputChecker, OutputCheckError, Verdict
from specmask.orchestrator.request import Request
from specmask.orchestrator.validation import ValidatedRequest

logger = logging.getLogger(__name__)

# Checked mode: attempt n of a seeded request uses seed + n * this (odd, so attempts never share a seed).
SEED_STRIDE = 0x9E3779B97F4A7C15
# End-of-request output checks (short CPU work) have threads of their own: on the
# validation pool they queued behind validations blocked for seconds on a grammar
# compile, so a flood of new schemas delayed every request's completion.
_OUTPUT_CHECK_THREADS = 2

# finish(request, reason, error) and resample(request, why): LiveRequests' (it owns the queue).
Finish = Callable[[Request, FinishReason, str | None], None]
Resample = Callable[[Request, str], None]


class EndOutcome(enum.Enum):
    """What a finished end check does with its request."""

    PASSED = "passed"  # finish with the worker's (or the stop string's) reason
    RESAMPLE = "resampled"  # checked mode, attempts left: queue it again with a fresh seed
    EXHAUSTED = "exhausted"  # checked mode, no attempt left: GRAMMAR_VIOLATION
    VIOLATION = "violation"  # exact mode: GRAMMAR_VIOLATION (a bug or an engine's fault: logged as one)


def end_outcome(ok: bool, *, checked: bool, may_resample: bool) -> EndOutcome:
    """The outcome of an end check that passed (``ok``) or not, in checked mode or exact."""
    if ok:
        return EndOutcome.PASSED
    if not checked:
        return EndOutcome.VIOLATION
    return EndOutcome.RESAMPLE if may_resample else EndOutcome.EXHAUSTED


def fresh_seed(sampling: SamplingParams, attempt: int) -> SamplingParams:
    """The sampling of attempt ``attempt + 1``: a seeded request derives its seeds (so it replays
    exactly), an unseeded one draws a new one."""
    if sampling.seed is None:
        seed = secrets.randbits(63)
    else:
        seed = (sampling.seed + attempt * SEED_STRIDE) & ((1 << 63) - 1)
    return dataclasses.replace(sampling, seed=seed)


def exhausted_message(*, max_attempts: int, attempts: int, temperature: float, reason: str) -> str:
    """The error of a checked-mode request whose every attempt failed the end check."""
    if max_attempts == 1 and temperature == 0.0:
        why = "greedy decoding is deterministic, so a resample would repeat this output; send temperature > 0"
        return f"grammar violation (checked mode, 1 attempt: {why}): {reason}"
    return f"grammar violation (checked mode, all {attempts} attempts failed the end check; last: {reason})"


def log_violation(request: Request, stage: str, reason: str) -> None:
    spec = request.seq.grammar
    request.log.error(
        "GRAMMAR VIOLATION caught by %s: grammar %s hash=%s: %s",
        stage,
        spec.kind.value if spec is not None else "none",
        spec.cache_key()[:16] if spec is not None else "-",
        reason,
    )


class EndCheck:
    """Runs grammar requests' end checks off the loop and finishes each by its outcome."""

    def __init__(
        self,
        checker: OutputChecker,
        tokenizer: Decoder,
        metrics: OrchestratorMetrics,
        *,
        finish: Finish,
        resample: Resample,
    ) -> None:
        self._checker = checker
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._finish = finish
        self._resample = resample
        self._executor = ThreadPoolExecutor(_OUTPUT_CHECK_THREADS, thread_name_prefix="output-check")
        self._checking: set[asyncio.Task] = set()  # end checks in flight

    async def stop(self) -> None:
        """Cancel the checks in flight (their requests were cancelled) and drop the threads."""
        for task in list(self._checking):
            task.cancel()
        await asyncio.gather(*self._checking, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def stop_may_end(self, validated: ValidatedRequest) -> Callable[[str], bool] | None:
        """For a grammar request with stop strings: whether its output may end with a text
        (the end check, run on the loop: only at a stop match, at most MAX_END_CHECKS times)."""
        spec = validated.seq.grammar
        if spec is None:
            return None
        engine = validated.grammar.backend if validated.grammar is not None else ""
        checker = self._checker
        # The probe has the text alone: a kept token's text is read as the token there (the
        # end check of the finished output reads where the tokens are from the ids).
        find = finder(decoder_for(self._tokenizer, spec))

        def may_end(text: str) -> bool:
            try:
                return checker.check(spec, text, engine, find(text)).ok
            except OutputCheckError:
                return False

        return may_end

    def finish_checked(self, request: Request, reason: FinishReason = FinishReason.GRAMMAR_COMPLETE) -> None:
        """Finish a grammar request the worker calls complete (or a stop string ended: ``reason``
        STOP), once its text passes the end check."""
        assert request.seq.grammar is not None
        spec = request.seq.grammar
        # The text the client gets: with the special tokens the grammar names (kept_tokens.py).
        decoder = decoder_for(self._tokenizer, spec)
        ids = list(request.token_ids)
        text = request.stop_text if reason is FinishReason.STOP else decoder.decode(ids, skip_special_tokens=True)
        engine = request.grammar.backend if request.grammar is not None else ""

        def check() -> Verdict:
            try:
                # A stop string's text is a prefix of the whole output's: the tokens within it.
                tokens: list[KeptToken] = [t for t in kept_in(decoder, ids) if t.offset + len(t.text) <= len(text)]
                return self._checker.check(spec, text, engine, tokens)
            except OutputCheckError as exc:  # fail closed: unverifiable is not valid
                return Verdict(False, f"the output could not be verified ({exc})")
            except ValueError as exc:  # a kept token the text does not hold where it is
                return Verdict(False, f"the output could not be verified ({exc})")

        async def run() -> None:
            try:
                verdict = await asyncio.get_running_loop().run_in_executor(self._executor, check)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # e.g. the executor is gone: still never a success
                verdict = Verdict(False, f"the output could not be verified ({exc!r})")
            if request.finished:  # cancelled meanwhile
                return
            self._conclude(request, reason, verdict)

        task = asyncio.create_task(run(), name=f"output-check-{request.request_id}")
        self._checking.add(task)
        task.add_done_callback(self._checking.discard)

    def _conclude(self, request: Request, reason: FinishReason, verdict: Verdict) -> None:
        checked = request.grammar is not None and request.grammar.checked
        outcome = end_outcome(verdict.ok, checked=checked, may_resample=request.may_resample)
        if checked:
            self._metrics.checked_attempts.labels(outcome=outcome.value).inc()
        if outcome is EndOutcome.PASSED:
            self._finish(request, reason, None)
        elif outcome is EndOutcome.RESAMPLE:
            self._resample(request, verdict.reason)
        elif outcome is EndOutcome.EXHAUSTED:
            message = exhausted_message(
                max_attempts=request.max_attempts,
                attempts=request.attempts,
                temperature=request.seq.sampling.temperature,
                reason=verdict.reason,
            )
            self._finish(request, FinishReason.GRAMMAR_VIOLATION, message)
        else:
            self._metrics.grammar_violations.labels(stage="output_check").inc()
            log_violation(request, "output_check", verdict.reason)
            self._finish(request, FinishReason.GRAMMAR_VIOLATION, f"grammar violation: {verdict.reason}")
