"""llguidance 1.9.1 as a grammar backend: the same matcher contract as xgrammar's.

Why a second engine: xgrammar 0.2.8 compiles many schemas it does not enforce
(sibling keywords beside ``anyOf``/``$ref``, multi-branch ``allOf``,
``multipleOf``, ...), so ``schema_check`` refuses them. llguidance enforces
those, and refuses (instead of silently ignoring) every keyword it does not
implement ("Unimplemented keys", unknown ``format``, overlapping ``oneOf``,
lookaround in patterns). ``llguidance_check`` adds the refusals we found it
needs on top (see that module).

How it is made to behave like xgrammar, so draft_masks/sessions need no change:

* Tokens are seen as the same bytes: the ``LLTokenizer`` is built from the
  xgrammar ``TokenizerInfo`` the registry already holds (its decoded
  vocabulary, vocab size padded to the model's logits width, stop tokens), not
  from a second reading of tokenizer.json.
* No token forcing: by default llguidance allows only the canonical token where
  the grammar forces bytes (``{"`` but not ``{``), which would reject drafts
  that spell a forced prefix differently. The grammar is wrapped in a Lark
  ``%llguidance {"no_forcing": true}`` header, so every token whose bytes fit
  is allowed, as xgrammar does.
* JSON options: compact separators unless the spec says otherwise, no free
  whitespace, ``strict`` adds ``additionalProperties: false`` where the schema
  says nothing (xgrammar's strict_mode); any ``x-guidance`` in the caller's
  schema is replaced (its ``lenient`` flag would turn refusals into silent
  over-allowing).
* Matcher adapter: ``accept_token`` checks the token before consuming it
  (llguidance enters a permanent error state on a rejected token; xgrammar
  just returns False), ``is_terminated`` means "a stop token was accepted",
  as in xgrammar (stop tokens are accepted by the adapter when the matcher is
  accepting and never given to llguidance), and a matcher that hits a resource limit raises a typed error
  instead of filling a row.

Known row differences on grammars both backends accept (measured on Llama-3;
tests/mask_service/test_llguidance_backend.py pins them): inside JSON strings
llguidance never allows U+007F or the ``\\/`` escape; xgrammar allows both.
llguidance is stricter there, never looser.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import GrammarError, LimitExceeded
from specmask.mask_service.grammar.grammar_checks import check_language, precheck
from specmask.mask_service.grammar.llguidance_check import check_llguidance_schema, strict_schema
from specmask.mask_service.grammar.oneof_disjoint import oneof_as_anyof
from specmask.mask_service.grammar.schema_rewrite import tighten_formats
from specmask.mask_service.grammar.sections import compose_llguidance

logger = logging.getLogger(__name__)

# Lark header that turns off llguidance's canonical-token forcing (see module doc).
_HEADER = '%llguidance {"no_forcing": true}\n'
# The size we charge the compiled-grammar cache per entry beyond the grammar text:
# llguidance builds its lexer lazily, so the resident size is not known up front;
# a fixed 256 KiB per grammar is the order of magnitude of its lexer tables on a 128k vocab.
_ENTRY_OVERHEAD_BYTES = 256 * 1024


class MatcherFailed(LimitExceeded):
    """llguidance's matcher hit one of its limits (lexer fuel, Earley items) or an internal error."""


@dataclass(frozen=True)
class LLCompiler:
    """The per-(tokenizer, vocab size) state a compile needs: llguidance's tokenizer view."""

    tokenizer: Any  # llguidance.LLTokenizer
    tokenizer_info: Any  # xgrammar.TokenizerInfo it was built from (stop ids, vocab size)


@dataclass(frozen=True)
class LLCompiled:
    grammar: str  # validated llguidance grammar (Lark text); rebuilding a matcher from it is deterministic
    template: Any  # llguidance.LLMatcher at the start state; sessions deep-copy it
    tokenizer_info: Any  # xgrammar.TokenizerInfo (the servicer reads stop_token_ids from it)
    memory_size_bytes: int


