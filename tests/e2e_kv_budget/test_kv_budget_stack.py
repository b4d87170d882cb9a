"""A long request among 63 short ones on a worker with a KV budget, end to end.

The budget holds 64 slots of 64 positions: the 63 short requests fit, and a long one
(prompt + max_tokens = 190) beside them does not. It waits in the orchestrator's queue
while the others stream, is placed once enough of them have finished, and completes; no
request is refused by the worker or fails. Its own stack: one replica, one worker (CPU).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specmask.orchestrator.client import OrchestratorClient, build_request
from specmask.orchestrator.dev.local_stack import StackConfig
from specmask.proto.gen.specmask.orchestrator.v1 import orchestrator_pb2 as pb
from tests.e2e.stack import ThreadStack, stream_concurrently

pytestmark = pytest.mark.slow

SLOTS, CAPACITY = 64, 64


def _kv_bytes_per_token(model_dir: Path) -> int:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * heads * head_dim * 4  # float32 on a CPU


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadStack]:
    from tests.fixtures.tiny_models import build_tiny_model_pair

    target, draft = build_tiny_model_pair(tmp_path_factory.mktemp("kv-budget-tiny"))
    per_position = _kv_bytes_per_token(target) + _kv_bytes_per_token(draft)
    config = StackConfig(target_dir=str(target), draft_dir=str(draft), mask_replicas=1, num_workers=1, metrics_port=0)
    s = ThreadStack(config, max_batch=SLOTS, max_queue=16, kv_cache_bytes=SLOTS * CAPACITY * per_position).start()
    yield s
    s.stop()


def test_a_long_request_waits_in_the_queue_while_63_short_ones_stream(stack: ThreadStack) -> None:
    assert stack.running is not None
    value = stack.running.server.metrics.registry.get_sample_value
    # 6 + at most 39 tokens + 16 of slack: each short one reserves the pool's least capacity.
    shorts = [
        build_request([5 + (i + j) % 90 for j in range(6)], max_tokens=30 + i % 10, ignore_eos=True, speculation=False)
        for i in range(63)
    ]
    long_request = build_request([7 + j % 90 for j in range(150)], max_tokens=40, ignore_eos=True, k=2)
    long_result: list[pb.GenerateResponse] = []
    seen: dict[str, float] = {}

    def send_long() -> None:
        with OrchestratorClient(stack.address) as client:
            long_result.append(client.generate(long_request, timeout_s=300))

    sender = threading.Thread(target=send_long)

    def on_started() -> None:
        # Every short one has started (the first may have finished already): the long one
        # cannot be placed beside 19 or more of them.
        sender.start()
        deadline = time.monotonic() + 30
        model = {"model_name": stack.running.config.model_name}
        while time.monotonic() < deadline and not seen.get("waiting"):
            seen["waiting"] = value("vllm:num_requests_waiting", model) or 0
            time.sleep(0.005)
        seen["running_then"] = value("vllm:num_requests_running", model) or 0
        seen["kv_usage"] = value("specmask_kv_cache_usage_ratio") or 0.0

    results = stream_concurrently(stack.address, shorts, on_started)
    sender.join(300)
    # Queued (not refused, not placed) while at least 19 short ones ran: 20 x 206 positions
    # pass the budget, 20 of 64 batch slots do not; what they reserve is the KV gauge.
    assert seen["waiting"] == 1 and seen["running_then"] >= 19, seen
    assert seen["kv_usage"] >= 19 * CAPACITY / (SLOTS * CAPACITY), seen
    for r, req in zip(results, shorts, strict=True):
        assert r.finish_reason == pb.FINISH_REASON_LENGTH and not r.error, (r.finish_reason_name, r.error)
        assert len(r.token_ids) == req.sampling.max_tokens
    [long_response] = long_result
    assert long_response.finish_reason == pb.FINISH_REASON_LENGTH, long_response.error
    assert len(long_response.token_ids) == 40
    assert value("specmask_requests_total", {"finish_reason": "error"}) in (None, 0.0)
