"""vLLM's stop_token_ids and include_stop_str_in_output, applied per request (request.py).

A stop token ends the output where it is sampled: the token counts (token ids, usage), its text
is returned only with ``include_stop``, and the tokens a speculative step brought after it are
dropped. Under a grammar it ends the output only where the returned text is a complete sentence
(``stop_may_end``), as a stop string does; elsewhere it is an ordinary token.
"""

from __future__ import annotations

import asyncio

from specmask.gpu_worker.types import FinishReason, NewSequence, SamplingParams, StepOutput, TokenLogprob
from specmask.orchestrator.request import Request
from specmask.orchestrator.stop_strings import StopStringMatcher


def _seq(logprobs: int | None = None) -> NewSequence:
    return NewSequence("req-1", (1, 2, 3), None, SamplingParams(logprobs=logprobs))


def _run(request: Request, steps: list[list[int]], logprobs: bool = False) -> list[bool]:
    hits = []
    for ids in steps:
        entries = [TokenLogprob(t, -1.0, ((t, -1.0),)) for t in ids] if logprobs else None
        hits.append(request.apply_step(StepOutput("req-1", ids, logprobs=entries)))
        if hits[-1]:
            break
    request.finish(FinishReason.STOP if hits[-1] else FinishReason.LENGTH)
    return hits


def _text(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text).ids)


def test_a_stop_token_ends_the_output_and_drops_the_rest_of_the_step(bpe_tokenizer) -> None:
    ids = _text(bpe_tokenizer, "hello world, and more")
    stop = ids[2]
    request = Request(_seq(), tokenizer=bpe_tokenizer, stop_token_ids=(stop,))
    hits = _run(request, [ids[:1], ids[1:5]])  # one speculative step carries the stop token and more
    assert hits == [False, True]
    assert request.token_ids == ids[:3]  # the stop token counts, the tokens after it do not
    assert request.usage.completion_tokens == 3
    assert request.text == bpe_tokenizer.decode(ids[:2])


def test_include_stop_str_in_output_returns_the_stop_tokens_text(bpe_tokenizer) -> None:
    ids = _text(bpe_tokenizer, "hello world, and more")
    request = Request(_seq(), tokenizer=bpe_tokenizer, stop_token_ids=(ids[2],), include_stop=True)
    assert _run(request, [ids]) == [True]
    assert request.text == bpe_tokenizer.decode(ids[:3])


def test_include_stop_str_in_output_keeps_a_stop_string(bpe_tokenizer) -> None:
    ids = _text(bpe_tokenizer, "hello END world")
    request = Request(_seq(), tokenizer=bpe_tokenizer, stop=("END",), include_stop=True)
    hits = _run(request, [[t] for t in ids])
    assert hits[-1] and request.text == "hello END"
    plain = Request(_seq(), tokenizer=bpe_tokenizer, stop=("END",))
    _run(plain, [[t] for t in ids])
    assert plain.text == "hello "


def test_under_a_grammar_a_stop_token_ends_only_a_complete_sentence(bpe_tokenizer) -> None:
    # The "grammar": the output may end only after a closing brace.
    text = '{"a":{"b":1}}'
    ids = _text(bpe_tokenizer, text)
    brace = bpe_tokenizer.encode("}").ids[0]
    assert ids.count(brace) >= 2
    asked: list[str] = []

    def may_end(out: str) -> bool:
        asked.append(out)
        return out.count("{") == out.count("}")

    request = Request(_seq(), tokenizer=bpe_tokenizer, stop_token_ids=(brace,), include_stop=True, stop_may_end=may_end)
    _run(request, [[t] for t in ids])
    assert request.text == text  # the inner brace was refused as an end, the outer one ended it
    assert asked[0] == '{"a":{"b":1}' and asked[-1] == text
    excluded = Request(_seq(), tokenizer=bpe_tokenizer, stop_token_ids=(brace,), stop_may_end=may_end)
    hits = _run(excluded, [ids])  # not included: the text before a brace is never balanced
    assert hits == [False] and excluded.text == text


def test_stop_strings_before_a_stop_token_win(bpe_tokenizer) -> None:
    ids = _text(bpe_tokenizer, "ab END cd, ef")
    comma = bpe_tokenizer.encode(",").ids[0]
    request = Request(_seq(), tokenizer=bpe_tokenizer, stop=("END",), stop_token_ids=(comma,))
    assert _run(request, [ids]) == [True]
    assert request.text == "ab "


def test_stop_token_logprobs_follow_the_text(bpe_tokenizer) -> None:
    ids = _text(bpe_tokenizer, "hello world, and more")
    stop = ids[2]
    request = Request(_seq(logprobs=1), tokenizer=bpe_tokenizer, stop_token_ids=(stop,))
    _run(request, [ids[:1], ids[1:]], logprobs=True)
    result = asyncio.run(request.result())
    assert [e.token_id for e in result.logprobs] == ids[:2]  # the stop token's text is not returned
    included = Request(_seq(logprobs=1), tokenizer=bpe_tokenizer, stop_token_ids=(stop,), include_stop=True)
    _run(included, [ids], logprobs=True)
    result = asyncio.run(included.result())
    assert [e.token_id for e in result.logprobs] == ids[:3] and result.text == bpe_tokenizer.decode(ids[:3])


def test_matcher_end_releases_held_text_and_checks_the_whole_output() -> None:
    m = StopStringMatcher(("STOP",), may_end=lambda t: t.endswith("ST!"))
    assert m.feed("abc ST") == ("abc ", False)  # "ST" may begin "STOP": held back
    assert m.end("") is None  # "abc ST" may not end the output
    assert m.end("!") == "ST!" and m.text_before_match == "abc ST!"
    assert m.feed("more") == ("", True)


def _min_tokens_seq(min_tokens: int, logprobs: int | None = None) -> NewSequence:
    return NewSequence("req-1", (1, 2, 3), None, SamplingParams(min_tokens=min_tokens, logprobs=logprobs))


def test_a_stop_string_counts_only_if_it_ends_after_the_min_tokens_th_token(bpe_tokenizer) -> None:
    """vLLM's rule: an occurrence ending in the text of the first min_tokens tokens is ignored;
    one ending in a later token's text counts, wherever it starts. Checked for every min_tokens,
    one token per step and all in one (speculative) step, with and without logprobs."""
    text = "ab END cd END ef END gh"
    ids = _text(bpe_tokenizer, text)
    assert bpe_tokenizer.decode(ids) == text
    for min_tokens in range(len(ids) + 1):
        floor = len(bpe_tokenizer.decode(ids[:min_tokens]))
        ends = [i for i in range(len(text)) if text.startswith("END", i) and i + 3 > floor]
        for steps in ([[t] for t in ids], [ids]):
            for logprobs in (None, 0):
                request = Request(_min_tokens_seq(min_tokens, logprobs), tokenizer=bpe_tokenizer, stop=("END",))
                hits = _run(request, steps, logprobs=logprobs is not None)
                result = asyncio.run(request.result())
                case = (min_tokens, len(steps), logprobs)
                if ends:
                    assert hits[-1] and result.text == text[: ends[0]], case
                else:
                    assert not any(hits) and result.text == text, case
                if logprobs is not None:  # one entry per token whose text starts in the returned text
                    assert all(e.text_offset < len(result.text) for e in result.logprobs), case
                    assert "".join(bpe_tokenizer.decode([e.token_id]) for e in result.logprobs) == result.text, case
