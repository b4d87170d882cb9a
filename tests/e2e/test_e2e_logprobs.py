"""Logprobs through the whole stack: gRPC and the OpenAI HTTP API, real workers, real Ray.

The numbers must be the target's grammar-masked distribution at each returned token
(recomputed here with one HF forward and xgrammar's own matcher), the same with
speculation on and off, and follow the returned text when a stop string cuts it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import BOUNDED_SCHEMA, PROMPT, ThreadStack

pytestmark = pytest.mark.slow

TOL = 1e-3  # float32 logits, a different forward batching than the worker's
MESSAGES = [{"role": "user", "content": PROMPT}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "out", "schema": BOUNDED_SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def grpc_client(stack: ThreadStack) -> Iterator[OrchestratorClient]:
    with OrchestratorClient(stack.address) as c:
        yield c


@torch.no_grad()
def _masked_reference(target: Path, prompt: list[int], output: list[int], schema: dict[str, Any] | None):
    """log_softmax of the target's masked rows at T = 1 (greedy) [len(output), V] and the allowed set."""
    import xgrammar as xgr

    from tests.gpu_worker.reference import _model, compile_grammar

    hf = _model(str(target))
    rows = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(output)].float()
    rows = rows.clone()
    if schema is not None:
        matcher = xgr.GrammarMatcher(compile_grammar(target, "json_schema", json.dumps(schema), (0,)))
        bitmask = xgr.allocate_token_bitmask(1, hf.config.vocab_size)
        for i, token in enumerate(output):
            matcher.fill_next_token_bitmask(bitmask)
            row = rows[i : i + 1].clone()
            xgr.apply_token_bitmask_inplace(row, bitmask)
            rows[i] = row[0]
            assert matcher.accept_token(token)
    return torch.log_softmax(rows, dim=-1), torch.isfinite(rows)


@pytest.mark.parametrize("schema", [BOUNDED_SCHEMA, None], ids=["schema", "free"])
def test_grpc_logprobs_are_the_masked_target_spec_on_and_off(
    grpc_client: OrchestratorClient, tiny_pair: tuple[Path, Path], schema: dict[str, Any] | None
) -> None:
    from tokenizers import Tokenizer

    common = dict(schema=schema, temperature=0.0, max_tokens=48, logprobs=4)
    spec = grpc_client.generate(build_request(PROMPT, speculation=True, k=4, **common))
    plain = grpc_client.generate(build_request(PROMPT, speculation=False, **common))
    for resp in (spec, plain):
        assert resp.finish_reason in (pb.FINISH_REASON_GRAMMAR_COMPLETE, pb.FINISH_REASON_LENGTH), resp.error
        assert [e.token_id for e in resp.logprobs] == list(resp.token_ids)
    assert spec.usage.drafts_accepted > 0 and plain.usage.drafts_proposed == 0
    assert list(spec.token_ids) == list(plain.token_ids)
    for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
        assert math.isclose(a.logprob, b.logprob, abs_tol=TOL)
        assert len(a.top) == len(b.top)
    tok = Tokenizer.from_file(str(tiny_pair[0] / "tokenizer.json"))
    prompt = tok.encode(PROMPT).ids
    logp, allowed = _masked_reference(tiny_pair[0], prompt, list(spec.token_ids), schema)
    for i, e in enumerate(spec.logprobs):
        assert math.isclose(e.logprob, float(logp[i, e.token_id]), abs_tol=TOL), (i, e)
        assert len(e.top) == min(4, int(allowed[i].sum()))
        for t in e.top:
            assert bool(allowed[i, t.token_id]) and math.isclose(t.logprob, float(logp[i, t.token_id]), abs_tol=TOL)
        assert e.top[0].token_id == e.token_id  # greedy: the emitted token is the most likely
    if schema is not None:
        assert any(len(e.top) < 4 for e in spec.logprobs)  # forced positions: forbidden tokens left out


def test_grpc_stream_logprobs_fold_into_the_unary_ones(grpc_client: OrchestratorClient) -> None:
    req = build_request(PROMPT, temperature=1.0, seed=5, max_tokens=40, logprobs=2)
    unary = grpc_client.generate(req)
    chunks = list(grpc_client.stream(req))
    streamed = [e for c in chunks for e in c.logprobs]
    assert [e.token_id for e in streamed] == [e.token_id for e in unary.logprobs] == list(unary.token_ids)
    assert [e.text_offset for e in streamed] == [e.text_offset for e in unary.logprobs]
    sent = 0
    for c in chunks:  # each entry travels with the text holding its first character
        assert all(e.text_offset < sent + len(c.text) or c.finish_reason for e in c.logprobs)
        sent += len(c.text)


