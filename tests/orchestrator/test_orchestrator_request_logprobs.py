"""Logprob entries follow the text a request returns: same tokens, same trimming.

The entries' numbers are the worker's (tested in tests/gpu_worker/test_logprobs.py); here
each is tagged with its position so the pairing of entries with text can be checked: every
entry is sent once, with the event whose text holds the token's first character, and a stop
string's tokens never are.
"""

from __future__ import annotations

import asyncio

import pytest

from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, StepOutput, TokenLogprob
from specmask.orchestrator.request import Request
from specmask.orchestrator.types import GrammarReport


def _seq(logprobs: int | None = 2) -> NewSequence:
    return NewSequence("req-1", (1, 2, 3), None, SamplingParams(logprobs=logprobs))


def _steps(ids: list[int], per_step: int) -> list[StepOutput]:
    """Steps of the worker, each entry's logprob -position (a tag) and two alternatives."""
    return [
        StepOutput(
            "req-1",
            ids[i : i + per_step],
            logprobs=[
                TokenLogprob(t, -float(i + j), ((t, -0.5), (7, -1.5))) for j, t in enumerate(ids[i : i + per_step])
            ],
        )
        for i in range(0, len(ids), per_step)
    ]


def _events(request: Request) -> list:
    async def collect():
        return [e async for e in request.events()]

    return asyncio.run(collect())


@pytest.mark.parametrize("per_step", [1, 3])
def test_every_token_once_with_its_text(bpe_tokenizer, per_step: int) -> None:
    text = '{"city":"Zürich 🙂","n":12}'
    ids = bpe_tokenizer.encode(text).ids
    request = Request(_seq(), tokenizer=bpe_tokenizer)
    for out in _steps(ids, per_step):
        request.apply_step(out)
    request.finish(FinishReason.STOP)
    events = _events(request)
    entries = [e for ev in events for e in ev.logprobs]
    assert [e.token_id for e in entries] == ids
    assert [e.logprob for e in entries] == [-float(i) for i in range(len(ids))]
    assert all(e.top == ((e.token_id, -0.5), (7, -1.5)) for e in entries)
    sent = 0
    for ev in events:
        for e in ev.logprobs:
            # Its text starts inside what has been sent, this event included.
            assert e.text_offset < sent + len(ev.text) or (ev.finished and e.text_offset <= sent + len(ev.text))
            assert e.text_offset >= 0
        sent += len(ev.text)
    # Offsets are where each token's text starts: the text decoded before it (a character split
    # over tokens is given to the token that completes it; the ones before share its offset).
    for i, e in enumerate(entries):
        before = bpe_tokenizer.decode(ids[:i]).rstrip("\ufffd")
        assert e.text_offset == len(before), (i, e)
    # The unary result (events not consumed by a stream) carries the same entries.
    again = Request(_seq(), tokenizer=bpe_tokenizer)
    for out in _steps(ids, per_step):
        again.apply_step(out)
    again.finish(FinishReason.STOP)
    result = asyncio.run(again.result())
    assert result.logprobs == tuple(entries) and result.text == text


def test_stop_string_drops_the_tokens_it_cut(bpe_tokenizer) -> None:
    text = "hello world STOP and more"
    ids = bpe_tokenizer.encode(text).ids
    request = Request(_seq(), tokenizer=bpe_tokenizer, stop=("STOP",))
    for out in _steps(ids, 2):
        if request.apply_step(out):
            break
    request.finish(FinishReason.STOP)
    result = asyncio.run(request.result())
    assert result.text == "hello world "
    kept = [e.token_id for e in result.logprobs]
    assert kept == ids[: len(kept)]
    # Every kept token starts inside the returned text, and the next token starts at or after its end.
    assert all(e.text_offset < len(result.text) for e in result.logprobs)
    assert len(bpe_tokenizer.decode(ids[: len(kept)])) >= len(result.text)
    assert len(bpe_tokenizer.decode(ids[: len(kept) - 1])) < len(result.text)
    assert len(kept) < len(ids)


def test_stop_string_inside_a_token(bpe_tokenizer) -> None:
    """A stop string starting inside a token keeps that token (its first characters were returned)."""
    text = "abcdef abcdef"
    ids = bpe_tokenizer.encode(text).ids
    request = Request(_seq(), tokenizer=bpe_tokenizer, stop=("def",))
    for out in _steps(ids, 1):
        if request.apply_step(out):
            break
    request.finish(FinishReason.STOP)
    result = asyncio.run(request.result())
    assert result.text == "abc"
    kept = [e.token_id for e in result.logprobs]
    joined = bpe_tokenizer.decode(kept)
    assert joined.startswith("abc") and len(bpe_tokenizer.decode(kept[:-1])) < 3


def test_held_text_holds_its_tokens(bpe_tokenizer) -> None:
    """A possible stop-string prefix is held back, and so are its tokens, until released."""
    text = "abc ST"
    ids = bpe_tokenizer.encode(text).ids
    request = Request(_seq(), tokenizer=bpe_tokenizer, stop=("STOP",))
    for out in _steps(ids, 1):
        request.apply_step(out)
    request.finish(FinishReason.LENGTH)
    events = _events(request)
    assert events[-1].text.endswith("ST") and events[-1].logprobs  # released with the tail
    assert [e.token_id for ev in events for e in ev.logprobs] == ids


def test_checked_request_releases_entries_with_its_text(bpe_tokenizer) -> None:
    report = GrammarReport("checked", "xgrammar")
    request = Request(_seq(), tokenizer=bpe_tokenizer, grammar=report, max_attempts=2)
    for out in _steps(bpe_tokenizer.encode("[1,1]").ids, 2):
        request.apply_step(out)
    assert request._events.empty()
    request.restart(_seq())
    ids = bpe_tokenizer.encode("[1,2]").ids
    for out in _steps(ids, 2):
        request.apply_step(out)
    request.finish(FinishReason.GRAMMAR_COMPLETE)
    events = _events(request)
    assert [e.token_id for ev in events for e in ev.logprobs] == ids  # the passing attempt only


def test_no_logprobs_asked_none_sent(bpe_tokenizer) -> None:
    request = Request(_seq(None), tokenizer=bpe_tokenizer)
    request.apply_step(StepOutput("req-1", bpe_tokenizer.encode("ab").ids))
    request.finish(FinishReason.STOP)
    assert asyncio.run(request.result()).logprobs is None
    streamed = Request(_seq(None), tokenizer=bpe_tokenizer)
    streamed.apply_step(StepOutput("req-1", bpe_tokenizer.encode("ab").ids))
    streamed.finish(FinishReason.STOP)
    assert all(e.logprobs is None for e in _events(streamed))


def test_worker_entries_must_match_its_tokens(bpe_tokenizer) -> None:
    request = Request(_seq(), tokenizer=bpe_tokenizer)
    with pytest.raises(RuntimeError, match="logprobs"):
        request.apply_step(StepOutput("req-1", [5, 6], logprobs=[TokenLogprob(5, -1.0)]))
