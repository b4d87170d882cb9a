"""The gRPC API's reasoning fields without a stack: the chat's template variables from the wire
and back, the section put in front of a chat's grammar, refusals, and the reply and stream split.
(The whole path, over real gRPC loopback with a scripted reasoning model: tests/e2e_reasoning.)"""

from __future__ import annotations

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import FinishReason
from specmask.orchestrator import convert
from specmask.orchestrator.api.grpc_reasoning import GrpcReasoning, StreamReasoning, split_reply
from specmask.orchestrator.chat import ChatPrompt
from specmask.orchestrator.errors import InvalidRequest
from specmask.orchestrator.reasoning import FORMATS, ReasoningParser
from specmask.orchestrator.types import RequestOutput
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb

QWEN3 = FORMATS[ReasoningParser.QWEN3]
SERVER = GrpcReasoning(ReasoningParser.QWEN3, frozenset({"messages", "enable_thinking"}))


def _chat(kwargs: str = "", budget: int | None = None, grammar: bool = True) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(request_id="r")
    msg.chat.messages.add(role="user", content="hi")
    msg.chat.chat_template_kwargs = kwargs
    if grammar:
        msg.grammar.regex = "(yes|no)"
    if budget is not None:
        msg.max_reasoning_tokens = budget
    return msg


def test_template_kwargs_from_the_wire_and_back() -> None:
    req = convert.request_from_proto(_chat('{"enable_thinking": false, "n": 12345678901234567890}'), "r")
    assert isinstance(req.prompt, ChatPrompt)
    assert req.prompt.template_kwargs == {"enable_thinking": False, "n": 12345678901234567890}  # exact ints
    again = convert.request_from_proto(convert.request_to_proto(req), "r")
    assert again.prompt == req.prompt
    assert convert.request_from_proto(_chat("{}"), "r").prompt.template_kwargs is None  # type: ignore[union-attr]
    for bad, why in (
        ("[]", "JSON object"),
        ("{'a': 1}", "not JSON"),
        ('{"tools": []}', "renderer"),
        ("[" * 100_000, "JSON"),
    ):
        with pytest.raises(InvalidRequest, match=why) as exc:
            convert.request_from_proto(_chat(bad), "r")
        assert exc.value.field == "chat.chat_template_kwargs"


def test_sectioned_follows_the_http_rules() -> None:
    msg = _chat(budget=7)
    req, thinking = SERVER.sectioned(msg, convert.request_from_proto(msg, "r"))
    assert thinking is QWEN3
    assert req.grammar is not None and req.grammar.reasoning is not None and req.grammar.reasoning.max_tokens == 7
    off = _chat('{"enable_thinking": false}')
    req, thinking = SERVER.sectioned(off, convert.request_from_proto(off, "r"))
    assert thinking is None and req.grammar == GrammarSpec(GrammarKind.REGEX, "(yes|no)")
    # No parser on the server: nothing changes.
    plain, thinking = GrpcReasoning().sectioned(_chat(), convert.request_from_proto(_chat(), "r"))
    assert thinking is None and plain.grammar is not None and plain.grammar.reasoning is None
    text = pb.GenerateRequest(request_id="r", text="hi")
    assert SERVER.sectioned(text, convert.request_from_proto(text, "r"))[1] is None  # text: not parsed
    text.max_reasoning_tokens = 3
    refused = [text, _chat(budget=0), _chat(budget=1 << 31), _chat(budget=3, grammar=False)]
    refused.append(_chat('{"enable_thinking": false}', budget=3))
    for msg in refused:
        with pytest.raises(InvalidRequest, match="max_reasoning_tokens") as exc:
            SERVER.sectioned(msg, convert.request_from_proto(msg, "r"))
        assert exc.value.field == "max_reasoning_tokens"


def test_reply_and_stream_split() -> None:
    whole = "<think>a </th b</think>\n\nyes"
    reply = split_reply(pb.GenerateResponse(text=whole), QWEN3)
    assert (reply.text, reply.reasoning_text) == ("yes", "a </th b")
    cut = split_reply(pb.GenerateResponse(text="<think>still"), QWEN3)
    assert (cut.text, cut.HasField("reasoning_text"), cut.reasoning_text) == ("", True, "still")
    untouched = split_reply(pb.GenerateResponse(text=whole), None)
    assert untouched.text == whole and not untouched.HasField("reasoning_text")
    for size in range(1, len(whole) + 1):
        stream = StreamReasoning(QWEN3)
        pieces = [whole[i : i + size] for i in range(0, len(whole), size)]
        thought, answer = "", ""
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            out = RequestOutput("r", (), piece, FinishReason.STOP if last else None)
            msg = stream.split(out, pb.GenerateStreamResponse(text=piece))
            assert "</think>" not in msg.reasoning_text
            thought, answer = thought + msg.reasoning_text, answer + msg.text
        assert (thought, answer) == ("a </th b", "yes"), size
