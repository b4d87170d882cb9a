"""Strict mode closes objects that list ``patternProperties``, on both engines and in the end check.

``patternProperties`` says what keys matching a pattern may hold, not that other keys
may appear: with ``strict`` on, a key neither a property nor a pattern admits is refused
by the mask (both engines) and by the end check's reading of either engine.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.grammar.backends import BACKENDS
from specmask.mask_service.server.tokenizers import TokenizerRegistry
from specmask.orchestrator.output_check import OutputChecker

SCHEMA = {
    "type": "object",
    "properties": {"tag": {"type": "string", "format": "email"}, "b": {"const": None}},
    "required": [],
    "patternProperties": {"^p[0-9]$": {"type": "string", "format": "date"}},
}


def _accepts(registry: TokenizerRegistry, bpe_id: str, hf_tok: Any, backend: str, spec: GrammarSpec, text: str) -> bool:
    engine = BACKENDS[backend]
    compiled = engine.compile(engine.make_compiler(registry.info(bpe_id, None), 1), spec)
    matcher = engine.new_matcher(compiled)
    return all(matcher.accept_token(int(t)) for t in hf_tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("any_whitespace", [False, True])
def test_strict_refuses_keys_no_pattern_admits(
    registry: TokenizerRegistry, bpe_id: str, hf_tok: Any, backend: str, any_whitespace: bool
) -> None:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA), any_whitespace=any_whitespace, backend=backend)
    assert not _accepts(registry, bpe_id, hf_tok, backend, spec, '{"id":0.05}')
    assert not _accepts(registry, bpe_id, hf_tok, backend, spec, '{"id": 0.05}')
    assert _accepts(registry, bpe_id, hf_tok, backend, spec, '{"p1":"2020-01-01"}')
    checker = OutputChecker()
    assert not checker.check(spec, '{"id": 0.05}', engine=backend).ok
    assert checker.check(spec, '{"p1":"2020-01-01","b":null}', engine=backend).ok
    # Not strict: other keys are the caller's wish, on either engine.
    loose = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA), strict=False, backend=backend)
    assert checker.check(loose, '{"id": 0.05}', engine=backend).ok
