"""End-of-request check: a grammar request's final text must satisfy the caller's grammar.

The sampler and the masks are *supposed* to make every output valid, and
three bugs showed that "supposed to" is not enough. So before a request is reported
complete (``GRAMMAR_COMPLETE``), the orchestrator checks the text the client gets,
independently of the mask path, and a failure finishes the request with
``FinishReason.GRAMMAR_VIOLATION`` instead (engine.py). The check fails closed: an
exception inside it is a violation, never a pass.

What "the caller's grammar" means, per kind (a registry, not an if-chain):

* ``JSON_SCHEMA``: the text parses as strict JSON (no duplicate keys, no NaN or
  Infinity) and a compiled ``jsonschema`` validator for the caller's ORIGINAL schema
  (not the mask service's rewrite) accepts it, with ``format`` asserted. ``strict``
  (the default) is part of what the caller asked for, checked by a second validator
  (the document must pass the schema as written too: see ``_json_schema_checker``): it means
  what the engine that masked the output enforced for it (``STRICT_READINGS``). For
  xgrammar, its ``strict_mode``: an object schema that lists ``properties`` or
  ``patternProperties`` and says nothing about ``additionalProperties`` allows no
  other keys, and ``prefixItems`` without ``items`` allows no further items; for
  llguidance, the service's strict rewrite, which leaves intersections open. Those
  defaults are written into the schema before validating; nothing else changes.
  Validators are cached by the spec's cache key (schema text + options) and the engine.
* ``ANY_JSON``: strict JSON, as above.
* ``REGEX`` / ``EBNF`` / ``LARK``: the grammar is written in xgrammar's dialect, so
  a *fresh* xgrammar matcher (no tokenizer: it parses bytes) must accept the whole
  UTF-8 text and be able to end there. Python's ``re`` is a different dialect and is
  not used. Compiled grammars are cached by cache key. A special token the grammar
  names by id (``Token(id)``) is in the text as its text (kept_tokens.py); the caller
  says where (``KeptToken``), and the matcher takes the token there as the mask service's
  engine does: by a ``Token(id)`` of the grammar, or as its text where the grammar
  admits that text (xgrammar reads an added token as its text: inside a JSON string,
  say). The marker's characters in ordinary tokens where the grammar names the token,
  or the token where neither fits, fail the check.

Formatting options (separators, whitespace) are not checked: they change how a
document is written, not whether it satisfies the grammar.

``multipleOf`` is checked in decimal, on each number's shortest round-trip spelling:
jsonschema divides floats (10000.89 / 0.01 = 1000088.9999999999) and so failed a
valid ``10000.89`` against ``multipleOf: 0.01`` (bench.e2e, Github_easy---o46379).
"""

from __future__ import annotations

import collections
import dataclasses
import decimal
import functools
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specmask.common.ecma_regex import ecma_schema
from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.reasoning_section import split_output
from specmask.mask_service.grammar.llguidance_check import strict_schema as llguidance_strict
from specmask.mask_service.grammar.schema_check import unverifiable_formats
from specmask.orchestrator.kept_tokens import TOKEN_REF, KeptToken

__all__ = ["OutputCheckError", "OutputChecker", "Verdict", "exact_multiples", "strict_schema", "validate_decimal"]

# Compiled checkers kept (LRU). A compiled jsonschema validator or a byte-level
# xgrammar grammar is small; 512 covers a serving mix of distinct grammars.
MAX_CACHED_CHECKERS = 512

# Subschema locations (JSON Schema 2020-12 and draft 4-7 spellings) the strict
# defaults are pushed into.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)


