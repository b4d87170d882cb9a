"""bench.detokenizer on the small test tokenizer: both implementations run every round, their
deltas match, and RESULT holds a row per chunk size."""

from __future__ import annotations

import json


def test_detokenizer_bench_compares_both(tmp_path, capsys) -> None:
    from bench.detokenizer import main
    from tests.fixtures.tokenizers import build_bpe_tokenizer

    bpe_dir = build_bpe_tokenizer(tmp_path / "bpe")
    assert main(["--tokenizer", str(bpe_dir), "--tokens", "300", "--chunk", "1,3", "--rounds", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1].removeprefix("RESULT "))
    assert result["mismatched_runs"] == 0 and result["tokens"] == 300
    assert [r["chunk"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["window_p50_us"] > 0 and row["stream_p50_us"] > 0
        assert 0 < row["stream_min_us"] <= row["stream_p50_us"]
    assert sum(line.split()[1:2] in (["window"], ["stream"]) for line in out) == 4  # one row each
