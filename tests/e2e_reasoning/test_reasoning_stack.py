"""A reasoning model through the whole stack and the OpenAI SDK: thinking, then a schema answer.

The model is a real Qwen3 checkpoint with the real Qwen3 tokenizer and chat
template, built so its greedy output is known: every layer's attention and MLP
write nothing (``o_proj`` and ``down_proj`` are zero), so each position's hidden
state is its token's embedding and ``lm_head`` maps it to a chosen next token, a
bigram machine. From the generation prompt (``...assistant\\n``) it writes
``<think>Hmm ok</think>\\n\\n{"n":42}<|im_end|>``; from Qwen3's thinking-off prompt
(which ends with ``</think>\\n\\n``) it writes the answer alone.

With ``--reasoning-parser qwen3`` the answer comes back as ``content``, the thinking
as ``reasoning`` / ``reasoning_content``, streamed and not, with speculation on
(the draft is the same model, so drafts cross the end of the section) and off,
and under a JSON Schema, a regex, tools (``auto``: the answer is text) and no constraint
at all. The gRPC API serves the same chats over real loopback: ``reasoning_text`` apart from
``text``, whole and streamed, ``chat_template_kwargs`` and ``max_reasoning_tokens``.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from specmask.orchestrator.dev.local_stack import StackConfig
from specmask.orchestrator.reasoning import ReasoningParser
from tests.e2e.stack import ThreadStack
from tests.fixtures.openai_sdk import openai_sdk
from tests.fixtures.shared_data import shared_data_dir

pytestmark = [pytest.mark.slow, pytest.mark.shared_data]

THINKING = "Hmm ok"
ANSWER = '{"n":42}'
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Give n as JSON."}]


def _build_bigram_qwen3(out: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    chain = [198, *tok.encode(f"<think>{THINKING}</think>\n\n{ANSWER}", add_special_tokens=False)]
    chain.append(tok.convert_tokens_to_ids("<|im_end|>"))
    assert chain[1] == tok.convert_tokens_to_ids("<think>") and len(set(chain)) == len(chain)  # a bigram chain
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=151936,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            eos_token_id=chain[-1],
        )
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        unit = {t: embed[t] / embed[t].norm() for t in chain}
        for a, b in itertools.pairwise(chain):
            # After the final RMSNorm the state is sqrt(64) * e_a / |e_a|: token b scores 10 * 8,
            # every other token of the chain 80 * cos(e_a, e_other) (random 64-d vectors), the rest 0.
            head[b] = 10 * unit[a]
        # After "Hmm" the runner-up is "</think>", scoring 40 (" ok" 80, the other spellings of the
        # closing tag 0): what a thinking budget of two tokens leaves the model to pick. Its row
        # gains a part orthogonal to e_ok, so after " ok" it still scores 80.
        hmm, ok, close = chain[2], chain[3], tok.convert_tokens_to_ids("</think>")
        cos = float(unit[hmm] @ unit[ok])
        perp = unit[hmm] - cos * unit[ok]
        head[close] += (5 - 10 * cos) / (1 - cos**2) ** 0.5 * perp / perp.norm()
    model.save_pretrained(out)
    for f in tokenizer_dir.glob("tokenizer*.json"):
        shutil.copy2(f, out / f.name)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    shared = shared_data_dir()
    if shared is None or not (shared / "tokenizers" / "qwen3" / "tokenizer.json").is_file():
        pytest.skip("the Qwen3 tokenizer is not in the shared data")
    model_dir = tmp_path_factory.mktemp("bigram-qwen3") / "qwen3-bigram"
    _build_bigram_qwen3(model_dir, shared / "tokenizers" / "qwen3")
    config = StackConfig(target_dir=str(model_dir), draft_dir=str(model_dir), mask_replicas=1, num_workers=1)
    s = ThreadStack(config, http_port=0, default_max_tokens=32, reasoning_parser=ReasoningParser.QWEN3).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack: ThreadStack) -> Iterator[openai.OpenAI]:
    with openai_sdk(stack.http_url + "/v1") as c:
        yield c


CONSTRAINTS: dict[str, dict[str, Any]] = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
    "regex": {"extra_body": {"guided_regex": r'\{"n":[0-9]+\}'}},
    # tool_choice auto: the answer is text, which may start with "{" (no Hermes call does).
    "tools_auto": {"tools": [{"type": "function", "function": {"name": "stop", "parameters": {"type": "object"}}}]},
    "none": {},
}
SPECULATION = {"on": {"enabled": True, "k": 4}, "off": {"enabled": False}}


def _ask(client: openai.OpenAI, constraint: str, speculation: str, **more: Any) -> dict[str, Any]:
    kwargs = dict(CONSTRAINTS[constraint])
    extra = {**kwargs.pop("extra_body", {}), "speculation": SPECULATION[speculation], **more.pop("extra_body", {})}
    return dict(model="qwen3-bigram", messages=MESSAGES, temperature=0, extra_body=extra, **kwargs, **more)


@pytest.mark.parametrize("speculation", sorted(SPECULATION))
@pytest.mark.parametrize("constraint", sorted(CONSTRAINTS))
def test_reasoning_then_content(client: openai.OpenAI, constraint: str, speculation: str) -> None:
    resp = client.chat.completions.create(**_ask(client, constraint, speculation))
    choice = resp.choices[0]
    extra = choice.message.model_extra or {}
    assert (choice.finish_reason, choice.message.content) == ("stop", ANSWER)
    assert not choice.message.tool_calls
    assert extra["reasoning"] == extra["reasoning_content"] == THINKING
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    if constraint != "none":
        assert resp.usage.model_extra["specmask"]["grammar"]["enforcement"] == "exact"
    if speculation == "on":
        assert resp.usage.model_extra["specmask"]["drafts_accepted"] > 0


@pytest.mark.parametrize("speculation", sorted(SPECULATION))
@pytest.mark.parametrize("constraint", ["json_schema", "tools_auto", "none"])
def test_streamed_reasoning_then_content(client: openai.OpenAI, constraint: str, speculation: str) -> None:
    thought, content, order = [], [], []
    finish = None
    for chunk in client.chat.completions.create(**_ask(client, constraint, speculation), stream=True):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            thought.append(extra["reasoning_content"])
            order.append("reasoning")
        if delta.content:
            content.append(delta.content)
            order.append("content")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(thought) == THINKING and "".join(content) == ANSWER and finish == "stop"
    assert order == sorted(order, key=["reasoning", "content"].index)  # all the thinking first
    assert not any("<" in t for t in thought)  # no tag reached the client as reasoning


def test_thinking_off_expects_no_section(client: openai.OpenAI) -> None:
    """enable_thinking false: Qwen3's template closes an empty section in the prompt, the model
    answers at once, and the grammar applies from the first token."""
    body = _ask(client, "json_schema", "on", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    resp = client.chat.completions.create(**body)
    message = resp.choices[0].message
    assert message.content == ANSWER and "reasoning_content" not in (message.model_extra or {})


@pytest.mark.parametrize("speculation", sorted(SPECULATION))
def test_max_reasoning_tokens_forces_the_end(client: openai.OpenAI, speculation: str) -> None:
    """Two tokens of thinking (``<think>``, ``Hmm``): then only the closing tag's spellings are
    allowed, the model picks ``</think>`` and answers; unbounded, it thinks one token longer."""
    body = _ask(client, "json_schema", speculation, extra_body={"max_reasoning_tokens": 2})
    message = client.chat.completions.create(**body).choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == "Hmm" and message.content == ANSWER
    body = _ask(client, "json_schema", speculation, extra_body={"max_reasoning_tokens": 3})
    message = client.chat.completions.create(**body).choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == THINKING and message.content == ANSWER


@pytest.mark.parametrize(
    ("constraint", "more"),
    [("none", {}), ("json_schema", {"chat_template_kwargs": {"enable_thinking": False}}), ("json_schema", {})],
)
def test_max_reasoning_tokens_needs_a_section_and_a_grammar(
    client: openai.OpenAI, constraint: str, more: dict[str, Any]
) -> None:
    budget = 0 if not more and constraint == "json_schema" else 4  # the last case: a budget below 1
    with pytest.raises(openai.BadRequestError, match="max_reasoning_tokens"):
        client.chat.completions.create(
            **_ask(client, constraint, "off", extra_body={"max_reasoning_tokens": budget, **more})
        )


def test_completions_refuse_max_reasoning_tokens(client: openai.OpenAI) -> None:
    """/v1/completions does not parse reasoning (as vLLM's): a thinking budget sent there is a 400
    naming it, never a request served without the cap."""
    with pytest.raises(openai.BadRequestError, match="max_reasoning_tokens") as exc:
        client.completions.create(
            model="qwen3-bigram",
            prompt="Give n as JSON.",
            max_tokens=8,
            extra_body={"guided_json": SCHEMA, "max_reasoning_tokens": 2},
        )
    body = exc.value.body
    assert isinstance(body, dict) and body.get("param") == "max_reasoning_tokens", body


# ---- the gRPC API: the same reasoning, as reasoning_text apart from text ----------------------


def _grpc_chat(speculation: str, **grammar: Any) -> Any:
    from specmask.orchestrator.client import build_request

    req = build_request(MESSAGES, temperature=0, max_tokens=32, speculation=speculation == "on", **grammar)
    if speculation == "on":
        req.speculation.k = 4
    return req


@pytest.fixture(scope="module")
def grpc_client(stack: ThreadStack) -> Iterator[Any]:
    from specmask.orchestrator.client import OrchestratorClient

    with OrchestratorClient(stack.address) as c:
        yield c


GRPC_GRAMMARS: dict[str, dict[str, Any]] = {"json_schema": {"schema": SCHEMA}, "regex": {"regex": r'\{"n":[0-9]+\}'}}


@pytest.mark.parametrize("speculation", sorted(SPECULATION))
@pytest.mark.parametrize("grammar", [*sorted(GRPC_GRAMMARS), "none"])
def test_grpc_reasoning_then_text(grpc_client: Any, grammar: str, speculation: str) -> None:
    """Generate and GenerateStream: the thinking in reasoning_text, the answer alone in text (the
    grammar governed it from the end of the section), the stream's reasoning deltas first."""
    from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb

    req = _grpc_chat(speculation, **GRPC_GRAMMARS.get(grammar, {}))
    reply = grpc_client.generate(req)
    assert reply.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_GRAMMAR_COMPLETE), reply.error
    assert (reply.text, reply.HasField("reasoning_text"), reply.reasoning_text) == (ANSWER, True, THINKING)
    if grammar != "none":
        assert reply.grammar.enforcement == pb.ENFORCEMENT_EXACT
    streamed = grpc_client.stream_all(req)
    assert streamed.finish_reason == reply.finish_reason, streamed.error
    assert (streamed.text, streamed.reasoning_text) == (ANSWER, THINKING)
    last_reasoning = max((i for i, d in enumerate(streamed.reasoning_deltas) if d), default=-1)
    first_text = min((i for i, d in enumerate(streamed.text_deltas) if d), default=len(streamed.text_deltas))
    assert last_reasoning <= first_text  # all the thinking first (one message may end it and start the text)
    assert not any("<" in d for d in streamed.reasoning_deltas)  # no tag reached the client as reasoning
    assert streamed.token_ids == list(reply.token_ids)


