"""A replica honours SIGTERM while a hostile grammar compiles (it used to ignore it):
it exits promptly and takes its compile workers with it. A real `specmask mask-service` process."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.mask_service.client.mask_client import MaskServiceClient, MaskServiceError
from specmask.orchestrator.dev.local_stack import MaskServiceProcess

HUGE = GrammarSpec(
    GrammarKind.JSON_SCHEMA,
    json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}),
)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[-1].split()[1] == str(pid):
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie left for the reaper does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_sigterm_while_compiling(bpe_dir: Path) -> None:
    # Limits raised and a long budget: the compile would run for minutes.
    args = ["--max-schema-properties", "100000", "--max-schema-bytes", "10000000", "--compile-timeout-s", "600"]
    replica = MaskServiceProcess([str(bpe_dir)], extra_args=args).start()
    try:
        assert replica.process is not None
        errors: list[MaskServiceError] = []

        def compile_huge() -> None:
            with MaskServiceClient(replica.address, deadline_s=120.0, max_retries=0) as c:
                try:
                    c.validate_grammar(tokenizer_id_for_path(bpe_dir), HUGE)
                except MaskServiceError as exc:
                    errors.append(exc)

        t = threading.Thread(target=compile_huge)
        t.start()
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while not workers:  # wait until a compile worker runs
            workers = _children(replica.process.pid)
            assert time.monotonic() < deadline, "no compile worker started"
            time.sleep(0.2)
        time.sleep(1.0)  # the compile is under way
        t0 = time.monotonic()
        replica.process.send_signal(signal.SIGTERM)
        replica.process.wait(timeout=30)
        took = time.monotonic() - t0
        t.join(30)
        assert replica.process.returncode == 0
        assert took < 10.0, took  # the 5 s drain at most, not the compile's minutes
        assert errors and "shutting down" in errors[0].message, errors
        time.sleep(0.5)
        assert not [p for p in workers if _alive(p)], workers  # killed with the replica
    finally:
        replica.stop()
