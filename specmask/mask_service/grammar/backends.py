"""Grammar-engine backends behind a registry (house style: plug-in points are registries).

A backend turns a ``GrammarSpec`` plus an engine tokenizer into a compiled
grammar and makes matchers from it. Two engines are registered: xgrammar
(every ``GrammarKind``) and llguidance (``backends_llguidance``: JSON schema,
any-JSON, regex, Lark). Both matchers support unbounded rollback, which the
draft-mask walk needs, and fill the same bitmask rows.

The service compiles through ``SelectingBackend`` ("auto"): per grammar it
picks the first engine in ``SELECTION_ORDER`` that enforces it exactly (each
engine refuses, with a reason, what it would not enforce) and records which one
on the compiled grammar; a spec naming a backend gets that one or its refusal.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import GrammarError
from specmask.mask_service.grammar.backends_llguidance import LLGuidanceBackend
from specmask.mask_service.grammar.backends_routing import xgrammar_gap
from specmask.mask_service.grammar.ebnf_classes import compile_scalar_only, unfaithful_print
from specmask.mask_service.grammar.exact_rewrites import rewrite_exact
from specmask.mask_service.grammar.grammar_checks import check_language, engine_message, load_schema, precheck
from specmask.mask_service.grammar.schema_check import check_schema
from specmask.mask_service.grammar.schema_relax import relax_schema
from specmask.mask_service.grammar.schema_rewrite import needs_ebnf_repair, repair_ebnf, rewrite_schema
from specmask.mask_service.grammar.sections import compose_xgrammar
from specmask.mask_service.protocols import GrammarMatcher


def _ebnf_literal(text: str) -> str:
    return json.dumps(text)


def any_json_ebnf(item_separator: str, key_separator: str) -> str:
    """EBNF for any JSON value (RFC 8259) with fixed separators and no other whitespace."""
    item, key = _ebnf_literal(item_separator), _ebnf_literal(key_separator)
    return "\n".join(
        [
            "root ::= value",
            'value ::= object | array | string | number | "true" | "false" | "null"',
            f'object ::= "{{" ( string {key} value ( {item} string {key} value )* )? "}}"',
            f'array ::= "[" ( value ( {item} value )* )? "]"',
            'string ::= "\\"" char* "\\""',
            'char ::= [^"\\\\\\x00-\\x1f\\uD800-\\uDFFF] | "\\\\" ( ["\\\\/bfnrt] | "u" hex hex hex hex )',
            "hex ::= [0-9a-fA-F]",
            'number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [+-]? [0-9]+ )?',
        ]
    )


def _with_section(grammar: Any, spec: GrammarSpec) -> Any:
    """The caller's xgrammar ``Grammar`` with the spec's reasoning section in front (sections.py)."""
    return grammar if spec.reasoning is None else compose_xgrammar(grammar, spec.reasoning)


class GrammarBackend(Protocol):
    name: str

    def make_compiler(self, tokenizer_info: Any, max_threads: int) -> Any:
        """The per-(tokenizer, vocab size) state ``compile`` takes (the engine's compiler)."""

    def compile(self, compiler: Any, spec: GrammarSpec) -> Any:
        """Return the engine's compiled grammar; raise GrammarError with the engine's message."""

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the grammar's start state, with unbounded rollback."""


class GrammarEngine(GrammarBackend, Protocol):
    """A backend that is one engine (not a selection among engines): it also reads forced bytes."""

    def forced_bytes(self, matcher: Any) -> bytes:  # Any: each engine takes only its own matcher type
        """The bytes the grammar forces from the matcher's state (b"" = none); no state change.

        They may start or end inside a UTF-8 character (a state between a character's
        byte tokens, or a forced lead byte): forced.py works in bytes."""


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self) -> None:
        self._by_kind: dict[GrammarKind, Callable[[Any, GrammarSpec], Any]] = {
            GrammarKind.JSON_SCHEMA: self._json_schema,
            GrammarKind.ANY_JSON: self._any_json,
            GrammarKind.REGEX: self._text_grammar,
            GrammarKind.EBNF: self._text_grammar,
            GrammarKind.LARK: self._text_grammar,
        }

    @staticmethod
    def make_compiler(tokenizer_info: Any, max_threads: int) -> Any:
        import xgrammar as xgr

        # Our own byte-bounded LRU (compiler_cache) replaces xgrammar's cache.
        return xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)

    @staticmethod
    def _json_schema(compiler: Any, spec: GrammarSpec) -> Any:
        schema = load_schema(spec.text)
        import xgrammar as xgr

        check_schema(schema)  # refuse what xgrammar would silently not enforce
        rewritten = rewrite_schema(schema, strict=spec.strict)  # make the rest enforceable (stricter, never looser)
        text = spec.text if rewritten == schema else json.dumps(rewritten, ensure_ascii=False)
        grammar = xgr.Grammar.from_json_schema(
            text,
            any_whitespace=spec.any_whitespace,
            separators=spec.effective_separators(),
            strict_mode=spec.strict,
        )
        # No raw control characters in length-limited strings, no ED A0..BF anywhere.
        return compile_scalar_only(
            compiler, _with_section(grammar, spec), repair=lambda t: repair_ebnf(t) if needs_ebnf_repair(t) else t
        )

    @staticmethod
    def _any_json(compiler: Any, spec: GrammarSpec) -> Any:
        if spec.reasoning is not None:
            import xgrammar as xgr

            if spec.any_whitespace and spec.separators is None:
                caller = xgr.Grammar.builtin_json_grammar()
            else:
                caller = xgr.Grammar.from_ebnf(any_json_ebnf(*spec.effective_separators()))
            return compile_scalar_only(compiler, _with_section(caller, spec))
        if spec.any_whitespace and spec.separators is None:
            return compiler.compile_builtin_json_grammar()
        # xgrammar 0.2.8's builtin grammar allows any whitespace and only
        # objects/arrays at top level, and its "{}" schema rejects objects with
        # keys, so compact "any JSON" is our own EBNF with the separators baked in.
        return compiler.compile_grammar(any_json_ebnf(*spec.effective_separators()))

    @staticmethod
    def _text_grammar(compiler: Any, spec: GrammarSpec) -> Any:
        """Regex, EBNF or Lark, compiled from its printed grammar with surrogate-free classes."""
        import xgrammar as xgr

        problem = unfaithful_print(spec.text)
        if problem:
            raise GrammarError(f"unsupported in {spec.kind.value} grammar: {problem}")
        parse: dict[GrammarKind, Callable[[str], xgr.Grammar]] = {
            GrammarKind.REGEX: xgr.Grammar.from_regex,
            GrammarKind.LARK: xgr.Grammar.from_lark,
        }
        return compile_scalar_only(
            compiler, _with_section(parse.get(spec.kind, xgr.Grammar.from_ebnf)(spec.text), spec)
        )

    def compile(self, compiler: Any, spec: GrammarSpec) -> Any:
        fn = self._by_kind.get(spec.kind)
        if fn is None:
            raise GrammarError(f"backend {self.name} does not support {spec.kind.value}")
        if spec.kind is not GrammarKind.ANY_JSON and not spec.text:
            raise GrammarError(f"{spec.kind.value} grammar text is empty")
        precheck(spec)  # metaschema, Unicode, depth (memoised, so "auto" checks once)
        try:
            compiled = fn(compiler, spec)
        except GrammarError:
            raise
        except RecursionError:  # a RuntimeError: never Python's own message to the client
            raise GrammarError(f"{spec.kind.value} grammar nests too deep to process") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar reports parse/convert failures as RuntimeError with a
            # "[time] file.cc:line: message" prefix; keep only the message.
            raise GrammarError(f"{spec.kind.value} grammar rejected: {engine_message(exc)}") from exc
        check_language(self.new_matcher(compiled), compiled.tokenizer_info, spec)  # not empty, not only ""
        return compiled

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)

    @staticmethod
    def forced_bytes(matcher: Any) -> bytes:
        """xgrammar's jump-forward string (documented not to change the matcher state), as bytes.

        The engine computes bytes and its binding decodes them as UTF-8, which fails
        when they start or end inside a character; the decode error carries the bytes."""
        try:
            return str(matcher.find_jump_forward_string()).encode("utf-8")
        except UnicodeDecodeError as exc:
            return bytes(exc.object)


