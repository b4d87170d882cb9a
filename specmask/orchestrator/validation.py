"""Request validation, before any GPU work.

Everything a request can get wrong is caught here and raised as
``InvalidRequest`` (INVALID_ARGUMENT): malformed ids, empty or too-long
prompts, out-of-range sampling parameters, contradictory speculation settings,
and grammars the mask service refuses (its message is passed through). The
result is the ``NewSequence`` a worker can run as is.

``RequestValidator.validate`` blocks (tokenizer, one ValidateGrammar RPC); the
engine runs it on a thread pool, never on the event loop.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import uuid
from dataclasses import dataclass
from typing import Protocol

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.proposer_kind import ProposerKind
from specmask.gpu_worker.types import MAX_TOP_LOGPROBS, NewSequence, SamplingParams, SpeculationParams, WorkerInfo
from specmask.orchestrator.chat import ChatError, ChatPrompt, ChatRenderer
from specmask.orchestrator.errors import InvalidRequest
from specmask.orchestrator.output_budget import longest_token_chars, min_tokens
from specmask.orchestrator.types import GenerationRequest, GrammarReport

# Client-chosen ids appear in logs and are used as worker sequence ids: keep
# them short and printable so they cannot forge log lines.
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]+")
# Above this, softmax(logits / T) is uniform to float32 precision for any
# realistic logit range; larger values are almost surely client bugs.
MAX_TEMPERATURE = 100.0
# Below this a temperature is treated as greedy (0), as vLLM does (_SAMPLING_EPS).
# softmax(l / T) with T < 1e-5 differs from the argmax only among logits within
# ~1e-4 of the maximum, i.e. within the rounding noise of float32/bf16 logits, and
# T -> 0 is the argmax anyway; below ~1e-38 logits / T overflows float32 to inf and
# the softmax to NaN (temperature 1e-40 emitted EOS outside the grammar).
GREEDY_TEMPERATURE_FLOOR = 1e-5
# Stop strings are searched on every delta and the longest one sets how much
# streamed text is held back; bound both.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# stop_token_ids per request: each step's tokens are scanned for them on the event loop.
MAX_STOP_TOKEN_IDS = 256
# A grammar larger than this is refused before any compilation work (the
# largest JSONSchemaBench schemas are a few hundred KB).
MAX_GRAMMAR_CHARS = 1 << 20
# Separators are JSON punctuation with optional whitespace, e.g. ", " / ": ".
MAX_SEPARATOR_CHARS = 8
JSON_WHITESPACE = " \t\n\r"
# Proposer names the worker registry knows (gpu_worker.types.SpeculationParams).
KNOWN_PROPOSERS = frozenset(ProposerKind)
# Default proposers of a worker without a draft model (no draft forward to pay for).
DRAFTLESS_PROPOSERS = (ProposerKind.GRAMMAR_FORCED, ProposerKind.NGRAM)
# With a draft model: the free proposers first, the draft model at the positions they leave
# (gpu_worker.proposers priorities). The n-gram lookup catches the repeats a small draft misses:
# on SmolLM2 with its distilled draft the mix drafts more tokens per target forward, and runs
# faster, than the draft with grammar-forced drafts alone (docs/benchmarks.md).
DRAFT_MODEL_PROPOSERS = (ProposerKind.DRAFT_MODEL, ProposerKind.GRAMMAR_FORCED, ProposerKind.NGRAM)
# Longest plausible token, in characters (used only to bound tokenizer work).
MAX_CHARS_PER_TOKEN = 64
# Checked mode: generations a request gets when it names no max_attempts, and the
# default server cap (--checked-max-attempts).
DEFAULT_CHECKED_ATTEMPTS = 4
DEFAULT_CHECKED_MAX_ATTEMPTS = 8


class GrammarFallback(enum.Enum):
    """What a JSON Schema no engine enforces exactly gets when its request does not say
    (``--grammar-fallback``; a request's ``checked``/``guided_checked`` overrides it either way)."""

    # Generate under the closest relaxation the engines enforce, check the output against the
    # original schema at the end, resample within max_attempts: never an invalid output returned.
    CHECKED = "checked"
    # Refuse the schema (INVALID_ARGUMENT) unless the request opts into checked mode itself.
    REFUSE = "refuse"


DEFAULT_GRAMMAR_FALLBACK = GrammarFallback.CHECKED
# Engine names a request may give (GrammarSpec.backend); "auto" is the same as "" (the service picks).
KNOWN_BACKENDS = ("auto", "llguidance", "xgrammar")
# Seeds arrive as uint64; kernels take int64.
_SEED_MASK = (1 << 63) - 1


class GrammarChecker(Protocol):
    """Asks the grammar engine whether it accepts a grammar.

    Raises ``InvalidRequest`` (the engine's message) for refused grammars and
    ``Unavailable`` when the engine cannot be reached. Returns how the grammar will be
    enforced (engine, exact or checked); None = exact, engine unknown.
    """

    def check(self, spec: GrammarSpec, client: str = "") -> GrammarReport | None: ...


class Encoding(Protocol):
    """The slice of ``tokenizers.Encoding`` validation reads."""

    @property
    def ids(self) -> list[int]: ...


class Tokenizer(Protocol):
    """The slice of ``tokenizers.Tokenizer`` validation needs."""

    def encode(self, text: str, /) -> Encoding: ...


@dataclass(frozen=True)
class ServingDefaults:
    """What a request gets for parameters it leaves unset."""

    max_tokens: int | None  # None = the room the prompt leaves in the context
    k: int
    checked_max_attempts: int = DEFAULT_CHECKED_MAX_ATTEMPTS  # server cap on GenerationRequest.max_attempts
    grammar_fallback: GrammarFallback = DEFAULT_GRAMMAR_FALLBACK  # a request with checked=None gets this


@dataclass(frozen=True)
class ValidatedRequest:
    """What the engine runs: the worker's sequence, plus how its grammar is enforced."""

    seq: NewSequence
    grammar: GrammarReport | None = None  # None: no grammar
    max_attempts: int = 1  # generations the engine may run (checked enforcement only; greedy: 1)


def _fail(message: str) -> InvalidRequest:
    return InvalidRequest(message)


class RequestValidator:
    """Turns a ``GenerationRequest`` into a runnable ``NewSequence`` or raises ``InvalidRequest``."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        info: WorkerInfo,
        grammar_checker: GrammarChecker,
        defaults: ServingDefaults,
        chat: ChatRenderer | None = None,  # None: chat requests are refused (INVALID_ARGUMENT)
    ) -> None:
        self._chat = chat
        self._tokenizer = tokenizer
        self._info = info
        self._grammar_checker = grammar_checker
        self._defaults = defaults
        self._longest_token: int | None = None  # lazily, from the tokenizer's vocabulary

    @staticmethod
    def request_id(requested: str) -> str:
        """The client's id when well-formed, a fresh one when empty."""
        if not requested:
            return uuid.uuid4().hex
        if len(requested) > MAX_REQUEST_ID_CHARS or not _REQUEST_ID_RE.fullmatch(requested):
            raise _fail(f"request_id must be 1-{MAX_REQUEST_ID_CHARS} printable ASCII characters without spaces")
        return requested

    def validate(self, req: GenerationRequest) -> NewSequence:
        """Check everything; the grammar last, since it is the only remote call."""
        return self.validate_request(req).seq

    def validate_request(self, req: GenerationRequest) -> ValidatedRequest:
        """``validate``, plus the grammar's enforcement and the attempts checked mode may take."""
        if isinstance(req.prompt, ChatPrompt):
            prompt_ids = self._chat_ids(req)
        else:
            prompt_ids = self._prompt_ids(req.prompt)
        sampling = self._sampling(req, len(prompt_ids))
        speculation = self._speculation(req)
        grammar = self._with_fallback(req)
        report: GrammarReport | None = None
        max_attempts = self._max_attempts(req, grammar)
        if grammar is not None:
            if req.sampling.ignore_eos:
                raise _fail("ignore_eos cannot be combined with a grammar (a grammar ends where it admits EOS)")
            self._check_grammar_shape(grammar)
            room = self._info.max_model_len - len(prompt_ids)
            self._check_output_fits(grammar, sampling.max_tokens if req.sampling.max_tokens is None else None, room)
            if grammar.backend == "auto":
                grammar = dataclasses.replace(grammar, backend="")
            report = self._grammar_checker.check(grammar, req.client) or GrammarReport("exact", grammar.backend)
        seq = NewSequence(
            seq_id=req.request_id,
            prompt_token_ids=prompt_ids,
            grammar=grammar,
            sampling=sampling,
            speculation=speculation,
            # () = no stop tokens: only max_tokens (or the context) ends the sequence.
            stop_token_ids=() if req.sampling.ignore_eos else None,
            request_id=req.request_id,
        )
        if report is None or not report.checked or sampling.temperature == 0.0:
            max_attempts = 1  # exact: a violation is a bug, not resampled; greedy: a resample repeats itself
        return ValidatedRequest(seq, report, max_attempts)

    def _with_fallback(self, req: GenerationRequest) -> GrammarSpec | None:
        """The grammar with ``checked`` resolved: the request's choice, else (``checked`` None)
        the server's ``grammar_fallback`` for a JSON Schema. ``checked=False`` demands exact
        enforcement: a schema no engine enforces exactly is refused, never relaxed."""
        spec = req.grammar
        if spec is None:
            return None
        if req.checked is not None:
            return dataclasses.replace(spec, checked=req.checked)
        if spec.checked or spec.kind is not GrammarKind.JSON_SCHEMA:
            return spec  # opted in on the spec itself; other kinds have no relaxation
        return dataclasses.replace(spec, checked=self._defaults.grammar_fallback is GrammarFallback.CHECKED)

    def _max_attempts(self, req: GenerationRequest, grammar: GrammarSpec | None) -> int:
        cap = self._defaults.checked_max_attempts
        if req.max_attempts is None:
            return min(DEFAULT_CHECKED_ATTEMPTS, cap)
        if grammar is None or not grammar.checked:
            raise _fail(
                "max_attempts applies to checked mode only (a JSON Schema grammar, checked set or the "
                "server's --grammar-fallback checked)"
            )
        if not 1 <= req.max_attempts <= cap:
            raise _fail(
                f"max_attempts must be in [1, {cap}] (the server's --checked-max-attempts), got {req.max_attempts}"
            )
        return req.max_attempts

    def _chat_ids(self, req: GenerationRequest) -> tuple[int, ...]:
        """A chat's prompt ids. The schema instruction is the server's text, not the caller's: when
        the conversation with it leaves no room for the output, it is rendered without it, so a
        request is never refused for text the server added."""
        assert isinstance(req.prompt, ChatPrompt)
        if self._chat is None:
            raise _fail("this server does not take chat prompts; send text or token_ids")
        ids = self._prompt_ids(self._render_chat(req.prompt, req.grammar, instruction=False))
        if not self._chat.instruction_template(req.prompt, req.grammar):
            return ids
        with_instruction = self._render_chat(req.prompt, req.grammar, instruction=True)
        if len(with_instruction) > MAX_CHARS_PER_TOKEN * self._info.max_model_len:
            return ids
        full = tuple(self._tokenizer.encode(with_instruction).ids)
        room = self._info.max_model_len - len(full)
        return full if room >= max(1, req.sampling.max_tokens or 1) else ids

    def _render_chat(self, chat: ChatPrompt, grammar: GrammarSpec | None, *, instruction: bool) -> str:
        assert self._chat is not None
        try:
            return self._chat.render(chat, grammar, instruction=instruction)
        except ChatError as exc:
            raise _fail(str(exc)) from None

    def _prompt_ids(self, prompt: str | tuple[int, ...]) -> tuple[int, ...]:
        if isinstance(prompt, str):
            if not prompt:
                raise _fail("prompt is empty")
            # Bound tokenizer work before tokenizing: vocabularies have no tokens
            # anywhere near MAX_CHARS_PER_TOKEN characters, so such a prompt
            # cannot fit the context whatever it tokenizes to.
            if len(prompt) > MAX_CHARS_PER_TOKEN * self._info.max_model_len:
                raise _fail(f"prompt of {len(prompt)} characters is longer than the model's context")
            ids = tuple(self._tokenizer.encode(prompt).ids)
        else:
            ids = prompt
            bad = next((t for t in ids if not 0 <= t < self._info.vocab_size), None)
            if bad is not None:
                raise _fail(f"prompt token id {bad} is outside the vocabulary [0, {self._info.vocab_size})")
        if not ids:
            raise _fail("prompt is empty")
        if len(ids) >= self._info.max_model_len:
            raise _fail(
                f"prompt has {len(ids)} tokens; the model's context is {self._info.max_model_len} "
                "(prompt + output must fit)"
            )
        return ids

    def _sampling(self, req: GenerationRequest, prompt_len: int) -> SamplingParams:
        s = req.sampling
        if not (math.isfinite(s.temperature) and 0.0 <= s.temperature <= MAX_TEMPERATURE):
            raise _fail(f"temperature must be in [0, {MAX_TEMPERATURE}], got {s.temperature}")
        if not (math.isfinite(s.top_p) and 0.0 < s.top_p <= 1.0):
            raise _fail(f"top_p must be in (0, 1], got {s.top_p}")
        if s.top_k < 0:
            raise _fail(f"top_k must be >= 0 (0 = off), got {s.top_k}")
        # top_k at or above the vocabulary keeps every token: the same as off.
        top_k = 0 if s.top_k >= self._info.vocab_size else s.top_k
        if len(s.stop) > MAX_STOP_STRINGS:
            raise _fail(f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
        for stop in s.stop:
            if not stop or len(stop) > MAX_STOP_STRING_CHARS:
                raise _fail(f"stop strings must be 1-{MAX_STOP_STRING_CHARS} characters")
        if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(s.stop_token_ids)}",
                field="sampling.stop_token_ids",
            )
        if any(t < 0 for t in s.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be >= 0", field="sampling.stop_token_ids")
        room = self._info.max_model_len - prompt_len
        if s.max_tokens is None:
            default = self._defaults.max_tokens
            max_tokens = room if default is None else min(default, room)
        else:
            if s.max_tokens < 1:
                raise _fail(f"max_tokens must be >= 1, got {s.max_tokens}")
            if s.max_tokens > room:
                raise _fail(
                    f"prompt ({prompt_len} tokens) + max_tokens ({s.max_tokens}) exceeds "
                    f"the model's context ({self._info.max_model_len})"
                )
            max_tokens = s.max_tokens
        if not (math.isfinite(s.min_p) and 0.0 <= s.min_p <= 1.0):
            raise InvalidRequest(f"min_p must be in [0, 1] (0 = off), got {s.min_p}", field="sampling.min_p")
        if s.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be >= 0, got {s.min_tokens}", field="sampling.min_tokens")
        if s.min_tokens > max_tokens:
            limit = "max_tokens" if s.max_tokens is not None else "the default max_tokens (set max_tokens)"
            raise InvalidRequest(
                f"min_tokens ({s.min_tokens}) must not exceed max_tokens ({max_tokens}, {limit})",
                field="sampling.min_tokens",
            )
        if s.logprobs is not None and not 0 <= s.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (alternatives per token), got {s.logprobs}",
                field="sampling.logprobs",
            )
        seed = None if s.seed is None else s.seed & _SEED_MASK
        temperature = 0.0 if s.temperature < GREEDY_TEMPERATURE_FLOOR else s.temperature
        return SamplingParams(
            temperature=temperature,
            top_p=s.top_p,
            top_k=top_k,
            seed=seed,
            max_tokens=max_tokens,
            logprobs=s.logprobs,
            min_p=s.min_p,
            min_tokens=s.min_tokens,
            min_tokens_stop_ids=tuple(t for t in s.stop_token_ids if t < self._info.vocab_size) if s.min_tokens else (),
        )

    def _speculation(self, req: GenerationRequest) -> SpeculationParams:
        s = req.speculation
        if s.proposers is not None:
            unknown = sorted(set(s.proposers) - KNOWN_PROPOSERS)
            if unknown:
                raise _fail(f"unknown proposers {unknown}; known: {sorted(str(k) for k in KNOWN_PROPOSERS)}")
            if not s.proposers:
                raise _fail("proposers must not be empty (disable speculation with enabled=false)")
        if not s.enabled:
            if s.k is not None and s.k > 0:
                raise _fail(f"speculation is disabled but k={s.k} was requested")
            if s.proposers is not None:
                raise _fail("speculation is disabled but proposers were named")
            return SpeculationParams(enabled=False, k=0, draft_masking=False)
        k = self._defaults.k if s.k is None else s.k
        if not 0 <= k <= self._info.max_k:
            raise _fail(f"k must be in [0, {self._info.max_k}] (0 = no speculation), got {k}")
        if k == 0:
            return SpeculationParams(enabled=False, k=0, draft_masking=False)
        proposers = s.proposers if s.proposers is not None else self._default_proposers()
        return SpeculationParams(
            enabled=True, k=k, proposers=tuple(dict.fromkeys(proposers)), draft_masking=s.draft_masking
        )

    def _default_proposers(self) -> tuple[str, ...]:
        """Grammar-forced drafts and prompt lookup (n-gram), free drafts that measured best on
        SmolLM2-135M without a draft model; with one, the draft model fills what they leave."""
        if self._info.has_draft_model:
            return DRAFT_MODEL_PROPOSERS
        return DRAFTLESS_PROPOSERS

    def _max_token_chars(self) -> int | None:
        """The longest token's characters (an upper bound), or None if the tokenizer cannot say."""
        if self._longest_token is None:
            get_vocab = getattr(self._tokenizer, "get_vocab", None)
            if get_vocab is None:
                return None
            self._longest_token = longest_token_chars(get_vocab())
        return self._longest_token

    def _check_output_fits(self, spec: GrammarSpec, default_max_tokens: int | None, room: int) -> None:
        """Refuse a JSON Schema whose shortest document cannot fit (output_budget.py): in the context
        left after the prompt (``room``), or in the server's default budget when the client set none
        (``default_max_tokens``). A max_tokens the client chose below the bound is its call: the
        output ends by length, and says so."""
        if spec.kind is not GrammarKind.JSON_SCHEMA:
            return
        per_token = self._max_token_chars()
        bound = None if per_token is None else min_tokens(spec.text, per_token)
        if bound is None:
            return
        chars, tokens = bound
        if tokens > room:
            limit = f"only {room} fit in the context after the prompt (the largest max_tokens possible)"
        elif default_max_tokens is not None and tokens > default_max_tokens:
            limit = f"max_tokens defaults to {default_max_tokens}; send a larger max_tokens (up to {room})"
        else:
            return
        raise InvalidRequest(
            f"the schema's shortest valid output has at least {chars} characters (minLength, minItems, "
            f"required properties), so it needs at least {tokens} tokens, but {limit}: it could only "
            "end by length",
            reason="OUTPUT_CANNOT_FIT",
            field="sampling.max_tokens",
        )

    @staticmethod
    def _check_grammar_shape(spec: GrammarSpec) -> None:
        """Local checks that need no engine: size, JSON-only options on JSON kinds."""
        if len(spec.text) > MAX_GRAMMAR_CHARS:
            raise _fail(f"grammar of {len(spec.text)} characters exceeds the limit of {MAX_GRAMMAR_CHARS}")
        if spec.backend and spec.backend not in KNOWN_BACKENDS:
            raise InvalidRequest(
                f"unknown grammar backend {spec.backend!r}; known: {', '.join(KNOWN_BACKENDS)}",
                reason="UNKNOWN_BACKEND",
                field="grammar.backend",
            )
        if spec.checked and spec.kind is not GrammarKind.JSON_SCHEMA:
            raise _fail(f"checked mode applies to JSON Schema grammars only, not {spec.kind.value}")
        is_json = spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.ANY_JSON)
        if not is_json and (spec.any_whitespace or spec.separators is not None or not spec.strict):
            raise _fail(
                "JSON options (any_whitespace, separators, additional properties) given for a "
                f"{spec.kind.value} grammar"
            )
        if spec.kind is not GrammarKind.ANY_JSON and not spec.text.strip():
            raise _fail(f"{spec.kind.value} grammar is empty")
        if spec.separators is not None:
            for sep, mark in zip(spec.separators, (",", ":")):
                # JSON's whitespace only (RFC 8259): str.strip() also strips U+00A0, U+2028, ...,
                # which the grammar engines rightly refuse to emit between JSON tokens.
                if len(sep) > MAX_SEPARATOR_CHARS or sep.strip(JSON_WHITESPACE) != mark:
                    raise _fail(
                        f"JSON separator {sep!r} must be {mark!r} with optional surrounding JSON whitespace "
                        "(space, tab, line feed, carriage return)"
                    )
