"""Protobuf <-> domain translation for the orchestrator API (no logic beyond shape).

Structural problems a message can have (no prompt set, a grammar message with
no kind, an unknown enum value) raise ``InvalidRequest``; everything semantic
is ``validation.py``'s job.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.proposer_kind import ProposerKind
from specmask.gpu_worker.types import FinishReason
from specmask.orchestrator.chat import ChatError, ChatMessage, ChatPrompt, template_kwargs_from_json
from specmask.orchestrator.errors import InvalidRequest
from specmask.orchestrator.types import (
    GenerationRequest,
    GenerationResult,
    GrammarReport,
    OutputLogprob,
    RequestOutput,
    SamplingOptions,
    SpeculationOptions,
    Usage,
)
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb

# Proto Proposer enum -> worker proposer registry name.
PROPOSER_NAMES: dict[pb.Proposer.ValueType, str] = {
    pb.PROPOSER_DRAFT_MODEL: ProposerKind.DRAFT_MODEL,
    pb.PROPOSER_GRAMMAR_FORCED: ProposerKind.GRAMMAR_FORCED,
    pb.PROPOSER_NGRAM: ProposerKind.NGRAM,
}
PROPOSER_ENUMS: dict[str, pb.Proposer.ValueType] = {name: value for value, name in PROPOSER_NAMES.items()}

_GRAMMAR_KINDS: dict[str, GrammarKind] = {
    "json_schema": GrammarKind.JSON_SCHEMA,
    "regex": GrammarKind.REGEX,
    "ebnf": GrammarKind.EBNF,
    "lark": GrammarKind.LARK,
    "any_json": GrammarKind.ANY_JSON,
}
_GRAMMAR_FIELDS: dict[GrammarKind, str] = {kind: name for name, kind in _GRAMMAR_KINDS.items()}

FINISH_REASONS: dict[FinishReason, pb.FinishReason.ValueType] = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.GRAMMAR_COMPLETE: pb.FINISH_REASON_GRAMMAR_COMPLETE,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    FinishReason.GRAMMAR_VIOLATION: pb.FINISH_REASON_GRAMMAR_VIOLATION,
}


# Mask-service enforcement names -> the API's enum.
ENFORCEMENTS: dict[str, pb.Enforcement.ValueType] = {"exact": pb.ENFORCEMENT_EXACT, "checked": pb.ENFORCEMENT_CHECKED}


# ---- requests -------------------------------------------------------------


def grammar_from_proto(msg: pb.Grammar) -> GrammarSpec:
    which = msg.WhichOneof("kind")
    if which is None:
        raise InvalidRequest("grammar is set but names no kind (json_schema, regex, ebnf, lark, any_json)")
    kind = _GRAMMAR_KINDS[which]
    separators = (msg.separators.item, msg.separators.key) if msg.HasField("separators") else None
    return GrammarSpec(
        kind=kind,
        text="" if kind is GrammarKind.ANY_JSON else getattr(msg, which),
        any_whitespace=msg.any_whitespace,
        separators=separators,
        strict=not msg.allow_additional_properties,
        backend=msg.backend,
        # ``checked`` is the request's choice (GenerationRequest.checked, tri-state), not the spec's:
        # validation resolves it with the server's --grammar-fallback.
    )


def grammar_to_proto(spec: GrammarSpec) -> pb.Grammar:
    msg = pb.Grammar(
        any_whitespace=spec.any_whitespace,
        allow_additional_properties=not spec.strict,
        backend=spec.backend,
    )
    if spec.checked:  # unset otherwise: False on the wire demands exact enforcement
        msg.checked = True
    if spec.kind is GrammarKind.ANY_JSON:
        msg.any_json.SetInParent()
    else:
        setattr(msg, _GRAMMAR_FIELDS[spec.kind], spec.text)
    if spec.separators is not None:
        msg.separators.item, msg.separators.key = spec.separators
    return msg


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingOptions:
    return SamplingOptions(
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        min_p=msg.min_p if msg.HasField("min_p") else 0.0,
        min_tokens=msg.min_tokens if msg.HasField("min_tokens") else 0,
        stop_token_ids=tuple(dict.fromkeys(msg.stop_token_ids)),  # a repeat changes nothing
        include_stop_str_in_output=msg.include_stop_str_in_output,
    )


def speculation_from_proto(msg: pb.SpeculationParams) -> SpeculationOptions:
    proposers: tuple[str, ...] | None = None
    if msg.proposers:
        unknown = [p for p in msg.proposers if p not in PROPOSER_NAMES]
        if unknown:
            raise InvalidRequest(f"unknown proposer enum values {unknown}")
        proposers = tuple(PROPOSER_NAMES[p] for p in msg.proposers)
    return SpeculationOptions(
        enabled=msg.enabled if msg.HasField("enabled") else True,
        k=msg.k if msg.HasField("k") else None,
        proposers=proposers,
        draft_masking=msg.draft_masking if msg.HasField("draft_masking") else True,
    )


def request_from_proto(msg: pb.GenerateRequest, request_id: str) -> GenerationRequest:
    """``request_id`` is the validated id (the client's, or one the server assigned)."""
    which = msg.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("prompt is empty: set text, token_ids or chat")
    prompt: str | tuple[int, ...] | ChatPrompt
    if which == "chat":
        try:
            template_kwargs = template_kwargs_from_json(msg.chat.chat_template_kwargs)
        except ChatError as exc:
            raise InvalidRequest(str(exc), field="chat.chat_template_kwargs") from None
        prompt = ChatPrompt(
            messages=tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages),
            schema_instruction=msg.chat.schema_instruction if msg.chat.HasField("schema_instruction") else None,
            template_kwargs=template_kwargs,
        )
    else:
        prompt = msg.text if which == "text" else tuple(msg.token_ids.ids)
    has_grammar = msg.HasField("grammar")
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        grammar=grammar_from_proto(msg.grammar) if has_grammar else None,
        sampling=sampling_from_proto(msg.sampling),
        speculation=speculation_from_proto(msg.speculation),
        max_attempts=msg.grammar.max_attempts if has_grammar and msg.grammar.HasField("max_attempts") else None,
        # Unset: the server's --grammar-fallback decides (validation), not False.
        checked=msg.grammar.checked if has_grammar and msg.grammar.HasField("checked") else None,
    )