@dataclass(frozen=True)
class EngineCompilers:
    """One lazily-built compiler per engine for one (tokenizer, vocab size)."""

    tokenizer_info: Any  # xgrammar.TokenizerInfo
    max_threads: int
    built: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, name: str) -> Any:
        with self.lock:
            comp = self.built.get(name)
            if comp is None:
                comp = ENGINES[name].make_compiler(self.tokenizer_info, self.max_threads)
                self.built[name] = comp
            return comp


@dataclass(frozen=True)
class SelectedGrammar:
    """A compiled grammar and the engine that compiled it (what sessions and the servicer read)."""

    backend: str
    compiled: Any  # the engine's compiled grammar
    reasons: tuple[str, ...] = ()  # why engines earlier in the order refused it
    # "exact", or "checked": compiled from a relaxation of the schema (GrammarSpec.checked, schema_relax)
    enforcement: str = "exact"
    relaxed: tuple[str, ...] = ()  # checked: the relaxation rules applied

    @property
    def tokenizer_info(self) -> Any:
        return self.compiled.tokenizer_info

    @property
    def memory_size_bytes(self) -> int:
        return int(self.compiled.memory_size_bytes)


# xgrammar first: where both enforce a grammar exactly, xgrammar's masks are cheaper
# (docs/benchmarks.md, "Mask service": the per-row cost of each on the same schemas).
SELECTION_ORDER = ("xgrammar", "llguidance")
# Kinds that fall through to the next engine when the first refuses. JSON schema only:
# a regex or Lark text xgrammar rejects is a syntax error for the caller to fix, and
# the engines' regex/Lark dialects differ, so another engine accepting it is no safer.
_FALLBACK_KINDS = frozenset({GrammarKind.JSON_SCHEMA})