def _json_options(spec: GrammarSpec) -> dict[str, Any]:
    # General \uXXXX escapes in plain strings, as xgrammar allows (llguidance's default
    # allows \u only for control characters); strings under a pattern stay without them.
    escapes = {"json_allow_general_unicode_escapes": True}
    if spec.any_whitespace and spec.separators is None:
        return {"whitespace_flexible": True, **escapes}
    item, key = spec.effective_separators()
    return {"whitespace_flexible": spec.any_whitespace, "item_separator": item, "key_separator": key, **escapes}


def _json_grammar(schema: Any, spec: GrammarSpec) -> str:
    if schema is True:
        schema = {}
    if schema is False:
        raise GrammarError("the schema 'false' matches nothing (unsatisfiable schema)")
    schema = dict(schema)
    schema["x-guidance"] = _json_options(spec)
    return f"{_HEADER}start: %json {json.dumps(schema, ensure_ascii=False)}\n"


def _json_schema(spec: GrammarSpec) -> str:
    try:
        schema = json.loads(spec.text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object or a boolean")
    check_llguidance_schema(schema)
    schema = tighten_formats(schema)  # format_patterns' regexes
    schema = oneof_as_anyof(schema)  # a oneOf proven disjoint is an anyOf (llguidance's own proof is narrower)
    if spec.strict:
        schema = strict_schema(schema)
    return _json_grammar(schema, spec)


def _regex(spec: GrammarSpec) -> str:
    return f"{_HEADER}start: /{_lark_regex_body(spec.text)}/\n"


def _lark_regex_body(regex: str) -> str:
    # Inside /.../ only an unescaped '/' ends the literal.
    out, escaped = [], False
    for ch in regex:
        if ch == "/" and not escaped:
            out.append("\\/")
        else:
            out.append(ch)
        escaped = ch == "\\" and not escaped
    return "".join(out)


_BY_KIND: dict[GrammarKind, Callable[[GrammarSpec], str]] = {
    GrammarKind.JSON_SCHEMA: _json_schema,
    GrammarKind.ANY_JSON: lambda spec: _json_grammar({}, spec),
    GrammarKind.REGEX: _regex,
    GrammarKind.LARK: lambda spec: _HEADER + spec.text,
}


def grammar_for_spec(spec: GrammarSpec) -> str:
    """The llguidance grammar text for a spec, refusals applied; no tokenizer needed.

    A plain function so a compile worker process can run it (with
    ``validate_grammar`` below) and hand only the text back.
    """
    fn = _BY_KIND.get(spec.kind)
    if fn is None:
        raise GrammarError(
            f"backend llguidance does not support {spec.kind.value} (xgrammar's EBNF dialect; use lark instead)"
        )
    if spec.kind is not GrammarKind.ANY_JSON and not spec.text:
        raise GrammarError(f"{spec.kind.value} grammar text is empty")
    return compose_llguidance(fn(spec), spec)


def validate_grammar(grammar: str, tokenizer: Any, kind: GrammarKind) -> None:
    """Raise GrammarError with llguidance's message if it refuses the grammar."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        # llguidance's message starts with "at LINE(COL): " and ends with the grammar listing.
        first = messages[0].split("\n", 1)[0] if messages else "unknown error"
        msg = first.split(": ", 1)[-1] if first.startswith("at ") else first
        raise GrammarError(f"{kind.value} grammar rejected by llguidance: {msg}")


def tokenizer_from_info(info: Any) -> Any:
    """An LLTokenizer that sees each token as exactly the bytes xgrammar sees.

    xgrammar's special tokens and the stop tokens are given as special (llguidance
    never lets them match text; stop tokens are allowed only where the document
    may end); the padded vocab size comes from ``info``.
    """
    from llguidance import LLTokenizer, TokenizerWrapper

    stops = [int(s) for s in info.stop_token_ids]
    # Stop tokens must be special: given as text (a tokenizer.json loaded alone marks
    # none special), llguidance would allow "<|eot_id|>" inside a JSON string, i.e. a
    # row that lets the sampler end the request mid-document.
    special = sorted({int(i) for i in info.special_token_ids} | set(stops))
    source = _VocabSource([bytes(t) for t in info.decoded_vocab], stops, special)
    tok = LLTokenizer(TokenizerWrapper(source), n_vocab=int(info.vocab_size), eos_token=stops or None)
    source.tokenizer = tok
    return tok


class _VocabSource:
    """What llguidance.TokenizerWrapper reads: token bytes, EOS, special ids, and a tokenize callable."""

    def __init__(self, tokens: list[bytes], stops: list[int], special: list[int]) -> None:
        self.tokens = tokens
        self.eos_token_id = stops[0] if stops else 0
        self.bos_token_id = None
        self.special_token_ids = special
        self.tokenizer: Any = None  # the LLTokenizer built over this source

    def __call__(self, text: bytes) -> list[int]:
        # Only reached through llguidance's tokenize APIs, which the mask path never
        # calls (forcing is off): greedy longest match over the same vocabulary.
        return list(self.tokenizer.greedy_tokenize(text)) if self.tokenizer is not None else []


class LLGuidanceMatcher:
    """xgrammar.GrammarMatcher's methods (as draft_masks/sessions call them) over an llguidance.LLMatcher."""

    __slots__ = ("_m", "_stops", "_terminated")

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self._stops = stop_token_ids
        self._terminated = False

    def _check(self) -> None:
        if self._m.is_error():
            raise MatcherFailed(f"llguidance matcher failed: {self._m.get_error().split(chr(10), 1)[0]}")

    def accept_token(self, token: int) -> bool:
        if self._terminated:
            return False
        if token in self._stops:
            # Stop tokens are ours, not llguidance's: it reports a stopped matcher's EOS as
            # invalid in validate_tokens yet consumes it without history, so a later
            # rollback would undo a real token. Accept iff the document is complete.
            self._terminated = bool(self._m.is_accepting())
            return self._terminated
        if self._m.validate_tokens([token]) != 1:
            return False
        if not self._m.consume_token(token):
            self._check()
            return False
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def fill_next_token_bitmask(self, out: np.ndarray, index: int = 0) -> None:
        """out: [rows, W] int32, C-contiguous rows; fills row ``index``."""
        row = out[index]
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._check()

    def forced_bytes(self) -> bytes:
        """The bytes llguidance forces from this state (they may start or end inside a character)."""
        if self._terminated:
            return b""
        data = bytes(self._m.compute_ff_bytes())
        self._check()
        return data

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self._terminated:  # the stop token was never given to llguidance
            self._terminated = False
            num_tokens -= 1
        if num_tokens and not self._m.rollback(num_tokens):
            self._check()
            raise MatcherFailed(f"llguidance matcher could not roll back {num_tokens} tokens")


