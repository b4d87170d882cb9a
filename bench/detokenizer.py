"""What incremental detokenization costs per token: ``DecodeStream`` against the window code.

    python -m bench.detokenizer                       # SmolLM2-135M-Instruct's tokenizer if cached
    python -m bench.detokenizer --tokenizer DIR --tokens 4000 --chunk 1,4

Encodes real text (the repository's docs: English prose, code, tables, some non-ASCII) and
pushes its ids through ``IncrementalDetokenizer`` as a request does, ``--chunk`` ids per push
(1: a request with logprobs, which pushes one token at a time; k+1: a speculative step's
accepted tokens), then flushes. Two implementations, alternated round by round in the same
process: ``stream`` (a ``tokenizers.Tokenizer``: pushes go through ``DecodeStream``) and
``window`` (the same class over a decoder that is not a ``tokenizers.Tokenizer``: the window code
in Python, as before the stream). Their deltas must be identical. Prints a table and a final
``RESULT {json}`` line (microseconds per token, median and minimum, and window / stream).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specmask.orchestrator.detokenizer import IncrementalDetokenizer

ROOT = Path(__file__).resolve().parents[1]
IMPLEMENTATIONS = ("window", "stream")


class _Window:
    """A decoder that is not a ``tokenizers.Tokenizer``: the detokenizer uses its window code."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _default_tokenizer() -> str:
    """The cached default model's directory (never fetched: `specmask models get` does that)."""
    from specmask.gpu_worker.models.cache import cached_model
    from specmask.gpu_worker.models.registry import DEFAULT_MODEL

    path = cached_model(DEFAULT_MODEL)
    if path is None:
        raise SystemExit(f"{DEFAULT_MODEL} is not cached (`specmask models get {DEFAULT_MODEL}`): pass --tokenizer DIR")
    return str(path)


def _load(path: str) -> Any:
    from tokenizers import Tokenizer

    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def _text(chars: int) -> str:
    """At least ``chars`` characters of the repository's docs, in a fixed order."""
    parts, total = [], 0
    for doc in sorted((ROOT / "docs").glob("*.md")):
        parts.append(doc.read_text(encoding="utf-8"))
        total += len(parts[-1])
        if total >= chars:
            break
    return "\n".join(parts)


def run(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int) -> tuple[float, list[str]]:
    """Push ``ids`` ``chunk`` at a time, then flush: (seconds, the deltas)."""
    deltas = []
    start = time.perf_counter()
    for at in range(0, len(ids), chunk):
        deltas.append(detok.push(ids[at : at + chunk]))
    deltas.append(detok.flush())
    return time.perf_counter() - start, deltas


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or tokenizer.json")
    parser.add_argument("--tokens", type=int, default=4000, help="ids per run")
    parser.add_argument("--chunk", default="1,4", help="ids per push, comma-separated sizes")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each implementation per chunk size")
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunk.split(",") if c.strip()]
    if args.tokens < 1 or args.rounds < 1 or not chunks or min(chunks) < 1:
        parser.error("--tokens, --rounds and every --chunk must be at least 1")

    tokenizer = _load(args.tokenizer or _default_tokenizer())
    ids = tokenizer.encode(_text(8 * args.tokens), add_special_tokens=False).ids
    ids = (ids * (args.tokens // len(ids) + 1))[: args.tokens]  # the docs repeated if they run short
    expected = tokenizer.decode(ids)

    rows: list[dict[str, Any]] = []
    mismatches = 0
    print(f"{'chunk':>5}  {'implementation':>14}  {'µs/token p50':>12}  {'min':>8}  {'max':>8}")
    for chunk in chunks:
        times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
        for _ in range(args.rounds):
            outputs = {}
            for name in IMPLEMENTATIONS:  # alternated, so load on the box hits both alike
                detok = IncrementalDetokenizer(tokenizer if name == "stream" else _Window(tokenizer))
                assert detok.streams == (name == "stream")
                seconds, outputs[name] = run(detok, ids, chunk)
                times[name].append(1e6 * seconds / len(ids))
            mismatches += outputs["stream"] != outputs["window"] or "".join(outputs["stream"]) != expected
        for name in IMPLEMENTATIONS:
            t = times[name]
            print(f"{chunk:>5}  {name:>14}  {statistics.median(t):>12.2f}  {min(t):>8.2f}  {max(t):>8.2f}")
        # The median, and the minimum (the run the box's other jobs disturbed least).
        row: dict[str, Any] = {"chunk": chunk}
        for stat, f in (("p50", statistics.median), ("min", min)):
            window, stream = f(times["window"]), f(times["stream"])
            row.update({f"window_{stat}_us": round(window, 3), f"stream_{stat}_us": round(stream, 3)})
            row[f"window_over_stream_{stat}"] = round(window / stream, 2)
        rows.append(row)

    import tokenizers

    print(
        "RESULT "
        + json.dumps(
            {
                "rows": rows,
                "tokens": len(ids),
                "rounds": args.rounds,
                "mismatched_runs": mismatches,
                "tokenizers": tokenizers.__version__,
                "cpus": os.cpu_count(),
                "load_average": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
