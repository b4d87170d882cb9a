"""bench.grpc_floor against a real mask service process (the small test tokenizer): every round
measures CPU on both sides and wall time per call, and RESULT holds their medians."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_grpc_floor_reports_cpu_per_call(tmp_path, capsys) -> None:
    from bench.grpc_floor import main
    from tests.fixtures.tokenizers import build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer(tmp_path / "bpe")
    assert main(["--tokenizer", str(tokenizer), "--calls", "200", "--rounds", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1].removeprefix("RESULT "))
    assert result["rounds"] == 2 and result["calls_per_round"] == 200
    # 200 calls take well over one clock tick of CPU on either side: a zero means nothing was read.
    assert result["server_cpu_ms_per_call"] > 0 and result["client_cpu_ms_per_call"] > 0
    assert result["wall_ms_per_call"] > 0
    assert sum(line.strip().startswith(("1 ", "2 ")) for line in out) == 2  # one table row per round
