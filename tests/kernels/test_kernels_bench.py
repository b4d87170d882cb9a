"""`python -m bench.kernels --quick` runs on CPU and ends with a parseable RESULT line."""

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_runs():
    result = subprocess.run(
        [sys.executable, "-m", "bench.kernels", "--quick", "--device", "cpu", "--reps", "1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    payload = json.loads(last[len("RESULT ") :])
    ops = {(row["op"], row["impl"]) for row in payload["rows"]}
    assert {
        ("apply_bitmask", "reference"),
        ("apply_bitmask", "xgrammar"),
        ("rejection_sample", "reference"),
        ("sample_draft", "reference"),
    } <= ops
