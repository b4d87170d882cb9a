"""`specmask up` restarts a crashed mask replica, and leaves a stopped one down.
A real `specmask mask-service` process on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest

from specmask.orchestrator.dev.local_stack import MaskServiceProcess, health_status
from specmask.orchestrator.dev.replica_supervisor import ReplicaSupervisor
from tests.fixtures.tokenizers import build_bpe_tokenizer

SERVING = 1


@pytest.mark.slow
def test_crashed_replica_is_restarted_stopped_one_is_not(tmp_path: Path) -> None:
    tok = build_bpe_tokenizer(tmp_path / "bpe")
    replica = MaskServiceProcess([str(tok)], extra_args=["--compile-workers", "0"]).start()
    try:
        supervisor = ReplicaSupervisor([replica])
        assert supervisor.check_once() == 0  # healthy: nothing to do
        replica.kill()  # SIGKILL: a crash
        assert supervisor.check_once() == 1
        replica.wait_serving()
        assert health_status(replica.address) == SERVING
        replica.stop()  # on purpose: stays down
        assert supervisor.check_once() == 0
        assert not replica.running
    finally:
        replica.stop()
