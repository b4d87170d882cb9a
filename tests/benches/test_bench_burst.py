"""bench.burst, short: a steady stream beside a small burst of long prompts on the tiny pair."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# A bench run on a saturated shared box can take many times its idle time. The test's own
# timeout stays above the subprocess's, so a slow run reports its output instead of a kill.
BENCH_TIMEOUT_S = 1100
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BENCH_TIMEOUT_S + 100)]
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_burst_short() -> None:
    # Its own process: the benchmark starts (and stops) a local Ray of its own.
    cmd = [sys.executable, "-m", "bench.burst", "--burst", "4", "--prompt-tokens", "800",
           "--warmup-s", "2", "--baseline-s", "5", "--stream-max-tokens", "32"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT "), proc.stdout[-2000:]
    assert any(line.startswith("phase") for line in lines)  # the table
    r = json.loads(lines[-1].removeprefix("RESULT "))
    assert r["burst_errors"] == 0 and r["steady_errors"] == 0 and r["worker_failures"] == 0, r
    assert r["itl_baseline_n"] > 0 and r["itl_burst_n"] > 0, r
    # The worst gaps: at most five, longest first, the longest no shorter than the p99.
    worst = r["itl_burst_worst"]
    assert 0 < len(worst) <= 5 and [g for _, g in worst] == sorted((g for _, g in worst), reverse=True), worst
    assert worst[0][1] >= r["itl_burst_p99_ms"] and all(0 <= at <= r["burst_s"] + 1 for at, _ in worst), r