class LLGuidanceBackend:
    name = "llguidance"

    @staticmethod
    def make_compiler(tokenizer_info: Any, max_threads: int) -> LLCompiler:
        del max_threads  # llguidance compiles on the calling thread (it drops the GIL)
        return LLCompiler(tokenizer_from_info(tokenizer_info), tokenizer_info)

    def compile(self, compiler: LLCompiler, spec: GrammarSpec) -> LLCompiled:
        from llguidance import LLMatcher

        precheck(spec)  # as for xgrammar: metaschema, Unicode, depth, finite numbers
        grammar = grammar_for_spec(spec)
        validate_grammar(grammar, compiler.tokenizer, spec.kind)
        template = LLMatcher(compiler.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"{spec.kind.value} grammar rejected by llguidance: {template.get_error()}")
        compiled = LLCompiled(grammar, template, compiler.tokenizer_info, len(grammar) + _ENTRY_OVERHEAD_BYTES)
        check_language(self.new_matcher(compiled), compiler.tokenizer_info, spec)  # not empty, not only ""
        return compiled

    def new_matcher(self, compiled: LLCompiled) -> LLGuidanceMatcher:
        stops = frozenset(int(s) for s in compiled.tokenizer_info.stop_token_ids)
        return LLGuidanceMatcher(compiled.template.deep_copy(), stops)

    @staticmethod
    def forced_bytes(matcher: LLGuidanceMatcher) -> bytes:
        return matcher.forced_bytes()
