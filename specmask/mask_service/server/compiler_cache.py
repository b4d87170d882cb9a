"""Compiled-grammar cache: byte-bounded LRU in front of a bounded, killable compile path.

Keyed by (tokenizer id, vocab size, grammar cache key). A miss goes through:

1. the refusal cache: a grammar refused before (engine error, structural
   limit, compile over budget) is refused again at once, never recompiled;
2. structural limits (mask_service.limits): microseconds, before any compile;
3. a trial compile in a killable worker process (mask_service.compile_pool),
   under a CPU-time budget, a memory cap and a wall-clock backstop, behind a
   per-owner fair queue;
4. the real compile in this process, on a small pool of low-priority threads
   (the trial proved it finishes within budget), then the LRU.

Concurrent requests for one key share one pipeline. A request waits at most
its own deadline (less a margin); if the compile is still queued or running
then, it gets RESOURCE_EXHAUSTED ("still compiling, retry"), never
DEADLINE_EXCEEDED, which the router would read as a dead replica. The number
of requests waiting on compiles is bounded too, so waiting requests cannot
take every gRPC thread from draft-mask calls; one owner may take all but
``waiters_reserve`` of those places, which stay for other owners (as the
compile queue lets a lone owner borrow idle places but keeps each owner's share).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.mask_service.errors import GrammarError, GrammarTooComplex, MaskError
from specmask.mask_service.grammar.backends import BACKENDS, GrammarBackend
from specmask.mask_service.grammar.grammar_checks import mark_prechecked
from specmask.mask_service.grammar.json_keys import key_vocab
from specmask.mask_service.grammar.limits import GrammarLimits, check_limits
from specmask.mask_service.server.compile_pool import CompilePool, CompileQueueFull
from specmask.mask_service.server.tokenizers import TokenizerRegistry

logger = logging.getLogger(__name__)

# Refusals remembered (LRU by count): one entry is a key and a short message.
DEFAULT_MAX_REFUSALS = 4096
# How long a "too complex" refusal (compile over budget) is remembered.
TOO_COMPLEX_REFUSAL_TTL_S = 600.0
# Answer a waiting request this long before its own deadline, so the reply
# (RESOURCE_EXHAUSTED, retry) reaches the client before its deadline fires.
_DEADLINE_MARGIN_S = 0.25
# In-process compile threads run at this nice value (Linux: per thread), so a
# compile yields the CPU to draft-mask calls. Not the compile workers' 19 /
# SCHED_IDLE: these threads share the GIL with the serving threads, and a starved
# thread holding it would stall them (the engine's compile itself releases it).
_COMPILE_THREAD_NICE = 10

CacheKey = tuple[str, int, str]


@dataclass(frozen=True)
class CompiledEntry:
    key: CacheKey
    compiled: Any  # xgrammar.CompiledGrammar
    backend: GrammarBackend
    vocab_size: int
    size_bytes: int
    json_keys: bool = False  # a JSON grammar: sessions refuse repeated keys (grammar/json_keys.py)


class CompileInProgress(CompileQueueFull):
    """The grammar is still queued or compiling when the caller's deadline nears (RESOURCE_EXHAUSTED)."""


def _lower_thread_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _COMPILE_THREAD_NICE)