def test_grpc_logprobs_bound(grpc_client: OrchestratorClient) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        grpc_client.generate(build_request(PROMPT, max_tokens=4, logprobs=21))
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in (exc.value.details() or "")


def _check_chat_content(content: list[Any], text: str, top: int) -> None:
    assert b"".join(bytes(e.bytes) for e in content).decode() == text
    for e in content:
        assert e.token == bytes(e.bytes).decode("utf-8", errors="backslashreplace")
        assert 1 <= len(e.top_logprobs) <= top
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and all(math.isfinite(v) and v <= 0 for v in values)
        assert e.top_logprobs[0].token == e.token and math.isclose(e.top_logprobs[0].logprob, e.logprob)


def test_openai_chat_logprobs_stream_and_not(openai_client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model,
        messages=MESSAGES,
        response_format=SCHEMA_FORMAT,
        temperature=0.0,
        max_tokens=64,
        logprobs=True,
        top_logprobs=3,
    )
    resp = openai_client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and choice.logprobs is not None and choice.logprobs.content
    json.loads(choice.message.content)
    _check_chat_content(choice.logprobs.content, choice.message.content, 3)
    assert any(len(e.top_logprobs) < 3 for e in choice.logprobs.content)  # forced positions
    assert len(choice.logprobs.content) == resp.usage.completion_tokens

    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]
    assert all(
        math.isclose(a.logprob, b.logprob, abs_tol=TOL) for a, b in zip(streamed, choice.logprobs.content, strict=True)
    )
    # Every chunk's logprobs are its own text's tokens.
    for c in chunks:
        if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content:
            delta = c.choices[0].delta.content or ""
            joined = b"".join(bytes(e.bytes) for e in c.choices[0].logprobs.content)
            assert joined.decode("utf-8", errors="replace").startswith(delta[:1])


def test_openai_chat_without_logprobs_has_none(openai_client: openai.OpenAI, model: str) -> None:
    resp = openai_client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8)
    assert resp.choices[0].logprobs is None


def test_openai_tool_call_has_no_content_logprobs(openai_client: openai.OpenAI, model: str) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": BOUNDED_SCHEMA}}]
    resp = openai_client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_tokens=160,  # the call in its <tool_call> block, up to a token per character
        logprobs=True,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.logprobs is not None and choice.logprobs.content is None


def test_openai_completions_logprobs_follow_a_stop_string(openai_client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(model=model, prompt=PROMPT, temperature=1.0, seed=3, max_tokens=40, logprobs=2)
    full = openai_client.completions.create(**kwargs).choices[0]
    lp = full.logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    # A stop string cutting the text inside: take the text of a later token as the stop.
    cut_at = next(
        i for i in range(len(lp.tokens) // 2, len(lp.tokens)) if lp.tokens[i].strip() and "\\x" not in lp.tokens[i]
    )
    stop = lp.tokens[cut_at]
    cut = full.text.find(stop)
    assert cut >= 0
    stopped = openai_client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert stopped.text == full.text[:cut] and stopped.finish_reason == "stop"
    kept = stopped.logprobs
    n = sum(1 for off in lp.text_offset if off < cut)
    assert kept.tokens == lp.tokens[:n] and kept.text_offset == lp.text_offset[:n]
    assert kept.token_logprobs == pytest.approx(lp.token_logprobs[:n], abs=TOL)

    chunks = list(openai_client.completions.create(**kwargs, stop=[stop], stream=True))
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert "".join(c.choices[0].text for c in chunks) == stopped.text and streamed == kept.tokens


@pytest.mark.parametrize(
    ("endpoint", "fields"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}),
        ("chat", {"top_logprobs": 2}),
        ("completions", {"logprobs": 6}),
    ],
)
def test_logprobs_bounds(openai_client: openai.OpenAI, model: str, endpoint: str, fields: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        if endpoint == "chat":
            openai_client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **fields)
        else:
            openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=4, **fields)
    assert exc.value.body["param"] in ("logprobs", "top_logprobs")
