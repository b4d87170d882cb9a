"""Local mask-service children: spawned with no Python between fork and exec, and gone with their parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specmask.common.parent_watch import PARENT_PID_ENV
from specmask.orchestrator.dev.local_stack import MaskServiceProcess
from tests.fixtures.procs import exited

# Set by the test below: where a fork-time hook in this process leaves its mark.
_FORK_MARKERS: list[str] = []


def _mark_fork_in_child() -> None:
    for path in _FORK_MARKERS:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


os.register_at_fork(after_in_child=_mark_fork_in_child)


def test_spawn_runs_no_python_in_the_forked_child(tmp_path: Path) -> None:
    """With preexec_fn, Python's (and gRPC's) fork handlers run in the child before exec;
    gRPC's could abort there and leave an alarm that killed the started service (CI, SIGALRM)."""
    marker = tmp_path / "forked"
    _FORK_MARKERS.append(str(marker))
    proc = MaskServiceProcess([str(tmp_path / "no-such-tokenizer")])
    try:
        proc.start(wait=False)
        assert proc.process is not None
        proc.process.wait(60)
    finally:
        _FORK_MARKERS.clear()
        proc.stop()
    assert not marker.exists(), "Python fork handlers ran in the spawned child"


def test_child_refuses_to_start_when_its_parent_is_already_gone() -> None:
    code = "from specmask.common.parent_watch import die_with_parent_from_env as f; f(); print('started')"
    env = {**os.environ, PARENT_PID_ENV: "1"}  # not our parent: it is "gone"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "started" not in out.stdout
    assert "parent process 1 is gone" in out.stderr


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_mask_service_exits_when_its_parent_is_killed(bpe_dir: Path) -> None:
    parent_code = (
        "import sys, time\n"
        "from specmask.orchestrator.dev.local_stack import MaskServiceProcess\n"
        "p = MaskServiceProcess([sys.argv[1]]).start()\n"
        "print(p.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code, f"{bpe_dir}:640"], stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())  # printed once the child serves
        assert not exited(child_pid)
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 30
        while not exited(child_pid):
            assert time.monotonic() < deadline, "the mask service outlived its parent"
            time.sleep(0.2)
    finally:
        if parent.poll() is None:
            parent.kill()
        if child_pid is not None and not exited(child_pid):
            os.kill(child_pid, signal.SIGKILL)