def _with_checked_hint(refusal: GrammarError, spec: GrammarSpec) -> GrammarError:
    """The refusal, naming checked mode when the schema has keywords it would relax (a pure
    rewrite, no compile: the relaxation may still be refused when a request opts in)."""
    if type(refusal) is not GrammarError:  # a typed subclass (too complex, ...) keeps its type
        return refusal
    try:
        _, rules = relax_schema(load_schema(spec.text))
    except GrammarError:
        return refusal
    if not rules:
        return refusal
    return GrammarError(
        f"{refusal.message} (checked mode could serve it: generate under a relaxation ({', '.join(rules)}) "
        "and check the output against this schema at the end; opt in per request)"
    )


def exact_rewritten(spec: GrammarSpec) -> GrammarSpec:
    """A JSON-schema spec with ``exact_rewrites`` applied (the same language, in keywords the
    engines enforce); other kinds, and schemas no rule changes, as given. Run after
    ``precheck``: the rewrites assume a valid schema document."""
    if spec.kind is not GrammarKind.JSON_SCHEMA:
        return spec
    try:
        schema = json.loads(spec.text)
    except (json.JSONDecodeError, RecursionError):
        return spec  # the engines report it
    rewritten, rules = rewrite_exact(schema, strict=spec.strict)
    if not rules:
        return spec
    return dataclasses.replace(spec, text=json.dumps(rewritten, ensure_ascii=False))


