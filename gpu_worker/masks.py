"""The worker's line to the mask service: one I/O thread in front of a MaskRouter.

Every mask-service call goes through one single-threaded executor, so (a) the
router, which keeps per-session replay logs, is only ever used from one thread,
(b) the verify-path request can be in flight while the main thread runs the
target forward (torch and gRPC both release the GIL while they wait), and (c)
closes of finished sessions never block a step and stay ordered after that
session's last request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from mask_service.grammar import GrammarSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")


class MaskChannel:
    """Thread-confined access to the mask service for one worker."""

    def __init__(self, router: Any, *, tokenizer_id: str, vocab_size: int) -> None:
        self._router = router  # mask_service.router.MaskRouter (or anything with its methods)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mask-io")
        self.tokenizer_id = tokenizer_id
        self.vocab_size = vocab_size  # V: target logits width, so mask width W = ceil(V / 32)
        self.num_mask_words = (vocab_size + 31) // 32

    @classmethod
    def connect(cls, addresses: Sequence[str], *, tokenizer_id: str, vocab_size: int, deadline_s: float) -> "MaskChannel":
        from mask_service.router import MaskRouter

        return cls(MaskRouter(list(addresses), deadline_s=deadline_s), tokenizer_id=tokenizer_id, vocab_size=vocab_size)

    def _submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        return self._pool.submit(fn, *args)

    def open_session(self, spec: GrammarSpec) -> str:
        """Open a session for the target tokenizer and logits width (raises MaskServiceError)."""
        return self._submit(self._router.open_session, self.tokenizer_id, spec, self.vocab_size).result()

    def draft_masks_async(self, items: Sequence[Any]) -> "Future[tuple[list[Any], float]]":
        """Submit a batched DraftMasks call; the future gives (results, seconds on the I/O thread)."""

        def call() -> tuple[list[Any], float]:
            t0 = time.perf_counter()
            results = self._router.draft_masks(list(items))
            return results, time.perf_counter() - t0

        return self._submit(call)

    def close_session_later(self, session_id: str, seq_id: str) -> None:
        """Fire-and-forget close; a failure only leaks a session until the service's TTL."""

        def call() -> None:
            try:
                self._router.close_session(session_id)
            except Exception as exc:  # noqa: BLE001 - logged, the service evicts by TTL anyway
                logger.warning("seq %s: closing mask session %s failed: %s", seq_id, session_id, exc)

        self._submit(call)

    def close(self) -> None:
        """Drain pending closes, then release the router."""
        self._pool.shutdown(wait=True)
        close = getattr(self._router, "close", None)
        if close is not None:
            close()
