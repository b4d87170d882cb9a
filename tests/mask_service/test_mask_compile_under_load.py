"""Compiles make progress on a saturated box, and the "too complex" budget still holds there.

CPU hogs (real busy-loop processes, one per core plus one) saturate every core while a real
mask service compiles new grammars in its real compile workers, over real gRPC on 127.0.0.1.
Under the idle scheduling class the workers got no CPU at all beside the hogs and every
compile ended "still compiling, retry"; at a plain nice they get a guaranteed share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError
from specmask.mask_service.grammar.limits import GrammarLimits
from specmask.mask_service.server.compile_pool import DEFAULT_WORKER_NICE
from specmask.mask_service.server.server import MaskServiceHandle, build_service
from specmask.mask_service.server.tokenizers import TokenizerRegistry
from tests.mask_service.service_config import make_config

BUDGET_S = 1.0  # CPU seconds: the schemas below need a small fraction of it
NEW_SCHEMAS = [
    {"type": "string", "format": "date-time"},
    {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    },
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}, "n": {"type": "number"}}},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": {"type": "string"}}}}},
    {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^[a-z]{3}$"}]},
]
HUGE = GrammarSpec(
    GrammarKind.JSON_SCHEMA,
    json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}),
)


@pytest.fixture
def hogs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Busy loops at the default priority, one per core plus one: every core stays runnable."""
    count = (os.cpu_count() or 1) + 1
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)


@pytest.fixture
def loaded_service(bpe_dir: Path, registry: TokenizerRegistry) -> Iterator[MaskServiceHandle]:
    # The service's own priority defaults (no compile_nice / compile_sched_idle override).
    cfg = make_config(
        bpe_dir,
        compile_timeout_s=BUDGET_S,
        compile_workers=2,
        grammar_limits=GrammarLimits(max_schema_bytes=10**7, max_properties=10**6),
    )
    handle = build_service(cfg, registry)
    handle.server.start()
    assert handle._parts[0].pool.wait_ready(300.0)
    yield handle
    handle.stop(grace_s=0)


def test_compile_workers_run_niced_not_idle(loaded_service: MaskServiceHandle) -> None:
    (pid,) = loaded_service._parts[0].pool.worker_pids()[:1]
    assert os.getpriority(os.PRIO_PROCESS, pid) == DEFAULT_WORKER_NICE
    if hasattr(os, "SCHED_IDLE"):
        assert os.sched_getscheduler(pid) != os.SCHED_IDLE


def test_new_schemas_compile_beside_cpu_hogs(
    loaded_service: MaskServiceHandle, hogs: list[subprocess.Popen[bytes]], bpe_id: str
) -> None:
    """Every valid schema compiles while every core is busy: the callers wait for their compiles
    (no "still compiling, retry"), and a schema over the CPU budget is still refused as too complex."""
    assert all(p.poll() is None for p in hogs)
    address = f"127.0.0.1:{loaded_service.port}"

    def validate(schema: dict[str, object]) -> int:
        with MaskServiceClient(address, deadline_s=5.0, max_retries=0) as c:
            spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
            return int(c.validate_grammar(bpe_id, spec).compiled_bytes)

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(NEW_SCHEMAS)) as ex:
        sizes = list(ex.map(validate, NEW_SCHEMAS))
    took = time.monotonic() - t0
    assert all(size > 0 for size in sizes), sizes
    assert took < 120.0, took

    with MaskServiceClient(address, deadline_s=5.0, max_retries=0) as c:
        # Sessions too: the open waits for its grammar's compile.
        spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "string", "format": "email"}))
        assert c.open_session(bpe_id, spec)
        with pytest.raises(MaskServiceError) as info:
            c.validate_grammar(bpe_id, HUGE)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert "too complex" in info.value.message
    assert all(p.poll() is None for p in hogs), "the hogs ran throughout"
