#!/usr/bin/env bash
# One lent-GPU session, in priority order, each stage under its own time limit so that a
# stage that hangs still leaves the later ones (and the logs) their time:
#   1. the CUDA tests (the worker on CUDA, CUDA graphs and compiled Triton included, equal
#      to plain constrained greedy decoding on the CPU reference; every architecture's CUDA
#      graphs equal to transformers' eager forward),
#   2. "cells": bench.gpu over every cell the goals are set at, B = 1, 8, 32, 64 at draft
#      agreement 1.0 and 0.7 (spec/no-spec tokens/s for each), plus the host-path counts
#      (reads and torch ops per step at B = 8 and 64, gpu_worker.host_counter); the tests and
#      this stage stay within 7 minutes of device time, leaving room to rerun after a fix,
#   3. the Qwen3-8B + 0.6B pair at B = 32,
#   and, opt-in: "b32" (3 rounds at B = 32, kernels included), "rest" (B = 1, 8, 64),
#   "prof" (a torch.profiler pass at B=32: op tables by host and by device time), "kernels"
#   (bench.kernels' full grid: Triton against the reference and xgrammar).
# STAGES picks and orders them (default "tests cells qwen3"). `bash -n` checks the syntax.
# Logs and RESULT json go to $OUT (the device tool's folder; /tmp/specmask-gpu otherwise).
#
# The device machine has no network: Python packages its image lacks travel as wheels in
# .whl/ (git-ignored), see bench/gpu.py REQUIRED_WHEELS; the Llama-3 and Qwen3 tokenizers
# travel in bench/.tokenizers/{llama3,qwen3} (carried: `python -m bench.gpu --dry-run --pairs
# tiny-qwen3` fills qwen3/ from ../shared/data, `make bench-gpu` llama3/).
#
#   bench/gpu_session.sh [TEST_S BENCH_MAIN_S BENCH_REST_S]
set -uo pipefail
OUT=${OUT:-/tmp/specmask-gpu}
mkdir -p "$OUT"
TEST_S=${1:-120}
BENCH_MAIN_S=${2:-300}
BENCH_REST_S=${3:-150}
export PYTHONUNBUFFERED=1

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"

stage() {  # stage NAME SECONDS CMD...: run CMD under a limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T), limit ${limit}s): $*"
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc ($(date +%T))"
    tail -n 4 "$OUT/$name.log"
    return $rc
}

for s in ${STAGES:-tests cells qwen3}; do
    case $s in
    tests)
        stage cuda-tests "$TEST_S" python3 -m pytest -q -p no:cacheprovider tests/gpu_worker/test_gpu.py \
            tests/gpu_worker/test_architectures.py::test_cuda_graphs_match_transformers_eager
        ;;
    cells)
        # One round of 6 timed steps per cell: 4 batch sizes x 5 modes x 2 agreements in the limit.
        stage bench-cells "$BENCH_MAIN_S" python3 -m bench.gpu --pairs llama3-8b-1b --batches 1,8,32,64 \
            --agreement 1.0,0.7 --rounds 1 --warmup 2 --steps 6 --no-kernels --host-counts \
            --json-out "$OUT/bench-cells.json"
        ;;
    b32)
        stage bench-b32 "$BENCH_MAIN_S" python3 -m bench.gpu --pairs llama3-8b-1b --batches 32 --rounds 3 \
            --json-out "$OUT/bench-b32.json" \
            || stage bench-b32-eager "$BENCH_MAIN_S" python3 -m bench.gpu --pairs llama3-8b-1b --batches 32 \
                --rounds 2 --no-kernels --static-forward off --json-out "$OUT/bench-b32-eager.json"
        ;;
    qwen3)
        stage bench-qwen3 "$BENCH_REST_S" python3 -m bench.gpu --pairs qwen3-8b-0.6b --batches 32 --rounds 2 \
            --no-kernels --json-out "$OUT/bench-qwen3.json"
        ;;
    rest)
        stage bench-rest "$BENCH_REST_S" python3 -m bench.gpu --pairs llama3-8b-1b --batches 1,8,64 --no-kernels \
            --json-out "$OUT/bench-rest.json"
        ;;
    prof)
        stage bench-prof "$BENCH_REST_S" python3 -m bench.gpu --pairs llama3-8b-1b --batches 32 --rounds 1 \
            --no-kernels --profile-batch 32 --log-dir /tmp/specmask-gpu-prof
        ;;
    kernels) stage bench-kernels "$BENCH_REST_S" python3 -m bench.kernels ;;
    esac
done
grep -h -A12 "^### Worker step" "$OUT"/bench-*.log | head -60
exit 0