def test_grpc_thinking_off_and_budget(grpc_client: Any) -> None:
    """chat_template_kwargs reach the template: enable_thinking false renders thinking off, and the
    grammar applies from the first token; max_reasoning_tokens forces the end of the section."""
    off = _grpc_chat("on", schema=SCHEMA)
    off.chat.chat_template_kwargs = json.dumps({"enable_thinking": False})
    reply = grpc_client.generate(off)
    assert reply.text == ANSWER and not reply.HasField("reasoning_text")
    for budget, thought in ((2, "Hmm"), (3, THINKING)):
        for speculation in sorted(SPECULATION):
            req = _grpc_chat(speculation, schema=SCHEMA)
            req.max_reasoning_tokens = budget
            reply = grpc_client.generate(req)
            assert (reply.reasoning_text, reply.text) == (thought, ANSWER), (budget, speculation)
            assert grpc_client.stream_all(req).reasoning_text == thought


def test_grpc_text_prompts_are_not_parsed(grpc_client: Any) -> None:
    from specmask.orchestrator.client import build_request

    reply = grpc_client.generate(
        build_request("<|im_start|>user\nn?<|im_end|>\n<|im_start|>assistant\n", max_tokens=32)
    )
    assert not reply.HasField("reasoning_text") and reply.text.startswith("<think>")


