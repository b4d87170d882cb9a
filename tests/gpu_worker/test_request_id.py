"""The orchestrator's request id follows a sequence into the worker's and the mask service's logs."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams
from tests.gpu_worker.helpers import run_to_completion

GRAMMAR = GrammarSpec(GrammarKind.REGEX, "[a-z]{1,8}")


def _messages(caplog: pytest.LogCaptureFixture, logger_prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(logger_prefix)]


def test_request_id_reaches_worker_and_mask_service_logs(make_worker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specmask.gpu_worker")
    caplog.set_level(logging.INFO, logger="specmask.mask_service")
    worker = make_worker()
    seq = NewSequence(
        "seq-7", (5, 6), GRAMMAR, SamplingParams(max_tokens=4), SpeculationParams(k=2), request_id="req-follow-me"
    )
    assert worker.add([seq]) == [None]
    run_to_completion(worker)
    worker.shutdown()  # drains the fire-and-forget session close

    tag = "[request_id=req-follow-me] "
    worker_lines = _messages(caplog, "specmask.gpu_worker")
    assert any(m.startswith(tag + "seq seq-7 added") for m in worker_lines), worker_lines
    assert any(m.startswith(tag + "seq seq-7 finished") for m in worker_lines), worker_lines
    service_lines = _messages(caplog, "specmask.mask_service")
    opened = [m for m in service_lines if " opened " in m and m.startswith(tag)]
    closed = [m for m in service_lines if " closed " in m and m.startswith(tag)]
    assert len(opened) == 1 and len(closed) == 1, service_lines


def test_sequence_without_request_id_is_logged_under_its_seq_id(make_worker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specmask.gpu_worker")
    worker = make_worker()
    seq = NewSequence("plain-1", (5, 6), None, SamplingParams(max_tokens=2), SpeculationParams(k=0))
    assert worker.add([seq]) == [None]
    worker.remove(["plain-1"])
    lines = _messages(caplog, "specmask.gpu_worker")
    assert any(m.startswith("[request_id=plain-1] seq plain-1 cancelled") for m in lines), lines


def test_worker_process_with_log_level_emits_request_id_lines(tiny_pair) -> None:
    """A fresh process, like a Ray actor's (root logger at WARNING, no handler): WorkerConfig.log_level
    makes the worker's INFO lines, with their request ids, reach its stderr."""
    script = textwrap.dedent(
        f"""
        from specmask.gpu_worker.actor import GpuWorker
        from specmask.gpu_worker.config import WorkerConfig
        from specmask.gpu_worker.types import NewSequence, SamplingParams, SpeculationParams

        w = GpuWorker(WorkerConfig(target_dir={str(tiny_pair[0])!r}, device="cpu", torch_threads=1, log_level="INFO"))
        seq = NewSequence("s1", (5, 6), None, SamplingParams(max_tokens=2), SpeculationParams(k=0), request_id="rid-9")
        assert w.add([seq]) == [None]
        w.remove(["s1"])
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[request_id=rid-9] seq s1 added" in proc.stderr, proc.stderr[-2000:]
    assert "[request_id=rid-9] seq s1 cancelled" in proc.stderr, proc.stderr[-2000:]
