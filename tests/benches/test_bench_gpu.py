"""bench.gpu --dry-run runs the whole GPU-path harness at tiny shapes on CPU (real worker, real
mask-service subprocess, real kernels): every mode and batch size is measured, the scripted
acceptance holds (the bench itself checks that the target emitted exactly each document), and
a missing wheel is reported by name instead of an import error."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu

REPO_ROOT = Path(__file__).resolve().parents[2]
# A bench run on a saturated shared box can take many times its idle time. The test's own
# timeout stays above the subprocess's, so a slow run reports its output instead of a kill.
BENCH_TIMEOUT_S = 1100


@pytest.mark.slow
@pytest.mark.timeout(BENCH_TIMEOUT_S + 100)
def test_dry_run_measures_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "bench.gpu", "--dry-run", "--batches", "1,2", "--no-prime", "--json-out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    result = json.loads(last.removeprefix("RESULT "))
    assert result == json.loads(out.read_text())
    assert result["dry_run"] and result["device"] == "cpu"
    k = result["k"]
    pair = result["pairs"]["tiny"]
    assert set(pair["modes"]) == set(gpu.MODES)
    for name, by_batch in pair["modes"].items():
        for batch in (1, 2):
            stats = by_batch[str(batch)]
            assert stats["step_ms"] > 0 and stats["tokens_per_s"] > 0
            # Agreement 1.0: every draft accepted, so a spec step emits k + 1 tokens per sequence.
            per_seq = k + 1 if gpu.MODES[name].speculate else 1
            assert stats["tokens_per_step"] == batch * per_seq, (name, stats)
            assert stats["acceptance"] == (1.0 if gpu.MODES[name].speculate else None)
            # Every cell prints its memory-bandwidth floor and its multiple of it.
            assert stats["floor_ms"] > 0 and stats["vs_floor"] == pytest.approx(stats["step_ms"] / stats["floor_ms"])
            # The step's host time by phase: every phase timed, and every step runs a target
            # forward and verifies.
            phases = stats["phase_host_ms"]
            assert set(phases) == {*gpu.PHASES, "rest"}, phases
            assert phases["target forward"] > 0 and phases["verify"] > 0, phases
    assert pair["copy_gbps"] > 0 and pair["weights_bytes"]["target"] > pair["weights_bytes"]["draft"] > 0
    # The worker ran its decode and verify forwards on the static path (eager on a CPU: no graphs).
    for role in ("target", "draft"):
        static = pair["static_forward"][role]
        assert static["forwards"] > 0 and not static["graphs"] and static["captures"] == 0, static
    assert "x floor" in proc.stdout
    assert set(pair["constrained_vs_unconstrained_step_time"]) == {"1", "2"}
    assert [k["density"] for k in result["kernels_by_density"]] == list(gpu.KERNEL_DENSITIES)
    for kern in result["kernels_by_density"]:
        impls = kern["impls"]
        assert all("ms" in r for r in impls.values()), impls  # every implementation matched the reference
        # The store-only kernel moves the mask plus the disallowed logits: less than a
        # read-modify-write pass, and less still the more a row allows.
        assert 0 < kern["must_bytes"] < kern["read_modify_write_bytes"]
    dense_cell, sparse_cell = result["kernels_by_density"]
    assert dense_cell["must_bytes"] < sparse_cell["must_bytes"]
    assert "| spec/constrained/draft-masks-on |" in proc.stdout
    assert "Host ms per step by phase" in proc.stdout


def test_missing_wheels_are_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(gpu.REQUIRED_WHEELS, "specmask_no_such_module", "no-such-wheel==1.0")
    assert gpu.main(["--dry-run"]) == 2
    assert "no-such-wheel==1.0" in capsys.readouterr().out


def test_step_floor_counts_weights_once_and_draft_per_forward() -> None:
    target, draft = gpu.ModelBytes(weights=1000, kv_per_token=10), gpu.ModelBytes(weights=100, kv_per_token=1)
    no_spec = gpu.step_floor_bytes(target, draft, batch=4, context=50, draft_forwards=0)
    assert no_spec == 1000 + 4 * 50 * 10
    spec = gpu.step_floor_bytes(target, draft, batch=4, context=50, draft_forwards=3)
    assert spec == no_spec + 3 * (100 + 4 * 50 * 1)


@pytest.mark.parametrize(
    ("argv", "k", "defaulted"),
    [
        (["--dry-run"], 2, True),  # tiny shapes default to k = 2 ...
        (["--dry-run", "--k", "4"], 4, False),  # ... but an explicit --k is kept, 4 included
        (["--dry-run", "--k", "3"], 3, False),
        ([], 4, True),
        (["--k", "2"], 2, False),
    ],
)
def test_k_is_the_requested_one(argv: list[str], k: int, defaulted: bool) -> None:
    args = gpu.build_parser().parse_args(argv)
    gpu.apply_defaults(args)
    assert (args.k, args.k_defaulted) == (k, defaulted)


@pytest.mark.slow
@pytest.mark.timeout(BENCH_TIMEOUT_S + 100)
def test_agreement_sweep_decodes_plainly_where_drafts_do_not_pay(tmp_path: Path) -> None:
    """With the draft scripted to agree nowhere, the speculation gate (gpu_worker.speculation_gate)
    turns drafting off after the cells' warm-up: the speculative cells' timed steps draft only
    for its probes. Every ratio is reported as measured and steady; on a shared CPU their values
    are the host's noise as much as the step's, so the drafting share is what is checked."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "bench.gpu", "--dry-run", "--batches", "2", "--no-prime", "--no-kernels",
           "--no-host-counts", "--agreement", "1.0,0.0", "--warmup", "40", "--steps", "40",
           "--json-out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    pair = json.loads(out.read_text())["pairs"]["tiny"]
    for by_agreement in (pair["spec_vs_nospec_tokens_per_s_by_agreement"], pair["spec_vs_nospec_steady_by_agreement"]):
        assert set(by_agreement) == {"1.0", "0.0"}
        assert all(v > 0 for by_mode in by_agreement.values() for by_b in by_mode.values() for v in by_b.values())
    drafting = re.findall(r"agreement 0\.0: (\S+) spec/no-spec .*?(\d+)% of steps drafting", proc.stdout)
    assert {mode for mode, _ in drafting} == set(gpu.SPEC_BASELINE), proc.stdout[-3000:]
    for mode, share in drafting:
        # Probes (one step in 16 at most once settled), and the odd probe a busy host misjudged.
        assert int(share) <= 25, (mode, share)
