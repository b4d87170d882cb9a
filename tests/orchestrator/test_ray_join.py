"""Joining a Ray cluster that is still starting: connection failures are tried again, with
back-off, for the configured window; the last failure is raised once it is spent, and an
error that no wait can cure (a malformed address) at once."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.worker_pool import retry_ray_join


class Head:
    """The join attempt, as a head that is still starting answers it: ``refusals`` failures, then a join."""

    def __init__(self, refusals: int, error: type[Exception] = ConnectionError) -> None:
        self.refusals = refusals
        self.error = error
        self.tries = 0

    def join(self) -> None:
        self.tries += 1
        if self.tries <= self.refusals:
            raise self.error("ray client connection timeout")


def test_a_head_that_starts_late_is_joined(caplog: pytest.LogCaptureFixture) -> None:
    head = Head(refusals=3)
    with caplog.at_level(logging.WARNING):
        retry_ray_join(head.join, "ray://head:10001", 60.0, first_wait_s=0.01, max_wait_s=0.02)
    assert head.tries == 4
    retries = [r for r in caplog.records if "cannot join the Ray cluster at ray://head:10001 yet" in r.getMessage()]
    assert len(retries) == 3  # each retry is logged, with the address and the reason
    assert "ray client connection timeout" in retries[0].getMessage()
    assert any("after 4 tries" in r.getMessage() for r in caplog.records)


def test_timeouts_are_retried_too() -> None:
    head = Head(refusals=2, error=TimeoutError)
    retry_ray_join(head.join, "ray://head:10001", 60.0, first_wait_s=0.01)
    assert head.tries == 3


def test_the_last_failure_is_raised_once_the_window_is_spent() -> None:
    head = Head(refusals=10**9)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="connection timeout"):
        retry_ray_join(head.join, "ray://head:10001", 0.3, first_wait_s=0.05, max_wait_s=0.1)
    assert time.monotonic() - start >= 0.2  # it did wait (no upper bound: the box may be busy)
    assert 2 <= head.tries < 10


def test_a_zero_window_tries_once() -> None:
    head = Head(refusals=1)
    with pytest.raises(ConnectionError):
        retry_ray_join(head.join, "ray://head:10001", 0.0, first_wait_s=0.01)
    assert head.tries == 1


def test_a_malformed_address_is_not_retried() -> None:
    head = Head(refusals=1, error=ValueError)
    with pytest.raises(ValueError):
        retry_ray_join(head.join, "nonsense", 60.0, first_wait_s=0.01)
    assert head.tries == 1


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_the_join_window_must_be_a_finite_non_negative_time(value: float) -> None:
    with pytest.raises(ValueError, match="ray_join_timeout_s"):
        OrchestratorConfig(target_dir="t", mask_service_addresses=("a:1",), ray_join_timeout_s=value)


_REAL_JOIN = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
from specmask.orchestrator.worker_pool import connect_ray
try:
    connect_ray(sys.argv[1], join_timeout_s=float(sys.argv[2]))
except ConnectionError as exc:
    print("GAVE UP:", exc)
"""


@pytest.mark.slow
def test_a_real_ray_client_is_retried_then_gives_up() -> None:
    """Real Ray client, nothing listening: each try fails as a head that is not up yet makes
    it fail, the next try starts clean (Ray's client state is reset), and the window ends it."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        # Ray's own client attempts: 1 s each, so the test takes seconds, not minutes.
        "RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "1",
        "RAY_CLIENT_MAX_CONNECTION_TIMEOUT_S": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    address = f"ray://127.0.0.1:{port}"
    proc = subprocess.run(
        [sys.executable, "-c", _REAL_JOIN, address, "20"], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    retries = [line for line in proc.stdout.splitlines() if f"cannot join the Ray cluster at {address} yet" in line]
    assert retries, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "try 1: ray client connection timeout" in retries[0]
    assert proc.stdout.rstrip().endswith("GAVE UP: ray client connection timeout"), proc.stdout[-2000:]
