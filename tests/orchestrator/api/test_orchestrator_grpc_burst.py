"""A burst of concurrent RPCs reaches the orchestrator's handlers instead of being cancelled by gRPC core.

gRPC core cancels, with a bare CANCELLED and no message, calls that arrive while more than
``grpc.server.max_pending_requests`` (default 1,000) wait to be taken up by the server; 2,000
concurrent requests lost 179-209 that way. ``server_options()`` raises the limit, so every call
gets the handler's answer (the engine refuses what does not fit with RESOURCE_EXHAUSTED and a
retry hint). Real grpc.aio server and channel on 127.0.0.1, the same options as create_server.
"""

from __future__ import annotations

import asyncio
import collections

import grpc

from specmask.orchestrator.api.grpc_server import server_options

BURST = 1500  # past core's default pending limit of 1,000; a few seconds on a 2-core box
HOLD_S = 1.0  # each handler holds its call, so the burst is concurrent


async def _burst(options: list[tuple[str, int]]) -> collections.Counter[str]:
    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(HOLD_S)
        return b"ok"

    server = grpc.aio.server(options=options)
    handlers = {"M": grpc.unary_unary_rpc_method_handler(handler)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("burst.S", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/burst.S/M")

            async def one() -> str:
                try:
                    await call(b"x", timeout=120)
                    return "OK"
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name

            return collections.Counter(await asyncio.gather(*(one() for _ in range(BURST))))
    finally:
        await server.stop(0)


def test_burst_past_cores_pending_limit_is_not_cancelled() -> None:
    codes = asyncio.run(_burst(server_options()))
    assert codes == {"OK": BURST}, codes


def test_cores_default_pending_limit_cancels_a_burst() -> None:
    """The control: with gRPC's defaults the same burst loses calls to a bare CANCELLED."""
    codes = asyncio.run(_burst([]))
    assert codes["CANCELLED"] > 0, codes
