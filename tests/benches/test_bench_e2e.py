"""bench.e2e runs end to end (tiny pair, a few shipped schemas) and its RESULT line holds what the
README reports: every phase ran, nothing errored, and the per-round ratios are there."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.tiny_models import build_tiny_model_pair

# A bench run on a saturated shared box can take many times its idle time. The test's own
# timeout stays above the subprocess's, so a slow run reports its output instead of a kill.
BENCH_TIMEOUT_S = 1100
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BENCH_TIMEOUT_S + 100)]
REPO_ROOT = Path(__file__).resolve().parents[2]
PHASES = ("unconstrained", "constrained-nodraftmask", "constrained-nospec", "constrained-all-proposers")


def test_bench_e2e_smoke(tmp_path: Path) -> None:
    target, draft = build_tiny_model_pair(tmp_path / "pair")
    # Its own process: the benchmark starts (and stops) a local Ray of its own.
    cmd = [sys.executable, "-m", "bench.e2e", "--schemas", str(REPO_ROOT / "tests" / "data" / "maskbench"),
           "--n", "4", "--rounds", "2", "--max-tokens", "24", "--concurrency", "4",
           "--target", str(target), "--draft", str(draft),
           "--phases", ",".join(PHASES)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), proc.stdout[-2000:]
    result = json.loads(last.removeprefix("RESULT "))
    assert result["rounds"] == 2 and result["requests"] == 8
    assert result["errors"] == 0
    assert result["valid"] + result["truncated"] + result["refused"] == 8  # nothing invalid
    for key in ("constrained_vs_unconstrained_step_time", "spec_vs_nonspec_speedup"):
        assert len(result[f"{key}_rounds"]) == 2 and all(r and r > 0 for r in result[f"{key}_rounds"]), result
        assert result[key] == round(statistics.median(result[f"{key}_rounds"]), 3)
    same, compared = result["spec_nonspec_identical_outputs"]
    assert same == compared > 0, result  # greedy: speculation changes no token
    # Below 1 is possible: an iteration that only reads prompt chunks (the token budget) asks
    # for no mask.
    assert result["mask_round_trips_per_step"] > 0 and result["nospec_mask_round_trips_per_step"] > 0, result
    for phase in ("constrained", "unconstrained", "constrained-nodraftmask", "constrained-nospec"):
        assert phase in proc.stdout
    assert "constrained-all-proposers" in proc.stdout and result["all_proposers_tokens_per_target_forward"] > 0
    assert len(result["all_proposers_vs_nonspec_speedup_rounds"]) == 2
    # Conditional acceptance per draft position, from the server's counters: the tiny draft drafts.
    for key in ("acceptance_by_position", "all_proposers_acceptance_by_position"):
        assert result[key] and all(0.0 <= a <= 1.0 for a in result[key]), result
