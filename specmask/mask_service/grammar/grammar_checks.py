"""Checks every grammar passes, whichever engine compiles it.

Before compiling, ``precheck``: a JSON Schema must parse, be a valid document
of its draft (its metaschema), and hold no lone surrogate, non-finite number or
excessive nesting (``schema_check.check_document`` / ``check_metaschema``), and
must not be provably unsatisfiable (``unsatisfiable``: no value is valid);
regex, EBNF and Lark text may not name a surrogate or a code point above
U+10FFFF (``code_points``). Results are memoised per spec, so the selecting
backend and the engine it calls do not check twice.

After compiling, ``check_language``: a grammar whose language is empty
(``root ::= root``, ``[^\\s\\S]``, ``{"$ref": "#"}``, a ``$ref`` cycle) or
holds only the empty string is refused. Such a grammar's first mask row allows
no token, or only stop tokens (an engine allows a token iff some completion of
it is in the language), and the request used to end at once with empty text
reported as complete. The test is on the compiled grammar's first mask, so it
covers every kind, cause and engine alike. It cannot see every empty language:
``root ::= "a" root`` allows "a" forever and never completes, so such a request
ends by length, never as a false "complete".

``engine_message`` turns an engine exception into the text a client sees: no
"[time] file.cc:line:" prefix, no C++ "Check failed: (...) is false:", and
never an empty string.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import GrammarError, MaskError
from specmask.mask_service.grammar.code_points import bad_code_point
from specmask.mask_service.grammar.schema_check import NESTING_TOO_DEEP, check_document, check_formats, check_metaschema
from specmask.mask_service.grammar.unsatisfiable import why_unsatisfiable
from specmask.mask_service.protocols import GrammarMatcher

_TEXT_KINDS = (GrammarKind.REGEX, GrammarKind.EBNF, GrammarKind.LARK)
_ENGINE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.(?:cc|h):\d+:\s*")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false:?\s*")
_NOTHING = (
    "matches nothing (its language is empty: e.g. a rule defined only by itself, a $ref cycle, or an empty "
    "character class), so no output can satisfy it"
)
_NO_INSTANCE = (
    "JSON schema matches nothing (unsatisfiable schema: no value is valid, so no output can satisfy it, and a "
    "checked request would spend every attempt)"
)
# Cache keys (sha256 hex, not the texts) of specs whose pre-checks passed; a refusal
# raises and is not remembered. Bounded: 4096 keys are ~0.5 MB.
_PRECHECK_MEMO = 4096
_passed: OrderedDict[str, None] = OrderedDict()
_passed_lock = threading.Lock()


def load_schema(text: str) -> Any:
    """Parse a JSON Schema's text; a typed GrammarError for anything that is not one."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"schema is not valid JSON: {exc}") from exc
    except RecursionError:
        raise GrammarError(NESTING_TOO_DEEP) from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object or a boolean")
    return schema


def precheck(spec: GrammarSpec) -> None:
    """Refuse, with the reason, a grammar that no engine should compile (see the module docstring)."""
    key = spec.cache_key()
    with _passed_lock:
        if key in _passed:
            _passed.move_to_end(key)
            return
    _precheck(spec)
    mark_prechecked(spec)


def mark_prechecked(spec: GrammarSpec) -> None:
    """Remember that ``spec`` passed ``precheck``, run elsewhere on the same text by the same code
    (a compile worker's trial compile): the metaschema walk is pure Python, ~80% of a
    small schema's compile, and in the serving process it would hold the GIL from draft-mask calls."""
    key = spec.cache_key()
    with _passed_lock:
        _passed[key] = None
        _passed.move_to_end(key)
        while len(_passed) > _PRECHECK_MEMO:
            _passed.popitem(last=False)


def _precheck(spec: GrammarSpec) -> None:
    if spec.kind in _TEXT_KINDS:
        problem = bad_code_point(spec.text)
        if problem:
            raise GrammarError(f"invalid Unicode in {spec.kind.value} grammar, {problem}")
        return
    if spec.kind is not GrammarKind.JSON_SCHEMA:
        return
    schema = load_schema(spec.text)
    check_document(schema)  # depth, Unicode, finite numbers: iterative, before anything that recurses
    check_metaschema(schema)
    check_formats(schema)  # a format the end check cannot verify is refused, never waved through
    why = why_unsatisfiable(schema)
    if why:
        raise GrammarError(f"{_NO_INSTANCE}: {why}")


def check_language(matcher: GrammarMatcher, tokenizer_info: Any, spec: GrammarSpec) -> None:
    """Refuse a compiled grammar that matches nothing, or only the empty string.

    ``matcher``: a fresh matcher of the compiled grammar (either engine: both
    fill an int32 [rows, num_mask_words] bitmask row).
    """
    import numpy as np

    vocab_size = int(tokenizer_info.vocab_size)
    words = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)  # [1, num_mask_words]
    try:
        matcher.fill_next_token_bitmask(words, 0)
    except MaskError as exc:
        # llguidance fails the first mask of an empty language ("NoExtensionBias")
        # instead of returning an empty row: the same finding, reported the same way.
        raise GrammarError(f"{spec.kind.value} grammar {_NOTHING} (the engine: {exc.message})") from None
    row = words[0].view(np.uint32).copy()  # [num_mask_words]
    if vocab_size % 32:
        row[-1] &= np.uint32((1 << (vocab_size % 32)) - 1)  # bits past the vocabulary are not tokens
    stops = [int(s) for s in tokenizer_info.stop_token_ids if 0 <= int(s) < vocab_size]
    stop_allowed = any(int(row[s >> 5]) >> (s & 31) & 1 for s in stops)
    for s in stops:
        row[s >> 5] &= np.uint32(~(1 << (s & 31)) & 0xFFFFFFFF)
    if row.any():
        return
    if stop_allowed:
        raise GrammarError(
            f"{spec.kind.value} grammar matches only the empty string, so no output could satisfy it but an "
            "empty one; refusing it rather than completing every request with empty text"
        )
    raise GrammarError(f"{spec.kind.value} grammar {_NOTHING}")


def engine_message(exc: BaseException) -> str:
    """The client-facing text of a grammar-engine exception (never empty, no C++ internals)."""
    msg = str(exc).strip()
    msg = _ENGINE_PREFIX.sub("", msg)
    msg = _CHECK_FAILED.sub("", msg).strip()
    if not msg:
        return f"the grammar engine refused it without a reason ({type(exc).__name__})"
    return msg
