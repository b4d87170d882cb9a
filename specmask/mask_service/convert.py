"""GrammarSpec <-> protobuf, shared by client and servicer so both agree."""

from __future__ import annotations

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.reasoning_section import ReasoningSection
from specmask.mask_service.errors import InvalidArgument
from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb

_TO_PB: dict[GrammarKind, pb.GrammarKind.ValueType] = {
    GrammarKind.JSON_SCHEMA: pb.GRAMMAR_KIND_JSON_SCHEMA,
    GrammarKind.REGEX: pb.GRAMMAR_KIND_REGEX,
    GrammarKind.EBNF: pb.GRAMMAR_KIND_EBNF,
    GrammarKind.LARK: pb.GRAMMAR_KIND_LARK,
    GrammarKind.ANY_JSON: pb.GRAMMAR_KIND_ANY_JSON,
}
_FROM_PB = {v: k for k, v in _TO_PB.items()}


def grammar_to_proto(spec: GrammarSpec) -> pb.Grammar:
    msg = pb.Grammar(
        kind=_TO_PB[spec.kind],
        text=spec.text,
        any_whitespace=spec.any_whitespace,
        strict=spec.strict,
        backend=spec.backend,
        checked=spec.checked,
    )
    if spec.separators is not None:
        msg.has_separators = True
        msg.item_separator, msg.key_separator = spec.separators
    if spec.reasoning is not None:
        r = spec.reasoning
        msg.reasoning.CopyFrom(pb.ReasoningSection(open=r.open, close=r.close, gap=r.gap, max_tokens=r.max_tokens))
    return msg


def grammar_from_proto(msg: pb.Grammar) -> GrammarSpec:
    kind = _FROM_PB.get(msg.kind)
    if kind is None:
        raise InvalidArgument(f"grammar kind {msg.kind} is unspecified or unknown")
    seps = (msg.item_separator, msg.key_separator) if msg.has_separators else None
    reasoning = None
    if msg.HasField("reasoning"):
        try:
            r = msg.reasoning
            reasoning = ReasoningSection(open=r.open, close=r.close, gap=r.gap, max_tokens=r.max_tokens)
        except ValueError as exc:
            raise InvalidArgument(f"reasoning section: {exc}") from None
    return GrammarSpec(
        kind=kind,
        text=msg.text,
        any_whitespace=msg.any_whitespace,
        separators=seps,
        strict=msg.strict,
        backend=msg.backend,
        checked=msg.checked,
        reasoning=reasoning,
    )
