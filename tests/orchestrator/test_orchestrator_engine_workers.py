"""Adding and retiring workers at run time (Engine.add_worker / retire_worker, carried out by
supervision.WorkerSupervisor), on a real engine with a real validator and mask service.

No request is placed, so no worker is ever called: the actors here are opaque handles, which is
all the engine keeps of them on these paths."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.gpu_worker.types import WorkerInfo
from specmask.orchestrator.engine import Engine, EngineConfig, WorkerSlot
from specmask.orchestrator.grammar_check import MaskServiceGrammarChecker
from specmask.orchestrator.metrics import OrchestratorMetrics
from specmask.orchestrator.validation import RequestValidator, ServingDefaults


@pytest.fixture(scope="module")
def info(bpe_dir, bpe_tokenizer) -> WorkerInfo:
    return WorkerInfo(
        vocab_size=bpe_tokenizer.get_vocab_size(),
        max_model_len=64,
        tokenizer_id=tokenizer_id_for_path(bpe_dir),
        eos_token_ids=(0,),
        device="cpu",
        has_draft_model=False,
        max_k=4,
    )


@pytest.fixture(scope="module")
def validator(bpe_tokenizer, info, mask_service_address):
    checker = MaskServiceGrammarChecker(
        (mask_service_address,),
        tokenizer_id=info.tokenizer_id,
        vocab_size=info.vocab_size,
        deadline_s=10.0,
        max_retries=1,
    )
    yield RequestValidator(bpe_tokenizer, info, checker, ServingDefaults(max_tokens=16, k=2))
    checker.close()


def _engine(validator, tokenizer, info, n: int, **config) -> tuple[Engine, OrchestratorMetrics]:
    slots = [WorkerSlot(index=i, actor=f"actor-{i}", info=info, capacity=4) for i in range(n)]
    metrics = OrchestratorMetrics(CollectorRegistry())
    cfg = EngineConfig(max_queue=8, step_timeout_s=5.0, validation_threads=1, **config)
    return Engine(slots, validator, tokenizer, cfg, metrics), metrics


def _healthy_gauge(metrics: OrchestratorMetrics) -> float | None:
    return metrics.registry.get_sample_value("specmask_healthy_workers")


def test_workers_are_added_and_retired_but_never_the_last(validator, bpe_tokenizer, info) -> None:
    async def go() -> None:
        engine, metrics = _engine(validator, bpe_tokenizer, info, 2)
        engine.start()
        added = engine.add_worker("actor-new", info, 4)
        assert added.index == 2 and engine.worker_health() == [True, True, True]
        assert _healthy_gauge(metrics) == 3
        other_model = dataclasses.replace(info, vocab_size=info.vocab_size + 1)
        with pytest.raises(ValueError, match="different model"):
            engine.add_worker("actor-other", other_model, 4)
        assert len(engine.worker_actors()) == 3  # the refused one never joined
        retired = [await engine.retire_worker(), await engine.retire_worker()]
        assert sorted(retired) == ["actor-0", "actor-1"]  # all idle: the oldest go first
        assert engine.worker_actors() == ["actor-new"] and _healthy_gauge(metrics) == 1
        assert await engine.retire_worker() is None  # the last worker in placement stays
        assert engine.add_worker("actor-later", info, 4).index == 3  # indices are never reused
        await engine.stop()

    asyncio.run(go())


def test_concurrent_retirements_leave_one_worker(validator, bpe_tokenizer, info) -> None:
    async def go() -> None:
        engine, _ = _engine(validator, bpe_tokenizer, info, 3)
        engine.start()
        got = await asyncio.gather(*(engine.retire_worker() for _ in range(5)))
        assert sum(actor is not None for actor in got) == 2 and engine.worker_health() == [True]
        await engine.stop()

    asyncio.run(go())


def test_a_worker_added_while_none_is_healthy_ends_the_outage(validator, bpe_tokenizer, info) -> None:
    async def go() -> None:
        engine, metrics = _engine(validator, bpe_tokenizer, info, 1, recovery_wait_s=60.0)
        health: list[bool] = []
        engine.set_health_listener(health.append)
        engine.start()
        (lost,) = engine._slots
        engine._on_worker_failure(lost, RuntimeError("injected: worker lost"))
        assert not engine.healthy and engine.recovering and health == [False]
        engine.add_worker("actor-new", info, 4)
        assert engine.healthy and not engine.recovering and health == [False, True]
        assert engine.worker_health() == [False, True] and _healthy_gauge(metrics) == 1
        await engine.stop()  # also ends the lost worker's recovery

    asyncio.run(go())


def test_a_retiring_worker_that_is_lost_is_not_recovered(validator, bpe_tokenizer, info) -> None:
    async def go() -> None:
        engine, _ = _engine(validator, bpe_tokenizer, info, 2)
        engine.start()
        retiring = asyncio.ensure_future(engine.retire_worker())
        await asyncio.sleep(0)  # it takes the least-loaded worker out of placement
        (slot,) = [s for s in engine._slots if s.retiring]
        engine._on_worker_failure(slot, RuntimeError("injected: lost while retiring"))
        assert await retiring == slot.actor
        assert slot not in engine._slots and engine.worker_health() == [True]
        assert not [t for t in engine._supervisor._tasks if "recover" in t.get_name()]
        await engine.stop()

    asyncio.run(go())
