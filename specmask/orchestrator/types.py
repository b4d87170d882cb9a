"""Domain values of the API: what a client asked for and what it gets back.

These mirror the protobuf messages in proto/src/specmask/orchestrator/v1 but
carry no protobuf types, so validation, the engine and tests work on plain
values. ``convert.py`` translates between the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specmask.common.grammar_spec import GrammarSpec
from specmask.gpu_worker.types import ErrorKind, FinishReason
from specmask.orchestrator.chat import ChatPrompt


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling as the client sent it; ``None`` = use the server default."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    # vLLM's stop_token_ids: sampling one of these ends the output (the token counts in usage;
    # its text is returned only with include_stop_str_in_output). Applied by the orchestrator
    # (request.py), like stop strings, so a grammar request stops only where it may end.
    stop_token_ids: tuple[int, ...] = ()
    # Return the matched stop string (or the stop token's text) at the end of the output.
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # None: no logprobs. N (0..20): each returned token's logprob plus the N most likely tokens
    # at its position (gpu_worker.types.TokenLogprob).
    logprobs: int | None = None
    min_p: float = 0.0  # [0, 1]; 0 = off (vLLM's min_p)
    min_tokens: int = 0  # no stop token or stop string before this many output tokens; 0 = off


@dataclass(frozen=True)
class SpeculationOptions:
    """Speculation as the client sent it; ``None`` = use the server default."""

    enabled: bool = True
    k: int | None = None
    proposers: tuple[str, ...] | None = None  # names from the worker's proposer registry
    draft_masking: bool = True


@dataclass(frozen=True)
class GrammarReport:
    """How a grammar request's output was constrained (the mask service's answer + attempts)."""

    enforcement: str  # "exact", or "checked" (a relaxation masked it; the output passed the end check)
    backend: str  # the engine that masked it ("xgrammar" / "llguidance"; "" if the service did not say)
    attempts: int = 1  # generations run: 1 + resamples (checked mode)
    relaxed: tuple[str, ...] = ()  # checked: the relaxation rules applied

    @property
    def checked(self) -> bool:
        return self.enforcement == "checked"


@dataclass(frozen=True)
class GenerationRequest:
    """One client request, before validation against the model and grammar engine."""

    request_id: str
    prompt: str | tuple[int, ...] | ChatPrompt  # text, token ids, or chat messages (specmask/orchestrator/chat.py)
    grammar: GrammarSpec | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    # Checked mode (grammar.checked): generations to try; None = the server default.
    max_attempts: int | None = None
    # JSON Schema no engine enforces exactly: True = checked mode (a relaxation, the output
    # checked at the end), False = exact or refused, None = the server's --grammar-fallback.
    checked: bool | None = None
    # Who sent it (orchestrator.client_identity): the mask service's compile queue is fair by it.
    client: str = ""


@dataclass
class Usage:
    """Per-request token and speculation accounting (accumulated over steps)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    target_forwards: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    mask_time_s: float = 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.completion_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0


@dataclass(frozen=True)
class OutputLogprob:
    """One returned token's logprob (the worker's ``TokenLogprob``: under the target's
    distribution after the grammar mask and temperature, greedy at temperature 1, before
    top-k/top-p) and where its text starts in the output text."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first; allowed tokens only
    text_offset: int  # characters of output text before the token's text (a partial character's
    #                   tokens share the offset of the character they complete)


@dataclass(frozen=True)
class RequestOutput:
    """One event on a request's output stream.

    Deltas: ``text`` of all events concatenates to the final text, ``token_ids``
    to the final token ids. The last event has ``finish_reason`` set and a
    snapshot of ``usage``.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None
    grammar: GrammarReport | None = None  # final event of a grammar request
    # Requests with logprobs: the entries of the tokens whose text this event carries (a token
    # goes with the event whose text holds its first character; see request.py). None otherwise.
    logprobs: tuple[OutputLogprob, ...] | None = None
    error_kind: ErrorKind | None = None  # with error: what kind of failure (the APIs report it by this)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class GenerationResult:
    """A finished request, as the unary API returns it."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    error: str | None
    usage: Usage
    grammar: GrammarReport | None = None  # grammar requests: enforcement, engine, attempts
    # Requests with logprobs: one entry per token of the returned text, in order (a stop string's
    # tokens are not returned). None otherwise.
    logprobs: tuple[OutputLogprob, ...] | None = None
    error_kind: ErrorKind | None = None  # with error: what kind of failure (the APIs report it by this)
