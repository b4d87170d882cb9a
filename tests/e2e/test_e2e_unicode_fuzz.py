"""The lie hunter's non-ASCII families through the whole tiny stack: Latin-1 ranges, CJK
alternations, emoji repeats, non-ASCII const/enum/keys/patterns as regex, EBNF, Lark and
JSON Schema. No invalid output is returned as complete, none is produced (and caught),
and no request fails with an error (the INTERNAL errors of the forced walk)."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.lie_cases import generate
from bench.lies import run_cases
from tests.e2e.stack import ThreadStack

pytestmark = pytest.mark.slow

# A couple of minutes on two loaded cores.
NUM_REQUESTS = 64
SEED = 21


def test_unicode_grammars_never_lie(stack: ThreadStack) -> None:
    assert stack.running is not None
    cases = generate(
        SEED, NUM_REQUESTS, max_k=stack.running.config.max_k, max_tokens=32, seeded_only=True, unicode=True
    )
    tally = asyncio.run(run_cases(stack.address, cases, concurrency=8))
    summary = json.dumps(tally.summary(), indent=1, ensure_ascii=False)
    assert tally.requests == NUM_REQUESTS
    assert tally.violations == 0, summary
    assert tally.caught == 0, summary
    assert tally.errors == 0, summary  # INTERNAL and every other failure; overload is counted apart
    assert tally.completed >= NUM_REQUESTS // 4, summary
