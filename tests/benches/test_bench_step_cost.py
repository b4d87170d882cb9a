"""bench.step_cost on the tiny random pair: a constrained run and its grammar-free replay take
the same steps, batches and tokens (the bench itself raises if they diverge), and RESULT
carries the step-time ratio, the mask wait and round trips per step."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("proposers", ["grammar_forced,ngram", "draft_model,grammar_forced"])
def test_step_cost_replays_the_constrained_run(tmp_path_factory, capsys, proposers: str) -> None:
    from bench.step_cost import main
    from tests.fixtures.tiny_models import build_tiny_model_pair
    from tests.gpu_worker.helpers import torch_threads

    with torch_threads(1):
        target, draft = build_tiny_model_pair(tmp_path_factory.mktemp("tiny-pair"), max_position_embeddings=256)
    argv = ["--target", str(target), "--proposers", proposers, "--n", "3", "--max-tokens", "12", "--rounds", "2"]
    if "draft_model" in proposers:
        argv += ["--draft", str(draft)]
    from specmask.gpu_worker.proposers.registry import registered_names

    before = registered_names()
    assert main(argv) == 0
    assert registered_names() == before  # its replay proposer does not outlive the run
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last.removeprefix("RESULT "))
    assert len(result["constrained_vs_unconstrained_step_time_rounds"]) == 2
    assert result["constrained_vs_unconstrained_step_time"] > 0
    assert result["spec_nonspec_identical_outputs"] == [3, 3]  # greedy: speculation changes no token
    assert result["mask_round_trips_per_step"] > 0 and result["tokens_per_target_forward"] >= 1.0
    if "draft_model" in proposers:
        assert result["draft_forwards_per_run"] > 0  # replayed with the same count (checked by the bench)
