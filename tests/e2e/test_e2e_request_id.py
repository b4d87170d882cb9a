"""One request followed through all three processes' logs by its request id."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from specmask.orchestrator.client import OrchestratorClient, build_request
from tests.e2e.stack import BOUNDED_SCHEMA, PROMPT, ThreadStack

pytestmark = pytest.mark.slow

RID = "e2e-follow-request-7"
TAG = f"[request_id={RID}] "


def _worker_log_text() -> str:
    """Everything the Ray worker processes wrote (Ray keeps one .err/.out file per worker)."""
    from ray._private.worker import _global_node  # the logs dir has no public accessor

    logs = Path(_global_node.get_logs_dir_path())
    return "".join(p.read_text(errors="replace") for p in logs.glob("worker-*") if p.suffix in (".err", ".out"))


def _wait_for(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_request_id_in_orchestrator_worker_and_mask_service_logs(
    stack: ThreadStack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specmask.orchestrator")
    with OrchestratorClient(stack.address) as c:
        result = c.generate(build_request(PROMPT, schema=BOUNDED_SCHEMA, max_tokens=64, request_id=RID))
    assert result.request_id == RID

    assert any(r.getMessage().startswith(TAG) for r in caplog.records if r.name.startswith("specmask.orchestrator"))

    def worker_lines() -> list[str]:
        return [line for line in _worker_log_text().splitlines() if TAG in line]

    assert _wait_for(lambda: any("added" in line for line in worker_lines())), "no worker line names the request"
    assert _wait_for(lambda: any("finished" in line for line in worker_lines())), worker_lines()

    assert stack.running is not None

    def service_lines() -> list[str]:
        tails = (p.log_tail(2_000_000) for p in stack.running.mask_services)  # type: ignore[union-attr]  # the stack is running
        return [line for tail in tails for line in tail.splitlines() if TAG in line]

    assert _wait_for(lambda: any(" closed " in line for line in service_lines())), service_lines()
    assert any(" opened " in line for line in service_lines()), service_lines()