class CompilerCache:
    def __init__(
        self,
        registry: TokenizerRegistry,
        *,
        max_bytes: int,
        compile_threads: int,
        compile_timeout_s: float,
        backend: str = "auto",  # backends.SelectingBackend: xgrammar, else llguidance
        limits: GrammarLimits | None = None,
        max_waiters: int = 8,
        waiters_reserve: int | None = None,
        max_refusals: int = DEFAULT_MAX_REFUSALS,
        wall_timeout_s: float | None = None,
    ) -> None:
        self._registry = registry
        self._max_bytes = max_bytes
        self._timeout = compile_timeout_s
        self._backend_name = backend
        self._backend = BACKENDS[backend]
        self._limits = limits or GrammarLimits()
        # Trial compiles in worker processes (attach_pool); without a pool compiles
        # run in-process only, unbounded in time and memory (tools, engine tests).
        self._pool: CompilePool | None = None
        self._max_waiters = max_waiters
        # Places one owner cannot take (None: a quarter), kept for the others.
        reserve = max_waiters // 4 if waiters_reserve is None else waiters_reserve
        self._max_waiters_per_owner = max(1, max_waiters - reserve)
        self._waiters_by_owner: dict[str, int] = {}
        # Without a wait of its own, a request waits for the compile's wall backstop, twice.
        self._default_wait_s = 2 * (wall_timeout_s or compile_timeout_s)
        self._max_refusals = max_refusals
        self._executor = ThreadPoolExecutor(
            max_workers=compile_threads, thread_name_prefix="compile", initializer=_lower_thread_priority
        )
        self._lock = threading.Lock()
        self._entries: OrderedDict[CacheKey, CompiledEntry] = OrderedDict()
        self._refusals: OrderedDict[CacheKey, tuple[GrammarError, float]] = OrderedDict()  # (error, expiry)
        self._inflight: dict[CacheKey, Future[CompiledEntry]] = {}
        self._compilers: dict[tuple[str, int], Any] = {}
        self._bytes = 0
        self._waiters = 0
        self._compile_threads = compile_threads

    # -- figures ---------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return self._bytes

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_refusals(self) -> int:
        return len(self._refusals)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def pool(self) -> CompilePool | None:
        return self._pool

    def attach_pool(self, pool: CompilePool) -> None:
        """Route every new compile through ``pool``'s killable workers first."""
        self._pool = pool

    # -- compile path ------------------------------------------------------------
    def _compiler(self, tokenizer_id: str, vocab_size: int) -> Any:
        key = (tokenizer_id, vocab_size)
        with self._lock:
            comp = self._compilers.get(key)
        if comp is None:
            info = self._registry.info(tokenizer_id, vocab_size)
            comp = self._backend.make_compiler(info, self._compile_threads)
            with self._lock:
                comp = self._compilers.setdefault(key, comp)
        return comp

    def tokenizer_json(self, tok_key: Any) -> str:
        """The engine tokenizer a compile worker needs, serialised (compile_pool's callback)."""
        tokenizer_id, vocab_size = tok_key
        return str(self._registry.info(tokenizer_id, vocab_size).serialize_json())

    def _refuse(self, key: CacheKey, exc: GrammarError) -> None:
        with self._lock:
            # An over-budget compile may have been slow because the box was busy, not
            # because of the grammar: that refusal expires; the engine's own never does.
            ttl = TOO_COMPLEX_REFUSAL_TTL_S if isinstance(exc, GrammarTooComplex) else math.inf
            self._refusals[key] = (exc, time.monotonic() + ttl)
            self._refusals.move_to_end(key)
            while len(self._refusals) > self._max_refusals:
                self._refusals.popitem(last=False)

    def _finish(self, key: CacheKey, fut: Future[CompiledEntry], exc: BaseException) -> None:
        if isinstance(exc, GrammarError):  # the grammar's fault: the same key fails the same way again
            self._refuse(key, exc)
        with self._lock:
            self._inflight.pop(key, None)
        fut.set_exception(exc)

    def _compile_into(self, key: CacheKey, spec: GrammarSpec, fut: Future[CompiledEntry]) -> None:
        try:
            compiled = self._backend.compile(self._compiler(key[0], key[1]), spec)
        except BaseException as exc:
            self._finish(key, fut, exc)
            return
        # The duplicate-key guard reads every accepted byte as JSON; free reasoning text before the
        # JSON would mislead it, so with a section a repeated key is left to the end check.
        json_keys = spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.ANY_JSON) and spec.reasoning is None
        if json_keys:
            try:  # built once per tokenizer, here rather than on the first OpenSession
                key_vocab(key[0], compiled.tokenizer_info, (key[1] + 31) // 32)
            except BaseException as exc:
                self._finish(key, fut, exc)
                return
        entry = CompiledEntry(
            key, compiled, self._backend, key[1], int(compiled.memory_size_bytes), json_keys=json_keys
        )
        with self._lock:
            self._inflight.pop(key, None)
            if key not in self._entries:
                self._entries[key] = entry
                self._bytes += entry.size_bytes
                while self._bytes > self._max_bytes and len(self._entries) > 1:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= old.size_bytes
        fut.set_result(entry)

    def _after_trial(self, key: CacheKey, spec: GrammarSpec, fut: Future[CompiledEntry], trial: Future[Any]) -> None:
        exc = trial.exception()
        if exc is not None:
            self._finish(key, fut, exc)
            return
        outcome = trial.result()
        logger.debug("trial compile %s: %.3f s, peak RSS %d", key[2][:12], outcome.seconds, outcome.peak_rss_bytes)
        # The worker ran the pre-checks (metaschema, Unicode, depth) on this very spec:
        # not again here, where that Python walk would hold the GIL from draft-mask calls.
        mark_prechecked(spec)
        try:
            self._executor.submit(self._compile_into, key, spec, fut)
        except RuntimeError as exc:  # executor shut down
            self._finish(key, fut, CompileQueueFull(f"mask service is shutting down ({exc})", retry_after_s=1.0))

    def _start(self, key: CacheKey, spec: GrammarSpec, owner: str) -> Future[CompiledEntry]:
        """The key's pipeline future (caller holds ``_lock`` and saw no entry, refusal or pipeline)."""
        fut: Future[CompiledEntry] = Future()
        fut.set_running_or_notify_cancel()
        if self._pool is None:
            self._executor.submit(self._compile_into, key, spec, fut)
        else:
            trial = self._pool.submit(self._backend_name, (key[0], key[1]), spec, owner)  # may raise: nothing kept
            trial.add_done_callback(lambda t: self._after_trial(key, spec, fut, t))
        self._inflight[key] = fut
        return fut

    def get(
        self,
        tokenizer_id: str,
        vocab_size: int | None,
        spec: GrammarSpec,
        *,
        owner: str = "",
        wait_s: float | None = None,
    ) -> tuple[CompiledEntry, bool]:
        """Return (entry, cache_hit). Raises GrammarError (incl. limits and GrammarTooComplex),
        CompileQueueFull / CompileInProgress, UnknownTokenizer.

        ``wait_s``: the caller's remaining deadline (None: up to twice the compile budget).
        """
        size = vocab_size or self._registry.get(tokenizer_id).default_vocab_size
        self._registry.info(tokenizer_id, size)  # validates tokenizer id and size
        key = (tokenizer_id, size, spec.cache_key())
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry, True
            refused_until = self._refusals.get(key)
            refused = None
            if refused_until is not None:
                if refused_until[1] > time.monotonic():
                    refused = refused_until[0]
                else:
                    del self._refusals[key]
            fut = self._inflight.get(key)
        if refused is not None:
            raise type(refused)(refused.message)
        if fut is None:
            try:
                check_limits(spec, self._limits)
            except GrammarError as exc:
                self._refuse(key, exc)
                raise
        with self._lock:
            mine = self._waiters_by_owner.get(owner, 0)
            if self._waiters >= self._max_waiters or mine >= self._max_waiters_per_owner:
                raise CompileQueueFull(
                    f"{self._waiters} requests already waiting for grammar compiles "
                    f"({mine} of this client's); retry shortly",
                    retry_after_s=1.0,
                )
            fut = self._inflight.get(key)
            if fut is None:
                if key in self._entries:  # finished while we checked limits
                    return self._entries[key], True
                fut = self._start(key, spec, owner)
            self._waiters += 1
            self._waiters_by_owner[owner] = mine + 1
        # The reply must reach the client before its deadline, also on a loaded box.
        wait = self._default_wait_s if wait_s is None else max(0.0, wait_s - max(_DEADLINE_MARGIN_S, 0.05 * wait_s))
        try:
            return fut.result(timeout=wait), False
        except FutureTimeout:
            raise CompileInProgress(
                f"grammar still compiling after {wait:.1f} s (budget {self._timeout:g} s of CPU); retry shortly",
                retry_after_s=max(1.0, self._timeout / 2),
            ) from None
        except MaskError:
            raise
        finally:
            with self._lock:
                self._waiters -= 1
                left = self._waiters_by_owner.pop(owner) - 1
                if left:
                    self._waiters_by_owner[owner] = left

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)