class OutputCheckError(Exception):
    """The checker itself could not run (bad schema, engine error): treated as a violation."""


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""  # why not, for the typed error and the log line


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` with xgrammar's ``strict_mode`` defaults made explicit."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [strict_schema(sub) for sub in value]
        elif key in _SCHEMA_VALUES:
            out[key] = strict_schema(value)
        else:
            out[key] = value
    lists_properties = "properties" in schema or "patternProperties" in schema
    if lists_properties and "additionalProperties" not in schema and "unevaluatedProperties" not in schema:
        out["additionalProperties"] = False
        # xgrammar ignores a required name missing from properties, so the mask service declares
        # it (schema_rewrite: with the additionalProperties schema, here none, so {}) before
        # strict mode closes the object; closed without it, no output could pass.
        declared = out.get("properties")
        props: dict[str, Any] = declared if isinstance(declared, dict) else {}
        listed = schema.get("required")
        required: list[Any] = [*(listed if isinstance(listed, list) else []), *dependency_names(schema)]
        missing = list(dict.fromkeys(r for r in required if isinstance(r, str) and r not in props))
        if missing:
            out["properties"] = {**props, **{name: {} for name in missing}}
    if "prefixItems" in schema and "items" not in schema and "unevaluatedItems" not in schema:
        out["items"] = False
    if isinstance(schema.get("items"), list) and "additionalItems" not in schema:  # draft 4-7 tuples
        out["additionalItems"] = False
    return out


def dependency_names(node: dict[str, Any]) -> list[str]:
    """Names a ``dependentRequired`` (or draft 4-7 list-valued ``dependencies``) of ``node`` can
    require. Strict mode declares them as it declares ``required`` names: the mask service
    enforces a dependency by requiring its names (``dependencies`` rewrite), and closed
    without them an object with the trigger could not pass."""
    out: list[str] = []
    for key in ("dependentRequired", "dependencies"):
        value = node.get(key)
        if isinstance(value, dict):
            out.extend(n for names in value.values() if isinstance(names, list) for n in names if isinstance(n, str))
    return out


# Keywords whose subschemas only assert (a negation, a condition, a conditional or counted
# assertion). No engine generates from them: both refuse them, and checked mode's relaxation
# drops them (mask_service.grammar.schema_relax). Strict mode closes the objects an engine
# generates, so it has nothing to close there; pushed into them, strict defaults change the
# assertion itself: inside a double negation or a ``then`` they refuse documents the schema
# allows, inside a single ``not`` they let through ones it forbids. The strict validator gets
# the schema without them; the validator of the schema as written checks them in full.
_ASSERTION_ONLY = frozenset({"not", "if", "then", "else", "contains", "dependentSchemas", "dependencies"})
# Keys whose value is instance data, never a schema (a key named "not" there is data).
_DATA_KEYS = frozenset({"const", "enum", "default", "examples", "example"})


def without_assertions(node: Any) -> Any:
    """A copy of ``node`` without the ``_ASSERTION_ONLY`` keywords at schema positions.

    Dropping a keyword loosens a schema everywhere but under ``oneOf``, where a branch that
    matches more can make two branches match (a ``not`` was often what kept them apart), so
    the copy reads ``oneOf`` as ``anyOf``: exclusivity is the as-written check's to enforce.
    """
    if isinstance(node, list):
        return [without_assertions(sub) for sub in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _ASSERTION_ONLY:
            if key == "dependencies" and isinstance(value, dict):
                # Its lists hold names, not subschemas: kept for strict mode's declared names.
                lists = {k: v for k, v in value.items() if isinstance(v, list)}
                if lists:
                    out[key] = lists
            continue
        if key in _DATA_KEYS:
            out[key] = value
        elif key == "oneOf" and "anyOf" not in node and isinstance(value, list):
            out["anyOf"] = without_assertions(value)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> subschemas: a name is not a keyword
            out[key] = {name: without_assertions(sub) for name, sub in value.items()}
        else:
            out[key] = without_assertions(value)
    return out


# What ``strict`` means, per engine that can mask a JSON schema. xgrammar's strict_mode
# closes every object that lists properties; llguidance's strict rewrite
# (mask_service.llguidance_check) leaves open an object that is one side of an intersection
# (allOf branches, properties beside anyOf/oneOf/$ref) or requires an undeclared name, where
# additionalProperties: false would also forbid the other side's keys. Checking an
# llguidance-masked output against xgrammar's reading failed valid answers: root
# "properties": {} beside a oneOf of {"status": ...} branches (Github_trivial---o42156)
# closed the root, so no document could pass. The schema as written is checked either way.
STRICT_READINGS: dict[str, Callable[[Any], Any]] = {"xgrammar": strict_schema, "llguidance": llguidance_strict}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def parse_strict_json(text: str) -> Any:
    """RFC 8259 JSON: no duplicate object keys, no NaN/Infinity; raises ValueError."""
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)


class OutputChecker:
    """Thread-safe; ``check`` may run on the engine's executor threads."""

    def __init__(self, max_cached: int = MAX_CACHED_CHECKERS) -> None:
        # jsonschema's first import, with its format checkers, costs seconds of CPU: paid when
        # the server is built, not by the first grammar request (checks may run on the loop).
        from specmask.mask_service.grammar.schema_check import verifiable_formats

        assert verifiable_formats()
        self._max_cached = max_cached
        self._cache: collections.OrderedDict[str, _Check] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._builders: dict[GrammarKind, Callable[[GrammarSpec, str], _Check]] = {
            GrammarKind.JSON_SCHEMA: _text_only(_json_schema_checker),
            GrammarKind.ANY_JSON: _text_only(lambda _spec, _engine: _any_json_check),
            GrammarKind.REGEX: _xgrammar_checker,
            GrammarKind.EBNF: _xgrammar_checker,
            GrammarKind.LARK: _xgrammar_checker,
        }

    def check(self, spec: GrammarSpec, text: str, engine: str = "", tokens: Sequence[KeptToken] = ()) -> Verdict:
        """Whether ``text`` is a complete document of ``spec``; raises OutputCheckError if it cannot tell.

        ``engine``: the engine that masked the output (the mask service's GrammarReport). It
        picks what ``strict`` means for a JSON schema (see ``_json_schema_checker``); "" or
        an unknown name takes xgrammar's reading, the stricter one. ``tokens``: the special
        tokens ``text`` holds as their text (kept_tokens.py), each checked as its token."""
        if spec.reasoning is not None:
            # The output is the reasoning section then the caller's document (reasoning_section.py):
            # only the document is the caller's, and an output whose section never closed has none.
            split = split_output(spec.reasoning, text)
            if split is None or not split.closed:
                return Verdict(False, f"the reasoning section of the output {_preview(text)} never closed")
            start = len(text) - len(split.content)
            if any(t.offset < start for t in tokens):
                return Verdict(False, "a special token in the reasoning section, which admits none")
            tokens = [dataclasses.replace(t, offset=t.offset - start) for t in tokens]
            spec, text = spec.without_reasoning(), split.content
        # One name per reading, so "" and "xgrammar" share a cached validator.
        if spec.kind is not GrammarKind.JSON_SCHEMA:
            engine = ""
        elif engine not in STRICT_READINGS:
            engine = "xgrammar"
        try:
            return self._checker(spec, engine)(text, tuple(tokens))
        except OutputCheckError:
            raise
        except Exception as exc:  # an engine or library failure must not pass as valid
            raise OutputCheckError(f"{type(exc).__name__}: {exc}") from exc

    def _checker(self, spec: GrammarSpec, engine: str = "") -> _Check:
        key = f"{spec.cache_key()}|{engine}"
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        built = self._builders[spec.kind](spec, engine)  # compile outside the lock
        with self._lock:
            self._cache[key] = built
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return built


# A built check: the output's text and the kept special tokens in it -> the verdict.
_Check = Callable[[str, tuple[KeptToken, ...]], Verdict]


def _text_only(build: Callable[[GrammarSpec, str], Callable[[str], Verdict]]) -> Callable[[GrammarSpec, str], _Check]:
    """A kind whose grammar names no token: an output holding a special token breaks it."""

    def built(spec: GrammarSpec, engine: str) -> _Check:
        check = build(spec, engine)

        def run(text: str, tokens: tuple[KeptToken, ...]) -> Verdict:
            if tokens:
                return Verdict(
                    False, f"the output holds special token {tokens[0].token_id}, which the grammar never names"
                )
            return check(text)

        return run

    return built


def _any_json_check(text: str) -> Verdict:
    try:
        parse_strict_json(text)
    except ValueError as exc:
        return Verdict(False, f"output is not valid JSON: {exc}")
    return Verdict(True)


def _json_schema_checker(spec: GrammarSpec, engine: str) -> Callable[[str], Verdict]:
    import jsonschema

    try:
        schema = json.loads(spec.text)
    except ValueError as exc:
        raise OutputCheckError(f"schema is not JSON: {exc}") from exc
    missing = unverifiable_formats(schema)
    if missing:  # jsonschema skips a format it has no checker for: that would pass anything
        raise OutputCheckError(f"format {', '.join(missing)} cannot be verified (checker not installed)")
    cls = exact_multiples(jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator))
    # The schema as written, always: strict defaults pushed into a condition or a negation
    # (``if``, ``not``, a ``oneOf`` branch) would make the check LOOSER (a document the
    # strict ``if`` no longer matches skips its ``then``), so strict mode only adds a
    # second validator; a document must pass both.
    # Regexes as ECMA-262 reads them (ecma_schema): Python's ``re`` alone is looser.
    validators = [cls(ecma_schema(schema), format_checker=cls.FORMAT_CHECKER)]
    if spec.strict:
        strict = STRICT_READINGS.get(engine, strict_schema)(without_assertions(schema))
        validators.append(cls(ecma_schema(strict), format_checker=cls.FORMAT_CHECKER))
    if isinstance(schema, dict) and "$schema" not in schema and _uses_keyword(schema, "dependencies"):
        # No declared draft, and a keyword only drafts 4-7 define (2020-12 ignores it): the mask
        # service took the schema under any draft, so the output must satisfy draft 7's reading too.
        draft7 = exact_multiples(jsonschema.Draft7Validator)
        validators.append(draft7(ecma_schema(schema), format_checker=draft7.FORMAT_CHECKER))

    def check(text: str) -> Verdict:
        try:
            doc = parse_strict_json(text)
        except ValueError as exc:
            return Verdict(False, f"output is not valid JSON: {exc}")
        for validator in validators:
            error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path) or "(root)"
                return Verdict(False, f"output breaks the schema at {where}: {error.message}")
        return Verdict(True)

    return check


# Digits enough for any float64 quotient (exponents span about 10^-324 .. 10^308).
_DECIMAL = decimal.Context(prec=700, traps=[decimal.InvalidOperation])


def _exact_multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Any:
    """``multipleOf`` in decimal: each float as its shortest round-trip spelling, which is
    the number a JSON reader gets from the text. An error here is a violation (fails closed)."""
    import jsonschema

    if not validator.is_type(instance, "number"):
        return
    if isinstance(divisor, float) or isinstance(instance, float):
        remainder = _DECIMAL.remainder(decimal.Decimal(repr(instance)), decimal.Decimal(repr(divisor)))
        ok = remainder == 0
    else:
        ok = instance % divisor == 0
    if not ok:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor!r}")


@functools.cache
def exact_multiples(cls: Any) -> Any:
    """``cls`` with ``multipleOf`` checked by ``_exact_multiple_of`` (one subclass per draft)."""
    import jsonschema

    return jsonschema.validators.extend(cls, {"multipleOf": _exact_multiple_of})


def validate_decimal(instance: Any, schema: Any, **kwargs: Any) -> None:
    """``jsonschema.validate`` (schema checked first, the best-matching error raised) with
    ``multipleOf`` in decimal: the validity judges of bench.e2e and the demo."""
    import jsonschema

    cls = exact_multiples(jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator))
    cls.check_schema(schema)
    error = jsonschema.exceptions.best_match(cls(ecma_schema(schema), **kwargs).iter_errors(instance))
    if error is not None:
        raise error


def _uses_keyword(node: Any, keyword: str) -> bool:
    """Whether ``keyword`` appears at a schema position anywhere in ``node`` (not inside data)."""
    if isinstance(node, list):
        return any(_uses_keyword(sub, keyword) for sub in node)
    if not isinstance(node, dict):
        return False
    if keyword in node:
        return True
    return any(
        _uses_keyword(v, keyword)
        if k not in ("const", "enum", "default", "examples", "properties")
        else (k == "properties" and isinstance(v, dict) and any(_uses_keyword(sub, keyword) for sub in v.values()))
        for k, v in node.items()
    )


# Token ids a grammar checked here may name (vocabularies stay far below: 262,144 is a large one).
_MAX_TOKEN_ID = 1 << 22


def _xgrammar_checker(spec: GrammarSpec, _engine: str = "") -> _Check:
    import xgrammar as xgr

    parse: dict[GrammarKind, Callable[[str], xgr.Grammar]] = {
        GrammarKind.REGEX: xgr.Grammar.from_regex,
        GrammarKind.EBNF: xgr.Grammar.from_ebnf,
    }
    # No vocabulary: the matcher parses bytes, and compiling costs no mask precomputation. A
    # grammar naming a token by id (``Token(128010)``) gets a vocabulary where that id is a token
    # of its own, accepted by id: its bytes (0xFF, never in UTF-8) match no text of any grammar,
    # so only a ``Token(id)`` admits it; every other id is empty, which xgrammar never accepts.
    ids = [int(i) for i in TOKEN_REF.findall(spec.text)] if spec.kind is GrammarKind.EBNF else []
    if ids and max(ids) >= _MAX_TOKEN_ID:
        raise OutputCheckError(f"token id {max(ids)} is beyond any vocabulary")
    vocab: list[bytes] = [b""] * (max(ids) + 1 if ids else 0)
    for i in ids:
        vocab[i] = b"\xff"
    info = xgr.TokenizerInfo(vocab) if ids else xgr.TokenizerInfo([])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        compiled = compiler.compile_grammar(parse.get(spec.kind, xgr.Grammar.from_lark)(spec.text))
    except Exception as exc:
        raise OutputCheckError(f"cannot compile the grammar to check the output: {exc}") from exc

    def check(text: str, tokens: tuple[KeptToken, ...]) -> Verdict:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        pos = 0
        for token in sorted(tokens, key=lambda t: t.offset):
            if token.offset < pos or not text.startswith(token.text, token.offset):
                return Verdict(False, f"special token {token.token_id} is not where the output's text holds it")
            if not matcher.accept_string(text[pos : token.offset].encode("utf-8")):
                return Verdict(False, f"the grammar rejects the output {_preview(text)}")
            # As the mask reads the token: a Token(id) of the grammar, or its text where the grammar
            # admits that text (xgrammar reads an added token as its text; a failed accept_token
            # leaves the matcher as it was).
            as_token = token.token_id < len(vocab) and matcher.accept_token(token.token_id)
            if not as_token and not matcher.accept_string(token.text.encode("utf-8")):
                where = _preview(text[: token.offset])
                return Verdict(False, f"the grammar does not admit special token {token.token_id} after {where}")
            pos = token.offset + len(token.text)
        if not matcher.accept_string(text[pos:].encode("utf-8")):
            return Verdict(False, f"the grammar rejects the output {_preview(text)}")
        if not matcher.is_terminated():
            return Verdict(False, f"the output {_preview(text)} is an incomplete document of the grammar")
        return Verdict(True)

    return check


def _preview(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
