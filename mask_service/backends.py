"""Grammar-engine backends behind a registry (house style: plug-in points are registries).

A backend turns a ``GrammarSpec`` plus an engine tokenizer into a compiled
grammar and makes matchers from it. Only xgrammar is registered today: it
covers every ``GrammarKind`` (Lark through ``xgrammar.Grammar.from_lark``) and
its matcher supports rollback, which the draft-mask walk needs. llguidance is
used by the benchmark as a comparison, not as a serving backend.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from mask_service.errors import GrammarError
from mask_service.grammar import GrammarKind, GrammarSpec
from mask_service.schema_check import check_schema
from mask_service.schema_rewrite import needs_ebnf_repair, repair_ebnf, rewrite_schema


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
            'char ::= [^"\\\\\\x00-\\x1f] | "\\\\" ( ["\\\\/bfnrt] | "u" hex hex hex hex )',
            "hex ::= [0-9a-fA-F]",
            'number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [+-]? [0-9]+ )?',
        ]
    )


class GrammarBackend(Protocol):
    name: str

    def compile(self, compiler: Any, spec: GrammarSpec) -> Any:
        """Return the engine's compiled grammar; raise GrammarError with the engine's message."""

    def new_matcher(self, compiled: Any) -> Any:
        """A fresh matcher at the grammar's start state, with unbounded rollback."""


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self) -> None:
        self._by_kind: dict[GrammarKind, Callable[[Any, GrammarSpec], Any]] = {
            GrammarKind.JSON_SCHEMA: self._json_schema,
            GrammarKind.ANY_JSON: self._any_json,
            GrammarKind.REGEX: lambda c, s: c.compile_regex(s.text),
            GrammarKind.EBNF: lambda c, s: c.compile_grammar(s.text),
            GrammarKind.LARK: self._lark,
        }

    @staticmethod
    def make_compiler(tokenizer_info: Any, max_threads: int) -> Any:
        import xgrammar as xgr

        # Our own byte-bounded LRU (compiler_cache) replaces xgrammar's cache.
        return xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)

    @staticmethod
    def _json_schema(compiler: Any, spec: GrammarSpec) -> Any:
        try:
            schema = json.loads(spec.text)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object or a boolean")
        import xgrammar as xgr

        check_schema(schema)  # refuse what xgrammar would silently not enforce
        rewritten = rewrite_schema(schema)  # make the rest enforceable (stricter, never looser)
        text = spec.text if rewritten == schema else json.dumps(rewritten, ensure_ascii=False)
        grammar = xgr.Grammar.from_json_schema(
            text,
            any_whitespace=spec.any_whitespace,
            separators=spec.effective_separators(),
            strict_mode=spec.strict,
        )
        ebnf = str(grammar)
        if needs_ebnf_repair(ebnf):
            return compiler.compile_grammar(repair_ebnf(ebnf))
        return compiler.compile_grammar(grammar)

    @staticmethod
    def _any_json(compiler: Any, spec: GrammarSpec) -> Any:
        if spec.any_whitespace and spec.separators is None:
            return compiler.compile_builtin_json_grammar()
        # xgrammar 0.2.8's builtin grammar allows any whitespace and only
        # objects/arrays at top level, and its "{}" schema rejects objects with
        # keys, so compact "any JSON" is our own EBNF with the separators baked in.
        return compiler.compile_grammar(any_json_ebnf(*spec.effective_separators()))

    @staticmethod
    def _lark(compiler: Any, spec: GrammarSpec) -> Any:
        import xgrammar as xgr

        return compiler.compile_grammar(xgr.Grammar.from_lark(spec.text))

    def compile(self, compiler: Any, spec: GrammarSpec) -> Any:
        fn = self._by_kind.get(spec.kind)
        if fn is None:
            raise GrammarError(f"backend {self.name} does not support {spec.kind.value}")
        if spec.kind is not GrammarKind.ANY_JSON and not spec.text:
            raise GrammarError(f"{spec.kind.value} grammar text is empty")
        try:
            return fn(compiler, spec)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar reports parse/convert failures as RuntimeError with a
            # "[time] file.cc:line: message" prefix; keep only the message.
            msg = str(exc).strip()
            if "] " in msg and msg.startswith("["):
                msg = msg.split(": ", 1)[-1] if ".cc:" in msg else msg
            raise GrammarError(f"{spec.kind.value} grammar rejected: {msg}") from exc

    def new_matcher(self, compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)


BACKENDS: dict[str, GrammarBackend] = {"xgrammar": XGrammarBackend()}
DEFAULT_BACKEND = "xgrammar"
