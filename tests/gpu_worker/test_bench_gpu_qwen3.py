"""bench.gpu's Qwen3 pair, at CPU sizes: the Qwen3 architecture on the worker's static path,
the real Qwen3 tokenizer with the models' padded vocabulary (151,669 tokens, 151,936 logits),
the mask service's grammars over it, and the bench's own check that the target emitted
exactly each scripted document."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_QWEN3 = REPO_ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3"
BENCH_TIMEOUT_S = 1100  # a saturated shared box runs many times slower than an idle one


def test_qwen3_pair_shapes() -> None:
    assert gpu.PAIRS["qwen3-8b-0.6b"] == gpu.Pair("qwen3-8b", "qwen3-0.6b", "qwen3")
    for shape in ("qwen3-8b", "qwen3-0.6b", "tiny-qwen3", "tiny-qwen3-draft"):
        assert gpu.SHAPE_TYPES[shape] == "qwen3" and gpu.SHAPES[shape]["vocab_size"] == 151936
    # Qwen3-0.6B: head_dim 128 is not hidden / heads (1024 / 16 = 64).
    small = gpu.SHAPES["qwen3-0.6b"]
    assert small["head_dim"] * small["num_attention_heads"] != small["hidden_size"]


@pytest.mark.slow
@pytest.mark.timeout(BENCH_TIMEOUT_S + 100)
@pytest.mark.skipif(
    not (SHARED_QWEN3 / "tokenizer.json").is_file()
    and not (gpu.TOKENIZER_CACHE / "qwen3" / "tokenizer.json").is_file(),
    reason="the Qwen3 tokenizer is in neither ../shared/data nor bench/.tokenizers",
)
def test_dry_run_of_the_qwen3_pair(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    modes = "nospec/constrained,spec/constrained/draft-masks-on"
    cmd = [sys.executable, "-m", "bench.gpu", "--dry-run", "--pairs", "tiny-qwen3", "--batches", "2"]
    cmd += ["--modes", modes, "--no-prime", "--no-kernels", "--json-out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    pair = result["pairs"]["tiny-qwen3"]
    assert pair["tokenizer"] == "qwen3" and pair["vocab"] == 151936
    k = result["k"]
    assert pair["modes"]["nospec/constrained"]["2"]["tokens_per_step"] == 2
    assert pair["modes"]["spec/constrained/draft-masks-on"]["2"]["tokens_per_step"] == 2 * (k + 1)
    for role in ("target", "draft"):
        assert pair["static_forward"][role]["forwards"] > 0, pair["static_forward"]
