"""bench.worker end to end on the tiny trained toy pair (same pipeline as the real toy pair)."""

from __future__ import annotations

import json

import pytest

from tests.gpu_worker.helpers import torch_threads


@pytest.mark.slow
def test_bench_worker_runs_and_reports(tmp_path_factory, capsys):
    from bench.worker import main
    from tests.fixtures.tiny_models import build_tiny_trained_pair

    with torch_threads(1):
        target_dir, draft_dir = build_tiny_trained_pair(tmp_path_factory.mktemp("tiny-trained"))
    # main() itself asserts that greedy output is identical across all modes.
    assert (
        main(
            [
                "--target-dir",
                str(target_dir),
                "--draft-dir",
                str(draft_dir),
                "--max-tokens",
                "24",
                "--splits",
                "heldout",
            ]
        )
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    result = json.loads(last[len("RESULT ") :])
    tpf = result["tokens_per_forward"]
    assert set(tpf) == {"no_spec", "draft", "draft+masks", "draft+forced", "draft+masks+forced"}
    assert tpf["no_spec"] == pytest.approx(1.0)
    assert all(v >= 1.0 for v in tpf.values())
    assert result["grammar_aware_vs_blind"] == pytest.approx(tpf["draft+masks+forced"] / tpf["draft"])