class SelectingBackend:
    """Picks an engine per grammar (deterministic: fixed order, first that accepts)."""

    name = "auto"

    @staticmethod
    def make_compiler(tokenizer_info: Any, max_threads: int) -> EngineCompilers:
        return EngineCompilers(tokenizer_info, max_threads)

    def compile(self, compilers: EngineCompilers, spec: GrammarSpec) -> SelectedGrammar:
        if spec.reasoning is not None:
            return self._compile_with_section(compilers, spec)
        precheck(spec)  # refusals no engine changes (metaschema, Unicode, depth), said once
        spec = exact_rewritten(spec)
        if spec.backend and spec.backend not in ENGINES:  # never relaxed: a caller's typo
            raise GrammarError(f"unknown grammar backend {spec.backend!r}; known: {', '.join(sorted(ENGINES))}")
        try:
            return self._select(compilers, spec)
        except GrammarError as exc:
            if spec.kind is not GrammarKind.JSON_SCHEMA:
                raise
            if not spec.checked:
                raise _with_checked_hint(exc, spec) from None
            return self._select_relaxed(compilers, spec, exc)

    def _compile_with_section(self, compilers: EngineCompilers, spec: GrammarSpec) -> SelectedGrammar:
        """``section caller`` (sections.py) on the engine the caller's grammar alone selects.

        The caller's grammar is compiled alone first, so it is refused exactly as without a
        section (an empty language too: behind the section's first row ``check_language``
        could not see it), picks the same engine and, in checked mode, the same relaxation.
        That costs a second compile per new grammar (the cache keeps the composed one)."""
        alone = self.compile(compilers, spec.without_reasoning())
        spec = exact_rewritten(spec)  # the text the selection compiled alone
        text = spec.text
        if alone.enforcement == "checked":
            text = json.dumps(relax_schema(load_schema(spec.text))[0], ensure_ascii=False)
        composed = dataclasses.replace(spec, text=text, backend=alone.backend, checked=False)
        return dataclasses.replace(alone, compiled=self._compile_exact(alone.backend, compilers, composed))

    def _select_relaxed(self, compilers: EngineCompilers, spec: GrammarSpec, refusal: GrammarError) -> SelectedGrammar:
        """Checked mode: the selection run on the schema's relaxation (schema_relax), else the refusal."""
        try:
            relaxed, rules = relax_schema(load_schema(spec.text))
        except GrammarError as exc:
            raise GrammarError(f"{refusal.message}; {exc.message}") from None
        if not rules:
            raise refusal  # nothing relaxable: refused exactly as without checked mode
        text = json.dumps(relaxed, ensure_ascii=False)
        try:
            selected = self._select(compilers, dataclasses.replace(spec, text=text, checked=False))
        except GrammarError as exc:
            raise GrammarError(
                f"{refusal.message}; checked mode: its relaxation ({', '.join(rules)} relaxed) is refused too: "
                f"{exc.message}"
            ) from None
        return dataclasses.replace(selected, enforcement="checked", relaxed=rules)

    def _select(self, compilers: EngineCompilers, spec: GrammarSpec) -> SelectedGrammar:
        if spec.backend:
            if spec.backend not in ENGINES:
                raise GrammarError(f"unknown grammar backend {spec.backend!r}; known: {', '.join(sorted(ENGINES))}")
            return SelectedGrammar(spec.backend, self._compile_exact(spec.backend, compilers, spec))
        order = SELECTION_ORDER if spec.kind in _FALLBACK_KINDS else SELECTION_ORDER[:1]
        reasons: list[str] = []
        for name in order:
            try:
                return SelectedGrammar(name, self._compile_exact(name, compilers, spec), tuple(reasons))
            except GrammarError as exc:
                reasons.append(f"{name}: {exc.message}")
        if len(reasons) == 1:
            raise GrammarError(reasons[0].split(": ", 1)[1])
        # xgrammar's reason first, so its wording (tests, clients) is unchanged.
        raise GrammarError("; ".join(reasons))

    @staticmethod
    def _compile_exact(name: str, compilers: EngineCompilers, spec: GrammarSpec) -> Any:
        """The engine's compile, refused first where the engine would not enforce the schema exactly."""
        if name == "xgrammar" and spec.kind is GrammarKind.JSON_SCHEMA:
            try:
                schema = json.loads(spec.text)
            except (json.JSONDecodeError, RecursionError):
                schema = None  # the engine reports it
            gap = xgrammar_gap(schema)
            if gap:
                raise GrammarError(f"unsupported at {gap}")
        compiled = ENGINES[name].compile(compilers.get(name), spec)
        if name != "xgrammar":  # XGrammarBackend.compile checks its own
            check_language(ENGINES[name].new_matcher(compiled), compiled.tokenizer_info, spec)
        return compiled

    def new_matcher(self, compiled: SelectedGrammar) -> GrammarMatcher:
        return ENGINES[compiled.backend].new_matcher(compiled.compiled)


def engine_name(compiled: Any, backend: GrammarBackend) -> str:
    """The engine behind a compiled grammar: the selected one under "auto", else the backend itself."""
    return compiled.backend if isinstance(compiled, SelectedGrammar) else backend.name


def enforcement_of(compiled: Any) -> tuple[str, tuple[str, ...]]:
    """("exact" | "checked", relaxation rules applied): only the selecting backend relaxes."""
    if isinstance(compiled, SelectedGrammar):
        return compiled.enforcement, compiled.relaxed
    return "exact", ()


ENGINES: dict[str, GrammarEngine] = {"xgrammar": XGrammarBackend(), "llguidance": LLGuidanceBackend()}
BACKENDS: dict[str, GrammarBackend] = {**ENGINES, "auto": SelectingBackend()}
DEFAULT_BACKEND = "auto"
