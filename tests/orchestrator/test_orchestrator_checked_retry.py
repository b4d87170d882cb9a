"""Finishing grammar requests: the end check's outcome, checked mode's seeds and messages, and
``EndCheck`` run with the real output checker on real requests."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, StepOutput
from specmask.orchestrator.checked_retry import (
    SEED_STRIDE,
    EndCheck,
    EndOutcome,
    end_outcome,
    exhausted_message,
    fresh_seed,
)
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.output_check import OutputChecker, OutputCheckError
from specmask.orchestrator.request import Request
from specmask.orchestrator.types import GrammarReport


@pytest.mark.parametrize(
    ("ok", "checked", "may_resample", "expected"),
    [
        (True, False, False, EndOutcome.PASSED),
        (True, True, True, EndOutcome.PASSED),
        (False, False, False, EndOutcome.VIOLATION),
        (False, False, True, EndOutcome.VIOLATION),  # exact mode never resamples
        (False, True, True, EndOutcome.RESAMPLE),
        (False, True, False, EndOutcome.EXHAUSTED),
    ],
)
def test_end_outcome(ok: bool, checked: bool, may_resample: bool, expected: EndOutcome) -> None:
    assert end_outcome(ok, checked=checked, may_resample=may_resample) is expected


def test_a_seeded_request_replays_its_attempts_and_no_two_share_a_seed() -> None:
    base = SamplingParams(temperature=0.8, seed=12345, max_tokens=7)
    seeds = [fresh_seed(base, n).seed for n in range(1, 50)]
    assert seeds == [fresh_seed(base, n).seed for n in range(1, 50)]  # deterministic
    assert len(set(seeds)) == len(seeds) and base.seed not in seeds
    assert seeds[0] == (base.seed + SEED_STRIDE) & ((1 << 63) - 1)
    again = fresh_seed(base, 3)
    assert (again.temperature, again.max_tokens) == (0.8, 7)  # only the seed changes


def test_seeds_stay_within_63_bits_at_the_extremes() -> None:
    top = (1 << 63) - 1
    for seed in (0, top, top - 1):
        for attempt in (1, 2, 1 << 40):
            got = fresh_seed(SamplingParams(seed=seed), attempt).seed
            assert got is not None and 0 <= got <= top


def test_an_unseeded_request_draws_a_new_seed_each_attempt() -> None:
    seeds = {fresh_seed(SamplingParams(seed=None), 1).seed for _ in range(20)}
    assert None not in seeds and len(seeds) > 1
    assert all(0 <= s < (1 << 63) for s in seeds if s is not None)


def test_exhausted_message_says_why_greedy_gets_one_attempt() -> None:
    greedy = exhausted_message(max_attempts=1, attempts=1, temperature=0.0, reason="truncated")
    assert "greedy decoding is deterministic" in greedy and greedy.endswith("truncated")
    sampled = exhausted_message(max_attempts=3, attempts=3, temperature=0.7, reason="extra key")
    assert "all 3 attempts" in sampled and "last: extra key" in sampled
    assert greedy.startswith("grammar violation") and sampled.startswith("grammar violation")


class _Finished:
    """What EndCheck asked the engine to do (its finish and resample callbacks)."""

    def __init__(self) -> None:
        self.finished: list[tuple[Request, FinishReason, str | None]] = []
        self.resampled: list[tuple[Request, str]] = []

    def finish(self, request: Request, reason: FinishReason, error: str | None) -> None:
        request.finish(reason, error)
        self.finished.append((request, reason, error))

    def resample(self, request: Request, why: str) -> None:
        self.resampled.append((request, why))


_REGEX = GrammarSpec(GrammarKind.REGEX, "(yes|no)")


def _request(tokenizer, text: str, *, enforcement: str = "exact", max_attempts: int = 1) -> Request:
    seq = NewSequence("r-1", (1, 2), _REGEX, sampling=SamplingParams(temperature=0.7, seed=1))
    report = GrammarReport(enforcement=enforcement, backend="xgrammar")
    request = Request(seq, tokenizer=tokenizer, grammar=report, max_attempts=max_attempts)
    request.apply_step(StepOutput("r-1", tokenizer.encode(text).ids, FinishReason.GRAMMAR_COMPLETE))
    return request


def _run(tokenizer, request: Request, checker: OutputChecker) -> tuple[_Finished, OrchestratorMetrics]:
    seen = _Finished()
    metrics = OrchestratorMetrics(CollectorRegistry())

    async def go() -> None:
        end = EndCheck(checker, tokenizer, metrics, finish=seen.finish, resample=seen.resample)
        end.finish_checked(request)
        for _ in range(500):
            if seen.finished or seen.resampled:
                break
            await asyncio.sleep(0.01)
        await end.stop()

    asyncio.run(go())
    return seen, metrics


def _count(metrics: OrchestratorMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_an_output_that_passes_finishes_grammar_complete(bpe_tokenizer) -> None:
    seen, _ = _run(bpe_tokenizer, _request(bpe_tokenizer, "yes"), OutputChecker())
    assert [(reason, error) for _, reason, error in seen.finished] == [(FinishReason.GRAMMAR_COMPLETE, None)]


def test_an_exact_output_that_fails_is_a_counted_violation(bpe_tokenizer) -> None:
    seen, metrics = _run(bpe_tokenizer, _request(bpe_tokenizer, "maybe"), OutputChecker())
    [(_, reason, error)] = seen.finished
    assert reason is FinishReason.GRAMMAR_VIOLATION and error is not None and error.startswith("grammar violation")
    assert _count(metrics, "specmask_grammar_violations_total", stage="output_check") == 1


def test_a_checker_that_breaks_fails_closed(bpe_tokenizer) -> None:
    class Broken(OutputChecker):
        def check(self, spec, text, engine=""):
            raise OutputCheckError("injected")

    seen, _ = _run(bpe_tokenizer, _request(bpe_tokenizer, "yes"), Broken())
    [(_, reason, error)] = seen.finished
    assert reason is FinishReason.GRAMMAR_VIOLATION and error is not None and "could not be verified" in error


def test_checked_mode_resamples_while_attempts_are_left_then_gives_up(bpe_tokenizer) -> None:
    request = _request(bpe_tokenizer, "maybe", enforcement="checked", max_attempts=2)
    seen, metrics = _run(bpe_tokenizer, request, OutputChecker())
    assert not seen.finished and [r for r, _ in seen.resampled] == [request]
    assert _count(metrics, "specmask_checked_attempts_total", outcome="resampled") == 1

    last = _request(bpe_tokenizer, "maybe", enforcement="checked", max_attempts=1)
    seen, metrics = _run(bpe_tokenizer, last, OutputChecker())
    [(_, reason, error)] = seen.finished
    assert reason is FinishReason.GRAMMAR_VIOLATION and error is not None and "checked mode" in error
    assert _count(metrics, "specmask_checked_attempts_total", outcome="exhausted") == 1
    # A checked-mode failure is the relaxation's expected price, not a violation of an exact grammar.
    assert _count(metrics, "specmask_grammar_violations_total", stage="output_check") == 0
