"""Scrapers keep reading the same /metrics: every series the orchestrator exposed when its
metrics came to be split into groups (SpecMask's own, vLLM's names, acceptance by draft
position) is still there after a fixed workload, with the same HELP, TYPE, labels, buckets
and values, and the families in the same order.

tests/orchestrator/data/metrics_exposition.txt is that exposition, ``*_created`` lines left
out (they hold the time the series was made). A series may be added anywhere; one renamed,
relabelled, re-bucketed, re-documented or counting differently fails here.
``python -m tests.orchestrator.test_metrics_exposition`` prints today's, to compare by eye.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from prometheus_client import generate_latest

from specmask.gpu_worker.types import FinishReason, SessionWait, StepOutput
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.types import Usage

RECORD = Path(__file__).parent / "data" / "metrics_exposition.txt"
_CREATED = re.compile(r"^\S+_created[{ ]")


def exposition() -> str:
    """/metrics after a workload that touches every series (an odd model name included)."""
    m = OrchestratorMetrics(model_name="org/M ü")
    outs = [
        StepOutput("a", [1, 2, 3], drafts_proposed=4, drafts_accepted=2, target_forwards=1, mask_time_s=0.003),
        StepOutput("b", [1, 2, 3, 4], drafts_proposed=3, drafts_accepted=3, target_forwards=1),
        StepOutput(
            "c",
            [1],
            drafts_proposed=2,
            drafts_accepted=0,
            target_forwards=1,
            session_wait=SessionWait.JOINED_LATE,
            steps_sat_out=2,
        ),
    ]
    m.observe_step(0, 0.02, outs)
    m.observe_step(1, 0.5, outs[:1], running={"a"})
    m.observe_load(waiting=3, running=5, slots=8)
    m.observe_load(waiting=1, running=5, slots=8, kv_usage=0.7)
    m.observe_queued(0.3)
    m.observe_tokens_after_first(0.2, 4)
    m.observe_finish(FinishReason.STOP, Usage(prompt_tokens=3, completion_tokens=40), 0.0, 0.1, 2.0)
    m.observe_finish(FinishReason.LENGTH, Usage(prompt_tokens=5, completion_tokens=2), 0.0, None, 1.0)
    m.rejected.labels(code="INVALID_ARGUMENT").inc()
    m.http_requests.labels(route="/v1/x", status="200").inc()
    m.http_unknown_fields.labels(field="foo").inc()
    m.admission.observe(0.01)
    m.running.labels(worker="0").set(2)
    m.healthy_workers.set(2)
    m.worker_failures.labels(worker="1").inc()
    m.grammar_violations.labels(stage="device").inc()
    m.grammar_requests.labels(enforcement="exact").inc()
    m.checked_attempts.labels(outcome="passed").inc()
    m.requeued.inc()
    m.worker_recoveries.labels(worker="1").inc()
    m.worker_restarts.labels(worker="1").inc()
    text = generate_latest(m.registry).decode()
    return "".join(line for line in text.splitlines(keepends=True) if not _CREATED.match(line))


def families(text: str) -> dict[str, str]:
    """Family name -> its block (HELP, TYPE and samples), in the order the text lists them."""
    out: dict[str, str] = {}
    name = ""
    for line in text.splitlines(keepends=True):
        if line.startswith("# HELP "):
            name = line.split()[2]
            out[name] = ""
        assert name, f"a sample before any HELP line: {line!r}"
        out[name] += line
    return out


def test_every_recorded_series_is_exposed_alike_and_in_order() -> None:
    recorded = families(RECORD.read_text(encoding="utf-8"))
    now = families(exposition())
    missing = [name for name in recorded if name not in now]
    assert not missing, f"/metrics lost series dashboards and autoscalers may read: {missing}"
    changed = [name for name, block in recorded.items() if now[name] != block]
    assert not changed, "series exposed differently: " + "; ".join(f"{n}:\n{now[n]}" for n in changed)
    order = [name for name in now if name in recorded]
    assert order == list(recorded), "the recorded series are listed in another order"


def test_the_record_covers_every_group() -> None:
    """The workload reaches SpecMask's own series, vLLM's and the per-position ones alike:
    a group whose series the record lacked would be checked by nothing here."""
    recorded = families(RECORD.read_text(encoding="utf-8"))
    assert any(n.startswith("specmask_request") for n in recorded)
    assert any(n.startswith("vllm:") for n in recorded)
    assert "specmask_draft_position_reached_total" in recorded
    # Every family but the gauges with nothing set shows a sample beyond HELP and TYPE.
    empty = [n for n, block in recorded.items() if block.count("\n") <= 2]
    assert not empty, f"recorded with no sample: {empty}"


if __name__ == "__main__":
    sys.stdout.write(exposition())