def request_to_proto(req: GenerationRequest) -> pb.GenerateRequest:
    """The inverse of ``request_from_proto`` (clients, tests, benchmarks)."""
    msg = pb.GenerateRequest(request_id=req.request_id)
    if isinstance(req.prompt, str):
        msg.text = req.prompt
    elif isinstance(req.prompt, ChatPrompt):
        msg.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.content) for m in req.prompt.messages)
        if req.prompt.schema_instruction is not None:
            msg.chat.schema_instruction = req.prompt.schema_instruction
        if req.prompt.template_kwargs:
            msg.chat.chat_template_kwargs = json.dumps(req.prompt.template_kwargs)
    else:
        msg.token_ids.ids.extend(req.prompt)
    if req.grammar is not None:
        msg.grammar.CopyFrom(grammar_to_proto(req.grammar))
        if req.max_attempts is not None:
            msg.grammar.max_attempts = req.max_attempts
        if req.checked is not None:  # else as grammar_to_proto set it (the spec's own opt-in)
            msg.grammar.checked = req.checked
    s = req.sampling
    msg.sampling.temperature = s.temperature
    msg.sampling.top_p = s.top_p
    msg.sampling.top_k = s.top_k
    if s.seed is not None:
        msg.sampling.seed = s.seed
    if s.max_tokens is not None:
        msg.sampling.max_tokens = s.max_tokens
    msg.sampling.stop.extend(s.stop)
    msg.sampling.ignore_eos = s.ignore_eos
    if s.logprobs is not None:
        msg.sampling.logprobs = s.logprobs
    if s.min_p:
        msg.sampling.min_p = s.min_p
    if s.min_tokens:
        msg.sampling.min_tokens = s.min_tokens
    msg.sampling.stop_token_ids.extend(s.stop_token_ids)
    msg.sampling.include_stop_str_in_output = s.include_stop_str_in_output
    p = req.speculation
    msg.speculation.enabled = p.enabled
    if p.k is not None:
        msg.speculation.k = p.k
    if p.proposers is not None:
        msg.speculation.proposers.extend(PROPOSER_ENUMS[name] for name in p.proposers)
    msg.speculation.draft_masking = p.draft_masking
    return msg


# ---- responses ------------------------------------------------------------


def usage_to_proto(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        target_forwards=usage.target_forwards,
        drafts_proposed=usage.drafts_proposed,
        drafts_accepted=usage.drafts_accepted,
        mask_time_s=usage.mask_time_s,
        tokens_per_target_forward=usage.tokens_per_target_forward,
        acceptance_rate=usage.acceptance_rate,
    )


def grammar_report_to_proto(report: GrammarReport) -> pb.GrammarReport:
    return pb.GrammarReport(
        enforcement=ENFORCEMENTS.get(report.enforcement, pb.ENFORCEMENT_UNSPECIFIED),
        backend=report.backend,
        attempts=report.attempts,
        relaxed=list(report.relaxed),
    )


def logprobs_to_proto(entries: Sequence[OutputLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top],
            text_offset=e.text_offset,
        )
        for e in entries
    ]


def result_to_proto(result: GenerationResult) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=result.request_id,
        text=result.text,
        token_ids=list(result.token_ids),
        finish_reason=FINISH_REASONS[result.finish_reason],
        error=result.error or "",
        usage=usage_to_proto(result.usage),
    )
    if result.grammar is not None:
        msg.grammar.CopyFrom(grammar_report_to_proto(result.grammar))
    if result.logprobs:
        msg.logprobs.extend(logprobs_to_proto(result.logprobs))
    return msg


def output_to_proto(out: RequestOutput) -> pb.GenerateStreamResponse:
    msg = pb.GenerateStreamResponse(request_id=out.request_id, token_ids=list(out.token_ids), text=out.text)
    if out.finish_reason is not None:
        msg.finish_reason = FINISH_REASONS[out.finish_reason]
        msg.error = out.error or ""
    if out.usage is not None:
        msg.usage.CopyFrom(usage_to_proto(out.usage))
    if out.grammar is not None:
        msg.grammar.CopyFrom(grammar_report_to_proto(out.grammar))
    if out.logprobs:
        msg.logprobs.extend(logprobs_to_proto(out.logprobs))
    return msg
