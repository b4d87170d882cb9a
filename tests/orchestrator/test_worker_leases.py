"""The lease table of pooled workers (the plain class; the Ray actor runs the same methods one at a
time): one driver per worker, leases that lapse, draining, renewal after a lost registry."""

from __future__ import annotations

import time

import pytest

from specmask.orchestrator import worker_pool
from specmask.orchestrator.config import OrchestratorConfig
from specmask.orchestrator.worker_leases import WorkerLeases

W0, W1 = "specmask-worker-p-aaaaaaaaaaaa-0", "specmask-worker-p-aaaaaaaaaaaa-1"


def owners(leases: WorkerLeases) -> dict[str, str]:
    return {v.name: v.owner for v in leases.snapshot()}


def test_a_worker_has_one_driver() -> None:
    leases = WorkerLeases()
    assert leases.claim("a", [W0, W1], 30.0) == [W0, W1]
    assert leases.claim("b", [W0, W1], 30.0) == []
    assert leases.claim("a", [W0], 30.0) == [W0]  # its own: renewed
    leases.release("b", [W0])  # not b's to release
    assert owners(leases) == {W0: "a", W1: "a"}
    leases.release("a", [W0])
    assert leases.claim("b", [W0, W1], 30.0) == [W0]
    assert owners(leases) == {W0: "b", W1: "a"}


def test_a_lease_lapses_without_renewal_and_the_old_owner_learns_it_lost_it() -> None:
    leases = WorkerLeases()
    leases.claim("a", [W0], 0.05)
    time.sleep(0.1)
    assert owners(leases) == {W0: ""}
    assert leases.claim("b", [W0], 30.0) == [W0]
    assert leases.renew("a", [W0], 30.0) == [W0]  # a must stop driving it
    assert owners(leases) == {W0: "b"}


def test_renewal_rebuilds_an_empty_registry() -> None:
    leases = WorkerLeases()  # a restarted registry actor starts empty
    assert leases.renew("a", [W0, W1], 30.0) == []
    assert leases.claim("b", [W0, W1], 30.0) == []


def test_draining_is_visible_and_kept_through_renewals() -> None:
    leases = WorkerLeases()
    leases.claim("a", [W0], 30.0)
    leases.claim("b", [W1], 30.0)
    leases.drain("a")
    leases.renew("a", [W0], 30.0)
    views = {v.name: v for v in leases.snapshot()}
    assert views[W0].draining and views[W0].owner == "a"
    assert not views[W1].draining


def test_forget_drops_only_free_or_own_names() -> None:
    leases = WorkerLeases()
    leases.claim("a", [W0, W1], 30.0)
    leases.forget("b", [W0])
    leases.forget("a", [W1])
    assert owners(leases) == {W0: "a"}


def _config(**overrides: object) -> OrchestratorConfig:
    return OrchestratorConfig(target_dir="/models/t", mask_service_addresses=("m:1",), **overrides)  # type: ignore[arg-type]


def test_names_and_fingerprints() -> None:
    fp = worker_pool.config_fingerprint(_config())
    assert len(fp) == 12
    # What a worker is built with changes the fingerprint; what the orchestrator alone uses does not.
    assert worker_pool.config_fingerprint(_config(max_batch=7)) != fp
    assert worker_pool.config_fingerprint(_config(draft_dir="/models/d")) != fp
    assert worker_pool.config_fingerprint(_config(worker_num_gpus=0.5)) != fp
    assert worker_pool.config_fingerprint(_config(max_queue=3, port=1234)) == fp
    name = worker_pool.worker_name("sm-prod", fp, 3)
    assert worker_pool.parse_worker_name("sm-prod", name) == (fp, 3)
    assert worker_pool.parse_worker_name("sm", name) is None  # another pool's, even with a shared prefix
    assert worker_pool.parse_worker_name("sm-prod", "specmask-worker-sm-prod-x-1") is None


@pytest.mark.parametrize("pool", ["UPPER", "a_b", "-a", "a" * 41, "a b"])
def test_bad_pool_names_are_refused(pool: str) -> None:
    with pytest.raises(ValueError, match="worker_pool"):
        _config(worker_pool=pool)
