"""Readiness tells the truth about the mask tier: NOT_SERVING when the last
replica dies, SERVING again when it returns. Real mask services over gRPC on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from specmask.mask_service.client.replicas import join_host_port
from specmask.mask_service.server.server import build_service
from specmask.mask_service.server.tokenizers import TokenizerRegistry, TokenizerSource
from specmask.orchestrator.dev.local_stack import free_port
from specmask.orchestrator.readiness import MaskTierProbe, Readiness
from tests.fixtures.tokenizers import build_bpe_tokenizer
from tests.mask_service.service_config import make_config


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


def test_readiness_follows_the_last_mask_replica(bpe_dir: Path) -> None:
    registry = TokenizerRegistry([TokenizerSource(str(bpe_dir))])
    ports = [free_port(), free_port()]

    def serve(port: int):
        handle = build_service(make_config(bpe_dir, port=port, compile_workers=0), registry)
        handle.server.start()
        return handle

    async def scenario() -> list[bool]:
        published: list[bool] = []
        workers_ok = True
        probe = MaskTierProbe([join_host_port("127.0.0.1", p) for p in ports], timeout_s=1.0)
        readiness = Readiness(lambda: workers_ok, probe, published.append, interval_s=0.2)
        handles = [serve(p) for p in ports]
        try:
            assert await readiness.check() is True
            handles[0].stop(grace_s=0)
            assert await readiness.check() is True  # one replica left: still ready
            assert readiness.mask_replicas_serving == 1
            handles[1].stop(grace_s=0)  # the last replica dies
            assert await readiness.check() is False
            handles[1] = serve(ports[1])  # it comes back on its address
            readiness.start()  # the timer notices without being asked
            for _ in range(100):
                await asyncio.sleep(0.1)
                if readiness.ready:
                    break
            assert readiness.ready is True
            workers_ok = False  # the engine lost its last worker and pokes
            readiness.poke()
            for _ in range(50):
                await asyncio.sleep(0.1)
                if readiness.ready is False:
                    break
            assert readiness.ready is False
        finally:
            await readiness.stop()
            for h in handles:
                h.stop(grace_s=0)
        return published

    assert asyncio.run(scenario()) == [True, False, True, False]
