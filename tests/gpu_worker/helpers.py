"""Shared helpers for worker tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import torch

from specmask.gpu_worker.types import FinishReason, StepOutput


@dataclass
class Finished:
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    error: str | None = None
    steps: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    outputs: list[StepOutput] = field(default_factory=list)


def wait_sessions_open(worker: Any, timeout_s: float = 20.0) -> None:
    """Block until every mask session add() started opening has answered (add() does not wait
    for them, and a sequence sits out steps until its session is open); the next step settles them."""
    for state in list(worker._seqs.values()):
        if state.session_opening is not None:
            futures.wait([state.session_opening], timeout=timeout_s)


def wait_sessions_closed(mask_service: Any, request_ids: Collection[str], timeout_s: float = 10.0) -> int:
    """Wait until the service holds no session for ``request_ids``; returns how many are left.
    The service fixture is shared and closes are fire-and-forget on the worker's mask I/O
    thread, so tests count their own sessions, never the store's total."""
    deadline = time.monotonic() + timeout_s
    while (left := mask_service.sessions.count_for(request_ids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def run_to_completion(worker: Any, *, max_steps: int = 1000) -> dict[str, Finished]:
    """Step until no sequence is active; collect per-sequence results."""
    results: dict[str, Finished] = {}
    for _ in range(max_steps):
        if worker.num_active() == 0:
            return results
        for out in worker.step():
            r = results.setdefault(out.seq_id, Finished())
            r.tokens.extend(out.new_token_ids)
            r.steps += 1
            r.drafts_proposed += out.drafts_proposed
            r.drafts_accepted += out.drafts_accepted
            r.outputs.append(out)
            if out.finish_reason is not None:
                r.finish, r.error = out.finish_reason, out.error
    raise AssertionError(f"still {worker.num_active()} active sequences after {max_steps} steps")


@contextlib.contextmanager
def serving_masks(model_dir: Any) -> Iterator[Any]:
    """A real mask service on a free loopback port serving ``model_dir``'s tokenizer; its handle."""
    from specmask.mask_service.server.config import MaskServiceConfig
    from specmask.mask_service.server.server import build_service
    from specmask.mask_service.server.tokenizers import TokenizerSource

    config = MaskServiceConfig(tokenizers=(TokenizerSource(str(model_dir)),), host="127.0.0.1", port=0, mask_threads=1)
    handle = build_service(config)
    handle.server.start()
    try:
        yield handle
    finally:
        handle.stop(grace_s=1.0)


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Temporarily set torch's intra-op threads (tiny matmuls on a shared 2-core box
    run ~50x slower with two contending threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def table_rows(dense: Any, table: Any = None) -> list[Any]:
    """Dense rows ([n, W] int32, numpy or torch) -> MaskRows of a real ``RowTable``, absorbed
    through the wire encoding (with allowed counts) exactly as the mask client does."""
    import numpy as np

    from specmask.mask_service.client.row_table import RowTable
    from specmask.mask_service.wire import encode_row, row_content_id
    from specmask.proto.gen.specmask.mask.v1 import mask_service_pb2 as pb

    dense = np.ascontiguousarray(np.asarray(dense, dtype=np.int32))
    width = dense.shape[1]
    table = table if table is not None else RowTable(width, capacity=4096)
    new_rows, ids = [], []
    for row in dense:
        enc, payload, allowed = encode_row(row)
        ids.append(0 if (row == -1).all() else row_content_id(row.tobytes(), width))
        if ids[-1]:
            new_rows.append(pb.NewRow(row_id=ids[-1], encoding=enc, payload=payload, allowed_count=allowed))
    slots = table.absorb(new_rows, ids)
    view = table.view()
    from specmask.mask_service.client.row_table import MaskRow

    return [MaskRow(view, int(s)) for s in slots]
