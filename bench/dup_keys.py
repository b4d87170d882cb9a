"""Cost of refusing repeated keys per mask row: the guarded row vs the engine's own row.

    python -m bench.dup_keys                 # Llama-3 tokenizer from the shared data, both engines
    python -m bench.dup_keys --repeats 500

For an open-map schema, a session is put in a few states (inside a key of an object
with keys, just after a key opened, inside a value string, between entries, in an
object with no keys yet) and the row is filled ``--repeats`` times through the
``DuplicateKeyGuard`` and through the engine's matcher under it, in the same run.
Prints a table and a final ``RESULT {json}`` line (medians in microseconds and the
guard/engine ratio per state).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.mask_service.grammar.json_keys import DuplicateKeyGuard
from specmask.mask_service.server.compiler_cache import CompilerCache
from specmask.mask_service.server.sessions import SessionStore
from specmask.mask_service.server.tokenizers import TokenizerRegistry, TokenizerSource

SCHEMA = {"type": "object", "additionalProperties": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}
STATES = {
    "in key (keys)": '{"name":"Bob","age":3,"na',
    "key opened": '{"name":"Bob","age":3,"',
    "key = earlier": '{"name":"Bob","age":3,"name',
    "in value": '{"name":"Bob","age":3,"x":"val',
    "between": '{"name":"Bob","age":3',
    "no keys yet": '{"na',
}


def _median_us(fn: object, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]  # a zero-argument callable
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=str(Path("..") / "shared" / "data" / "tokenizers" / "llama3"))
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    from transformers import PreTrainedTokenizerFast

    registry = TokenizerRegistry([TokenizerSource(args.tokenizer)])
    tid = tokenizer_id_for_path(args.tokenizer)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(args.tokenizer) / "tokenizer.json"))
    result: dict[str, dict[str, dict[str, float]]] = {}
    print(f"row fill, median of {args.repeats} (us), tokenizer {Path(args.tokenizer).name}")
    print(f"{'engine':<11} {'state':<15} {'guard us':>9} {'engine us':>10} {'ratio':>6}")
    for backend in ("xgrammar", "llguidance"):
        cache = CompilerCache(registry, max_bytes=1 << 30, compile_threads=1, compile_timeout_s=300, backend=backend)
        entry, _ = cache.get(tid, None, GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
        store = SessionStore(max_sessions=len(STATES) + 1, ttl_s=600)
        result[backend] = {}
        for label, text in STATES.items():
            session = store.open(entry, entry.vocab_size)
            guard = session.matcher
            assert isinstance(guard, DuplicateKeyGuard)
            ids = list(hf.encode(text, add_special_tokens=False))
            session.commit_locked(1, ids)
            row = np.zeros((1, session.num_mask_words), dtype=np.int32)
            guarded = _median_us(lambda: guard.fill_next_token_bitmask(row, 0), args.repeats)
            engine = _median_us(lambda: guard.inner.fill_next_token_bitmask(row, 0), args.repeats)
            result[backend][label] = {"guard_us": guarded, "engine_us": engine, "ratio": guarded / engine}
            print(f"{backend:<11} {label:<15} {guarded:>9.1f} {engine:>10.1f} {guarded / engine:>6.2f}")
        cache.shutdown()
    print("RESULT " + json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
