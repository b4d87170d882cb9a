"""Compiled-grammar cache: byte-bounded LRU, compilation off the request thread with a time limit.

Keyed by (tokenizer id, vocab size, grammar cache key). Compiling a large
schema against a 128k vocab takes 10 ms to seconds, so it runs on a small
dedicated pool; concurrent requests for the same key share one compilation;
a request waits at most ``compile_timeout_s`` (the compilation then finishes in
the background and lands in the cache, because xgrammar cannot be cancelled).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from mask_service.backends import BACKENDS, GrammarBackend
from mask_service.errors import CompileTimeout, MaskError
from mask_service.grammar import GrammarSpec
from mask_service.tokenizers import TokenizerRegistry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompiledEntry:
    key: tuple[str, int, str]
    compiled: Any  # xgrammar.CompiledGrammar
    backend: GrammarBackend
    vocab_size: int
    size_bytes: int


class CompilerCache:
    def __init__(
        self,
        registry: TokenizerRegistry,
        *,
        max_bytes: int,
        compile_threads: int,
        compile_timeout_s: float,
        backend: str = "xgrammar",
    ) -> None:
        self._registry = registry
        self._max_bytes = max_bytes
        self._timeout = compile_timeout_s
        self._backend = BACKENDS[backend]
        self._pool = ThreadPoolExecutor(max_workers=compile_threads, thread_name_prefix="compile")
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, int, str], CompiledEntry] = OrderedDict()
        self._inflight: dict[tuple[str, int, str], Future[CompiledEntry]] = {}
        self._compilers: dict[tuple[str, int], Any] = {}
        self._bytes = 0
        self._compile_threads = compile_threads

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def _compiler(self, tokenizer_id: str, vocab_size: int) -> Any:
        key = (tokenizer_id, vocab_size)
        with self._lock:
            comp = self._compilers.get(key)
        if comp is None:
            info = self._registry.info(tokenizer_id, vocab_size)
            comp = self._backend.make_compiler(info, self._compile_threads)  # type: ignore[attr-defined]
            with self._lock:
                comp = self._compilers.setdefault(key, comp)
        return comp

    def _compile(self, key: tuple[str, int, str], spec: GrammarSpec) -> CompiledEntry:
        compiled = self._backend.compile(self._compiler(key[0], key[1]), spec)
        entry = CompiledEntry(key, compiled, self._backend, key[1], int(compiled.memory_size_bytes))
        with self._lock:
            self._inflight.pop(key, None)
            if key not in self._entries:
                self._entries[key] = entry
                self._bytes += entry.size_bytes
                while self._bytes > self._max_bytes and len(self._entries) > 1:
                    _, old = self._entries.popitem(last=False)
                    self._bytes -= old.size_bytes
        return entry

    def _compile_guarded(self, key: tuple[str, int, str], spec: GrammarSpec) -> CompiledEntry:
        try:
            return self._compile(key, spec)
        except BaseException:
            with self._lock:
                self._inflight.pop(key, None)
            raise

    def get(self, tokenizer_id: str, vocab_size: int | None, spec: GrammarSpec) -> tuple[CompiledEntry, bool]:
        """Return (entry, cache_hit). Raises GrammarError / CompileTimeout / UnknownTokenizer."""
        size = vocab_size or self._registry.get(tokenizer_id).default_vocab_size
        self._registry.info(tokenizer_id, size)  # validates tokenizer id and size
        key = (tokenizer_id, size, spec.cache_key())
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry, True
            fut = self._inflight.get(key)
            if fut is None:
                fut = self._pool.submit(self._compile_guarded, key, spec)
                self._inflight[key] = fut
        try:
            return fut.result(timeout=self._timeout), False
        except FutureTimeout:
            raise CompileTimeout(f"grammar compilation exceeded {self._timeout:.1f}s") from None
        except MaskError:
            raise

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
