"""The orchestrator keeps the mask tier's verdicts on grammars (specmask/orchestrator/verdict_cache.py).

A grammar the tier judged recently costs a request no ValidateGrammar round trip; a
refusal for the grammar's own sake is answered again word for word without sending the
grammar; a cached acceptance is not used while the tier is unreachable (requests still
fail fast there). Real mask service, real router, real gRPC on 127.0.0.1; the router is
wrapped only to count its calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.mask_service.grammar.limits import GrammarLimits
from specmask.mask_service.server.server import MaskServiceHandle, build_service
from specmask.orchestrator.errors import InvalidRequest, Unavailable
from specmask.orchestrator.grammar_check import MaskServiceGrammarChecker
from specmask.orchestrator.types import GrammarReport
from specmask.orchestrator.verdict_cache import VerdictCache
from tests.mask_service.service_config import make_config

OK = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}}))
TOO_MANY = GrammarSpec(
    GrammarKind.JSON_SCHEMA,
    json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40)}}),
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hits_expiry_bound_and_what_is_kept() -> None:
    clock = FakeClock()
    cache = VerdictCache(max_entries=2, ttl_s=10.0, clock=clock)
    report = GrammarReport("exact", "xgrammar")
    assert cache.get("a", tier_reachable=True) is None
    cache.accepted("a", report)
    assert cache.get("a", tier_reachable=True) is report
    assert cache.get("a", tier_reachable=False) is None  # an acceptance needs a reachable tier

    cache.refused("bad", InvalidRequest("grammar refused: too deep", reason="GRAMMAR_LIMIT_ERROR", field="grammar"))
    for reachable in (True, False):  # a refusal holds whatever the tier's state
        with pytest.raises(InvalidRequest) as info:
            cache.get("bad", tier_reachable=reachable)
        assert (info.value.message, info.value.reason, info.value.field) == (
            "grammar refused: too deep",
            "GRAMMAR_LIMIT_ERROR",
            "grammar",
        )
    # Refusals that are not about the grammar itself are never kept.
    cache.refused("tok", InvalidRequest("unknown tokenizer", reason="UNKNOWN_TOKENIZER", field="grammar"))
    assert cache.get("tok", tier_reachable=True) is None

    cache.get("a", tier_reachable=True)  # "a" is now the most recently used
    cache.accepted("c", report)  # over the bound of 2: "bad" (least recently used) goes
    assert cache.get("bad", tier_reachable=True) is None and len(cache) == 2
    clock.now += 10.0  # the TTL has run out
    assert cache.get("a", tier_reachable=True) is None and cache.get("c", tier_reachable=True) is None
    assert len(cache) == 0

    off = VerdictCache(max_entries=0)
    off.accepted("a", report)
    assert off.get("a", tier_reachable=True) is None
    with pytest.raises(ValueError, match="ttl_s"):
        VerdictCache(ttl_s=0)


@pytest.fixture(scope="module")
def service(bpe_dir) -> Iterator[MaskServiceHandle]:
    handle = build_service(make_config(bpe_dir, grammar_limits=GrammarLimits(max_properties=20)))
    handle.server.start()
    yield handle
    handle.stop(grace_s=0)


def _checker(service: MaskServiceHandle, bpe_dir: Any, bpe_tokenizer: Any, **kw: Any) -> MaskServiceGrammarChecker:
    return MaskServiceGrammarChecker(
        (f"127.0.0.1:{service.port}",),
        tokenizer_id=tokenizer_id_for_path(bpe_dir),
        vocab_size=bpe_tokenizer.get_vocab_size(),
        deadline_s=30.0,
        max_retries=0,
        **kw,
    )


def _count_calls(checker: MaskServiceGrammarChecker) -> list[str]:
    calls: list[str] = []
    router = checker._router
    real = router.validate_grammar

    def counted(tokenizer_id: str, spec: GrammarSpec, *args: Any, **kwargs: Any) -> Any:
        calls.append(spec.cache_key())
        return real(tokenizer_id, spec, *args, **kwargs)

    router.validate_grammar = counted  # type: ignore[method-assign]  # counts the real calls
    return calls


def test_a_grammar_judged_recently_costs_no_round_trip(service, bpe_dir, bpe_tokenizer) -> None:
    checker = _checker(service, bpe_dir, bpe_tokenizer)
    calls = _count_calls(checker)
    try:
        first = checker.check(OK, client="client:a")
        assert checker.check(OK, client="client:b") == first  # another client: the same verdict
        assert first.backend == "xgrammar" and len(calls) == 1

        with pytest.raises(InvalidRequest) as refused:
            checker.check(TOO_MANY)
        with pytest.raises(InvalidRequest) as again:
            checker.check(TOO_MANY)
        assert len(calls) == 2  # the refused schema was not sent a second time
        assert (again.value.message, again.value.reason) == (refused.value.message, refused.value.reason)
        assert refused.value.reason == "GRAMMAR_LIMIT_ERROR" and "max_properties" in refused.value.message

        # While no replica answers health, a kept acceptance is not trusted: the tier is asked.
        checker.tier_reachable = lambda: False
        checker.check(OK)
        assert len(calls) == 3
    finally:
        checker.close()


def test_with_the_tier_down_a_kept_acceptance_does_not_hide_it(bpe_dir, bpe_tokenizer) -> None:
    """The server trusts kept acceptances only while its readiness probe sees a replica: with
    every replica gone, a known grammar fails at validation (UNAVAILABLE) as before."""
    handle = build_service(make_config(bpe_dir))
    handle.server.start()
    checker = _checker(handle, bpe_dir, bpe_tokenizer)
    try:
        checker.check(OK)
        handle.stop(grace_s=0)
        checker.tier_reachable = lambda: False  # what the readiness probe reports now
        with pytest.raises(Unavailable):
            checker.check(OK)
    finally:
        checker.close()
        handle.stop(grace_s=0)


def test_off_asks_every_time(service, bpe_dir, bpe_tokenizer) -> None:
    checker = _checker(service, bpe_dir, bpe_tokenizer, verdicts=VerdictCache(max_entries=0))
    calls = _count_calls(checker)
    try:
        checker.check(OK)
        checker.check(OK)
        assert len(calls) == 2
    finally:
        checker.close()