def _refusal(grpc_client: Any, req: Any) -> str:
    import grpc

    with pytest.raises(grpc.RpcError) as exc:
        grpc_client.generate(req)
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    return str(exc.value.details())


def test_grpc_refuses_what_cannot_be_served(grpc_client: Any) -> None:
    """A thinking budget without a chat, a section or a grammar, out of range, and template
    variables that are not a JSON object or name a renderer argument: INVALID_ARGUMENT, never a
    request served without them."""
    from specmask.orchestrator.client import build_request

    text = build_request("Give n as JSON.", schema=SCHEMA, max_tokens=8)
    text.max_reasoning_tokens = 2
    assert "chat prompt" in _refusal(grpc_client, text)
    for budget, kwargs, grammar in [
        (2, "", {}),  # no grammar to enforce the budget
        (2, json.dumps({"enable_thinking": False}), {"schema": SCHEMA}),  # no section
        (0, "", {"schema": SCHEMA}),
        ((1 << 31), "", {"schema": SCHEMA}),
    ]:
        req = _grpc_chat("off", **grammar)
        req.max_reasoning_tokens = budget
        req.chat.chat_template_kwargs = kwargs
        assert "max_reasoning_tokens" in _refusal(grpc_client, req), (budget, kwargs, grammar)
    for bad, why in (("[1]", "JSON object"), ("{", "not JSON"), ('{"messages": []}', "renderer")):
        req = _grpc_chat("off", schema=SCHEMA)
        req.chat.chat_template_kwargs = bad
        assert why in _refusal(grpc_client, req), bad
