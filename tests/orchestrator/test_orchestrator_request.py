"""Per-request state: step outputs in, client events out (deltas, stop strings, final usage)."""

from __future__ import annotations

import asyncio

from specmask.gpu_worker.types import FinishReason, NewSequence, StepOutput
from specmask.orchestrator.request import Request


def _seq(prompt=(1, 2, 3)) -> NewSequence:
    return NewSequence(seq_id="req-1", prompt_token_ids=tuple(prompt), grammar=None)


def _events(request: Request) -> list:
    async def collect():
        return [e async for e in request.events()]

    return asyncio.run(collect())


def _steps(tokenizer, text: str, per_step: int = 2) -> list[StepOutput]:
    ids = tokenizer.encode(text).ids
    return [
        StepOutput(
            "req-1",
            ids[i : i + per_step],
            drafts_proposed=3,
            drafts_accepted=per_step - 1,
            target_forwards=1,
            mask_time_s=0.001,
        )
        for i in range(0, len(ids), per_step)
    ]


def test_deltas_concatenate_and_usage_accumulates(bpe_tokenizer) -> None:
    text = '{"city":"Zürich 🙂","n":12}'
    request = Request(_seq(), tokenizer=bpe_tokenizer)
    outs = _steps(bpe_tokenizer, text)
    for out in outs:
        assert request.apply_step(out) is False
    request.finish(FinishReason.GRAMMAR_COMPLETE)
    events = _events(request)
    assert "".join(e.text for e in events) == text == request.text
    assert [t for e in events for t in e.token_ids] == bpe_tokenizer.encode(text).ids
    final = events[-1]
    assert final.finished and final.finish_reason is FinishReason.GRAMMAR_COMPLETE
    assert not any(e.finished for e in events[:-1])
    u = final.usage
    assert u.prompt_tokens == 3 and u.completion_tokens == len(bpe_tokenizer.encode(text).ids)
    assert u.target_forwards == len(outs) and u.drafts_proposed == 3 * len(outs)
    assert u.tokens_per_target_forward == u.completion_tokens / len(outs)
    assert request.first_token_time is not None and request.finish_time >= request.first_token_time


def test_stop_string_truncates_text(bpe_tokenizer) -> None:
    request = Request(_seq(), tokenizer=bpe_tokenizer, stop=("STOP",))
    hit = [request.apply_step(out) for out in _steps(bpe_tokenizer, "hello world STOP and more", per_step=1)]
    assert hit.count(True) >= 1
    request.finish(FinishReason.STOP)
    events = _events(request)
    assert "".join(e.text for e in events) == request.text == "hello world "


def test_finish_releases_held_back_text(bpe_tokenizer) -> None:
    # "ST" might begin "STOP": held back until generation ends, then released.
    request = Request(_seq(), tokenizer=bpe_tokenizer, stop=("STOP",))
    for out in _steps(bpe_tokenizer, "abc ST"):
        assert not request.apply_step(out)
    request.finish(FinishReason.LENGTH)
    assert request.text == "abc ST"
    assert "".join(e.text for e in _events(request)) == "abc ST"


def test_finish_is_idempotent_and_carries_error(bpe_tokenizer) -> None:
    request = Request(_seq(), tokenizer=bpe_tokenizer)
    request.finish(FinishReason.ERROR, "mask service unreachable")
    request.finish(FinishReason.CANCELLED)
    events = _events(request)
    assert len(events) == 1
    assert events[0].finish_reason is FinishReason.ERROR and events[0].error == "mask service unreachable"
    assert request.apply_step(StepOutput("req-1", [5])) is False  # ignored after finish


def test_result(bpe_tokenizer) -> None:
    request = Request(_seq(), tokenizer=bpe_tokenizer)
    for out in _steps(bpe_tokenizer, "[1,2,3]"):
        request.apply_step(out)
    request.finish(FinishReason.STOP)
    result = asyncio.run(request.result())
    assert result.text == "[1,2,3]" and result.finish_reason is FinishReason.STOP
    assert list(result.token_ids) == bpe_tokenizer.encode("[1,2,3]").ids


def _checked_request(tokenizer, max_attempts: int = 3) -> Request:
    from specmask.orchestrator.types import GrammarReport

    report = GrammarReport("checked", "xgrammar", relaxed=("uniqueItems",))
    return Request(_seq(), tokenizer=tokenizer, grammar=report, max_attempts=max_attempts)


def test_checked_request_holds_output_until_released(bpe_tokenizer) -> None:
    """Checked mode: no delta of an attempt that may be discarded; a restart discards it."""
    request = _checked_request(bpe_tokenizer)
    for out in _steps(bpe_tokenizer, "[1,1]"):
        request.apply_step(out)
    assert request._events.empty() and request.text == ""  # nothing sent yet
    assert request.may_resample
    request.restart(_seq())  # the end check failed: the next attempt starts clean
    assert (request.attempts, request.token_ids, request.usage.completion_tokens) == (2, [], 0)
    for out in _steps(bpe_tokenizer, "[1,2]"):
        request.apply_step(out)
    assert request._events.empty()
    request.finish(FinishReason.GRAMMAR_COMPLETE)
    events = _events(request)
    assert [e.text for e in events if not e.finished] == ["[1,2]"]  # one delta, the passing attempt only
    assert request.text == "[1,2]" and events[-1].grammar.attempts == 2
    assert events[-1].grammar.enforcement == "checked" and events[-1].usage.target_forwards == 6  # both attempts


def test_checked_request_failure_returns_no_text(bpe_tokenizer) -> None:
    request = _checked_request(bpe_tokenizer, max_attempts=1)
    for out in _steps(bpe_tokenizer, "[1,1]"):
        request.apply_step(out)
    assert not request.may_resample
    request.finish(FinishReason.GRAMMAR_VIOLATION, "grammar violation: duplicate items")
    result = asyncio.run(request.result())  # consumes the events: only the final one, without text
    assert result.text == "" and result.token_ids == () and result.grammar.attempts == 1
    assert result.finish_reason is FinishReason.GRAMMAR_VIOLATION and request._events.empty()
