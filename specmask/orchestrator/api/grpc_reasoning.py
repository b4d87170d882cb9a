"""Reasoning on the gRPC API: a chat's thinking apart from its answer, as the OpenAI API returns it.

On a server started with ``--reasoning-parser`` a chat prompt's output starts with the
model's thinking (orchestrator/reasoning.py). Exactly as on the HTTP API: the request's
grammar is put behind the reasoning section (the model thinks freely, the grammar
applies from the end of the section, and the end check checks the answer only);
``max_reasoning_tokens`` bounds the section; the chat's ``chat_template_kwargs`` reach
the template, so Qwen3's ``enable_thinking: false`` renders thinking off and no section
is expected. The reply's ``text`` is the answer, ``reasoning_text`` the thinking; a
stream sends the thinking as ``reasoning_text`` deltas first (a closing tag never
reaches it), then the answer as ``text`` deltas.

Text and token-id prompts are not parsed (as vLLM's /v1/completions): their text is
the whole output, and a thinking budget there is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from specmask.orchestrator.chat import ChatPrompt
from specmask.orchestrator.errors import InvalidRequest
from specmask.orchestrator.reasoning import (
    ReasoningFormat,
    ReasoningParser,
    ReasoningStream,
    format_for,
    split_answer,
    with_section,
)
from specmask.orchestrator.types import GenerationRequest, RequestOutput
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb

FIELD = "max_reasoning_tokens"


@dataclass(frozen=True)
class GrpcReasoning:
    """The server's reasoning parser (None: none) and the variables its chat template reads."""

    parser: ReasoningParser | None = None
    template_variables: frozenset[str] = frozenset()

    def sectioned(
        self, msg: pb.GenerateRequest, req: GenerationRequest
    ) -> tuple[GenerationRequest, ReasoningFormat | None]:
        """``req`` with its grammar behind the reasoning section, and the format its output is
        read in (None: the output is all answer). Raises ``InvalidRequest`` for a thinking
        budget the request cannot have."""
        budget = msg.max_reasoning_tokens if msg.HasField("max_reasoning_tokens") else None
        if not isinstance(req.prompt, ChatPrompt):
            if budget is not None:
                raise InvalidRequest(
                    "max_reasoning_tokens needs a chat prompt (text and token-id prompts are not parsed for reasoning)",
                    field=FIELD,
                )
            return req, None
        thinking = format_for(self.parser, req.prompt.template_kwargs, self.template_variables)
        try:
            return with_section(req, thinking, budget), thinking
        except ValueError as exc:
            raise InvalidRequest(str(exc), field=FIELD) from None


def split_reply(msg: pb.GenerateResponse, thinking: ReasoningFormat | None) -> pb.GenerateResponse:
    """The reply with its thinking in ``reasoning_text`` and only the answer in ``text``."""
    if thinking is None:
        return msg
    answer = split_answer(thinking, msg.text)
    msg.text = answer.content or ""
    if answer.reasoning is not None:
        msg.reasoning_text = answer.reasoning
    return msg


class StreamReasoning:
    """``split_reply`` for a stream: each message's text delta split into reasoning and answer."""

    def __init__(self, thinking: ReasoningFormat | None) -> None:
        self._sections = ReasoningStream(thinking) if thinking is not None else None

    def split(self, out: RequestOutput, msg: pb.GenerateStreamResponse) -> pb.GenerateStreamResponse:
        if self._sections is None:
            return msg
        thought, content = self._sections.feed(out.text)
        if out.finished:
            more_thought, more_content = self._sections.finish()
            thought, content = thought + more_thought, content + more_content
        msg.text, msg.reasoning_text = content, thought
        return msg
