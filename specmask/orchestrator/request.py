"""Per-request state: what one client is waiting for, apart from engine state.

A ``Request`` turns the worker's per-step ``StepOutput`` into client-facing
``RequestOutput`` events: it accumulates token ids and usage, detokenizes
incrementally, applies stop strings, and queues deltas for the servicer. The
engine decides *when* a request runs; the request decides *what* the client
sees.

Checked mode: a request whose grammar is enforced by a relaxation
(``GrammarReport.checked``) *holds* its output: nothing is streamed until the
engine's end check passes (``release`` then sends the whole text as one
delta), because an attempt that fails the check is discarded and regenerated
(``restart``). A held request that fails returns no text at all.

A grammar request that is not held still never streams the text of the step the
worker calls complete before the end check passed (``_unchecked``): a client of a
request that ends in a violation holds no complete-looking document.

Logprobs (``SamplingParams.logprobs``) follow the text (``LogprobCursor``): a token's
entry goes out with the event whose text holds the token's first character, so
text held back (an incomplete character, a possible stop-string prefix) holds its
tokens back too, and the tokens a stop string cut off (those starting at or after
the match) are never returned. Tokens that decode to no text of their own go with
the next text, or with the final event.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from specmask.common.tracing import NO_SPAN, Span
from specmask.gpu_worker.types import ErrorKind, FinishReason, NewSequence, StepOutput, TokenLogprob
from specmask.orchestrator.detokenizer import Decoder, IncrementalDetokenizer
from specmask.orchestrator.kept_tokens import decoder_for
from specmask.orchestrator.stop_strings import StopStringMatcher
from specmask.orchestrator.types import GenerationResult, GrammarReport, OutputLogprob, RequestOutput, Usage

logger = logging.getLogger(__name__)
# Finish reasons on which a held (checked-mode) request's output is released to the client.
_HELD_SUCCESSES = frozenset({FinishReason.STOP, FinishReason.LENGTH, FinishReason.GRAMMAR_COMPLETE})


class RequestLog(logging.LoggerAdapter):
    """Prefixes every line with the request id (the id in every log line)."""

    def process(self, msg, kwargs):
        assert self.extra is not None  # always built with {"request_id": ...}
        return f"[request_id={self.extra['request_id']}] {msg}", kwargs


class LogprobCursor:
    """Pairs tokens' logprob entries with the text the client is sent (see the module docstring).

    Positions are characters of the detokenized output: a token starts where the text decoded
    before it ends. ``push`` decodes one token at a time to learn those starts; ``take`` is told
    how many characters were just sent and returns the entries of the tokens starting before
    the end of what was sent so far."""

    def __init__(self) -> None:
        self._pending: collections.deque[tuple[int, TokenLogprob]] = collections.deque()
        self._decoded = 0  # characters the detokenizer has produced
        self._sent = 0  # characters handed on to the client (after stop-string holding)

    def push(self, detokenizer: IncrementalDetokenizer, entries: Sequence[TokenLogprob]) -> str:
        """Decode the entries' tokens, one at a time; returns their text (as one ``push`` would)."""
        parts = []
        for entry in entries:
            self._pending.append((self._decoded, entry))
            piece = detokenizer.push((entry.token_id,))
            self._decoded += len(piece)
            parts.append(piece)
        return "".join(parts)

    def flush(self, detokenizer: IncrementalDetokenizer) -> str:
        piece = detokenizer.flush()
        self._decoded += len(piece)
        return piece

    def take(self, sent_chars: int, *, cut: bool = False, final: bool = False) -> tuple[OutputLogprob, ...]:
        """Entries to send with ``sent_chars`` more characters. ``cut``: a stop string ended the
        text there (the tokens after it are dropped); ``final``: the output is complete (every
        token left goes, unless ``cut``)."""
        self._sent += sent_chars
        out = []
        while self._pending and ((final and not cut) or self._pending[0][0] < self._sent):
            start, e = self._pending.popleft()
            out.append(OutputLogprob(e.token_id, e.logprob, e.top, start))
        if cut:
            self._pending.clear()
        return tuple(out)


class Request:
    """One admitted request, from admission to its final event."""

    def __init__(
        self,
        seq: NewSequence,
        *,
        tokenizer: Decoder,
        stop: tuple[str, ...] = (),
        arrival_time: float | None = None,
        grammar: GrammarReport | None = None,
        max_attempts: int = 1,
        stop_may_end: Callable[[str], bool] | None = None,
        stop_token_ids: Sequence[int] = (),
        include_stop: bool = False,
    ) -> None:
        """``stop_may_end``: whether a stop string (or stop token) may end the output with this
        text (grammar requests: the end check; see stop_strings.py); None = any stop ends it.
        ``stop_token_ids``: sampling one ends the output (vLLM's stop_token_ids; the token is
        kept in ``token_ids``, its text returned only with ``include_stop``). ``include_stop``:
        the matched stop string or stop token's text ends the returned text."""
        self.seq = seq
        self.grammar = grammar  # how the grammar is enforced (None: no grammar)
        self.max_attempts = max_attempts  # generations the engine may run (checked mode)
        self.attempts = 1
        self._hold = grammar is not None and grammar.checked  # no deltas until the end check passes
        self._held_ids: list[int] = []
        self._held_text: list[str] = []
        self._held_logprobs: list[OutputLogprob] = []
        # A grammar that names special tokens by id keeps them in the text (kept_tokens.py).
        self._tokenizer = tokenizer = decoder_for(tokenizer, seq.grammar)
        self._stop_strings = stop
        self._stop_may_end = stop_may_end
        self._stop_token_ids = frozenset(stop_token_ids)
        self._include_stop = include_stop
        # The last step's delta of a grammar request the worker called complete, sent once
        # the end check passed (finish) and dropped if it failed.
        self._unchecked: tuple[tuple[int, ...], str, tuple[OutputLogprob, ...] | None] | None = None
        self.log = RequestLog(logger, {"request_id": seq.seq_id})
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.admitted_time: float | None = None  # validated and queued (Engine.submit)
        self.scheduled_time: float | None = None  # sent to a worker with an iterate() call (Engine._iterate)
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None  # the latest step that brought tokens the client sees
        self.finish_time: float | None = None
        self.usage = Usage(prompt_tokens=len(seq.prompt_token_ids))
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.error_kind: ErrorKind | None = None  # set by finish() for a failure
        self._text_parts: list[str] = []
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop = StopStringMatcher(stop, stop_may_end, include=include_stop)
        self._fed = 0  # output tokens fed to the stop strings (min_tokens' floor)
        # Requests with logprobs: the entries sent so far (the result's), and the cursor that
        # pairs the rest with text; None otherwise (the request then pays nothing for them).
        self._logprobs: list[OutputLogprob] | None = [] if seq.sampling.logprobs is not None else None
        self._cursor: LogprobCursor | None = LogprobCursor() if self._logprobs is not None else None
        self._events: asyncio.Queue[RequestOutput] = asyncio.Queue()
        # Its trace's request span (orchestrator.request_trace); NO_SPAN while tracing is off.
        self.trace: Span = NO_SPAN

    @property
    def request_id(self) -> str:
        return self.seq.seq_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self._text_parts)

    def apply_step(self, out: StepOutput) -> bool:
        """Fold one step's output in and queue the delta; return True on a stop-string hit.

        The caller finishes the request (``finish``) when this returns True or
        when ``out.finish_reason`` is set.
        """
        if self.finished:
            return False
        self.usage.target_forwards += out.target_forwards
        self.usage.drafts_proposed += out.drafts_proposed
        self.usage.drafts_accepted += out.drafts_accepted
        self.usage.mask_time_s += out.mask_time_s
        if not out.new_token_ids:
            return False
        if not self._hold:
            self.last_token_time = time.monotonic()
            if self.first_token_time is None:
                self.first_token_time = self.last_token_time
        new_ids = tuple(int(t) for t in out.new_token_ids)
        entries: Sequence[TokenLogprob] | None = None
        if self._cursor is not None:
            entries = out.logprobs
            if entries is None or [e.token_id for e in entries] != list(new_ids):
                raise RuntimeError(f"the worker's logprobs do not match its tokens {list(new_ids)}: {entries}")
        new_ids, text, stopped, logprobs = self._fold(new_ids, entries)
        self.token_ids.extend(new_ids)
        self.usage.completion_tokens += len(new_ids)
        if out.finish_reason is FinishReason.GRAMMAR_COMPLETE and self.seq.grammar is not None and not self._hold:
            self._unchecked = (new_ids, text, logprobs)
        else:
            self._emit(new_ids, text, logprobs)
        return stopped

    def _fold(
        self, ids: tuple[int, ...], entries: Sequence[TokenLogprob] | None
    ) -> tuple[tuple[int, ...], str, bool, tuple[OutputLogprob, ...] | None]:
        """Detokenize one step's tokens through the stop strings and stop tokens: (the tokens
        the output keeps, the text to send, whether a stop ended it, the text's logprobs)."""
        texts: list[str] = []
        logprobs: list[OutputLogprob] = []
        start = 0
        for j, token in enumerate(ids):
            if token not in self._stop_token_ids:
                continue
            text, stopped, lp = self._feed(ids[start:j], entries[start:j] if entries is not None else None)
            texts.append(text)
            logprobs.extend(lp or ())
            if stopped:  # a stop string before the stop token ended it first
                return ids, "".join(texts), True, self._logprobs_or_none(logprobs)
            start = j  # if the token cannot end the output here, it is fed as any other
            ended = self._end_at_stop_token(token, entries[j] if entries is not None else None)
            if ended is not None:
                texts.append(ended[0])
                logprobs.extend(ended[1] or ())
                return ids[: j + 1], "".join(texts), True, self._logprobs_or_none(logprobs)
        text, stopped, lp = self._feed(ids[start:], entries[start:] if entries is not None else None)
        texts.append(text)
        logprobs.extend(lp or ())
        return ids, "".join(texts), stopped, self._logprobs_or_none(logprobs)

    def _logprobs_or_none(self, logprobs: list[OutputLogprob]) -> tuple[OutputLogprob, ...] | None:
        return tuple(logprobs) if self._cursor is not None else None

    def _feed(
        self, ids: tuple[int, ...], entries: Sequence[TokenLogprob] | None
    ) -> tuple[str, bool, tuple[OutputLogprob, ...] | None]:
        """Detokenize ``ids`` through the stop strings, split where ``min_tokens`` ends: the
        text of the first min_tokens tokens is fed with ``may_stop=False`` (vLLM counts a stop
        string only if it ends in the text of a later token)."""
        floor = max(0, min(len(ids), self.seq.sampling.min_tokens - self._fed))
        self._fed += len(ids)
        if floor == 0:
            return self._feed_part(ids, entries, may_stop=True)
        head, _, head_lp = self._feed_part(
            ids[:floor], entries[:floor] if entries is not None else None, may_stop=False
        )
        if floor == len(ids):
            return head, False, head_lp
        tail, stopped, tail_lp = self._feed_part(
            ids[floor:], entries[floor:] if entries is not None else None, may_stop=True
        )
        logprobs = None if head_lp is None or tail_lp is None else head_lp + tail_lp
        return head + tail, stopped, logprobs

    def _feed_part(
        self, ids: tuple[int, ...], entries: Sequence[TokenLogprob] | None, *, may_stop: bool
    ) -> tuple[str, bool, tuple[OutputLogprob, ...] | None]:
        if self._cursor is not None:
            assert entries is not None
            text, stopped = self._stop.feed(self._cursor.push(self._detokenizer, entries), may_stop=may_stop)
            return text, stopped, self._cursor.take(len(text), cut=stopped)
        text, stopped = self._stop.feed(self._detokenizer.push(ids), may_stop=may_stop)
        return text, stopped, None

    def _end_at_stop_token(
        self, token: int, entry: TokenLogprob | None
    ) -> tuple[str, tuple[OutputLogprob, ...] | None] | None:
        """End the output at a sampled stop token if it may end there: (the text to send, its
        logprobs); None when a grammar request's output may not end there."""
        tail_ids = (token,) if self._include_stop else ()
        out = self._stop.end(self._detokenizer.peek(tail_ids))
        if out is None:
            return None
        if self._cursor is None:
            self._detokenizer.push(tail_ids)
            self._detokenizer.flush()
            return out, None
        if self._include_stop:
            assert entry is not None
            self._cursor.push(self._detokenizer, (entry,))
        self._cursor.flush(self._detokenizer)
        return out, self._cursor.take(len(out), final=True)

    @property
    def stop_text(self) -> str:
        """The output a stop string ended (the text before the match)."""
        return self._stop.text_before_match

    @property
    def may_resample(self) -> bool:
        """Checked mode with attempts left (the validator gives greedy and exact requests one)."""
        return self.grammar is not None and self.grammar.checked and self.attempts < self.max_attempts

    def restart(self, seq: NewSequence) -> None:
        """Discard the current (held, never sent) attempt and start another with ``seq``."""
        assert self._hold and not self.finished
        self.seq = seq
        self.attempts += 1
        self.token_ids = []
        self._held_ids, self._held_text, self._held_logprobs = [], [], []
        self.usage.completion_tokens = 0  # the returned output's tokens; forwards and drafts stay cumulative
        self._detokenizer = IncrementalDetokenizer(self._tokenizer)
        if self._cursor is not None:
            self._cursor = LogprobCursor()
        self._stop = StopStringMatcher(self._stop_strings, self._stop_may_end, include=self._include_stop)
        self._fed = 0

    def _report(self) -> GrammarReport | None:
        return None if self.grammar is None else dataclasses.replace(self.grammar, attempts=self.attempts)

    def finish(self, reason: FinishReason, error: str | None = None, kind: ErrorKind | None = None) -> None:
        """Queue the final event (remaining text, finish reason, usage). Idempotent. ``kind``: what
        kind of failure an ERROR is (None: INTERNAL; ErrorKind.of), which decides how the APIs
        report it.

        A held (checked) request's text is released on a success (STOP, LENGTH,
        GRAMMAR_COMPLETE) and dropped on anything else: a failed attempt is never returned."""
        if self.finished:
            return
        held_success = self._hold and reason in _HELD_SUCCESSES
        unchecked, self._unchecked = self._unchecked, None
        if unchecked is not None and reason in _HELD_SUCCESSES:
            self._emit(*unchecked)
        discard = self._hold and not held_success
        self.finish_reason = reason
        self.error = error
        self.error_kind = ErrorKind.of(reason, kind)
        self.finish_time = time.monotonic()
        tail = ""
        if self._stop.matched is None:
            # Text held for an incomplete character or a possible stop-string
            # prefix is released now: it will never be completed.
            flushed = self._detokenizer.flush() if self._cursor is None else self._cursor.flush(self._detokenizer)
            # The flushed text is the last fed tokens': before the floor if they all were.
            tail, stopped = self._stop.feed(flushed, may_stop=self._fed > self.seq.sampling.min_tokens)
            if not stopped:
                tail += self._stop.flush()
        tail_logprobs: tuple[OutputLogprob, ...] | None = None
        if self._cursor is not None:
            tail_logprobs = self._cursor.take(len(tail), cut=self._stop.matched is not None, final=True)
        if discard:
            tail = ""
            tail_logprobs = () if tail_logprobs is not None else None
            self.token_ids = []
            self._held_ids, self._held_text, self._held_logprobs = [], [], []
        elif held_success:
            self._release()
        if tail:
            self._text_parts.append(tail)
        if tail_logprobs and self._logprobs is not None:
            self._logprobs.extend(tail_logprobs)
        if error:
            self.log.warning("finished with %s: %s", reason.name, error)
        else:
            self.log.info(
                "finished with %s: %d prompt + %d completion tokens, %d target forwards, %.2f tokens/forward",
                reason.name,
                self.usage.prompt_tokens,
                self.usage.completion_tokens,
                self.usage.target_forwards,
                self.usage.tokens_per_target_forward,
            )
        self._events.put_nowait(
            RequestOutput(
                request_id=self.request_id,
                token_ids=(),
                text=tail,
                finish_reason=reason,
                error=error,
                error_kind=self.error_kind,
                usage=dataclasses.replace(self.usage),
                grammar=self._report(),
                logprobs=tail_logprobs,
            )
        )

    def _release(self) -> None:
        """Send what a held request generated, as one delta (the end check passed)."""
        self._hold = False
        ids, text = tuple(self._held_ids), "".join(self._held_text)
        logprobs = tuple(self._held_logprobs) if self._logprobs is not None else None
        self._held_ids, self._held_text, self._held_logprobs = [], [], []
        if ids or text or logprobs:
            self.first_token_time = time.monotonic()  # what the client sees first
            self._emit(ids, text, logprobs)

    def _emit(self, token_ids: tuple[int, ...], text: str, logprobs: tuple[OutputLogprob, ...] | None = None) -> None:
        if self._hold:
            self._held_ids.extend(token_ids)
            self._held_text.append(text)
            self._held_logprobs.extend(logprobs or ())
            return
        if text:
            self._text_parts.append(text)
        if logprobs and self._logprobs is not None:
            self._logprobs.extend(logprobs)
        self._events.put_nowait(
            RequestOutput(request_id=self.request_id, token_ids=token_ids, text=text, logprobs=logprobs)
        )

    async def events(self) -> AsyncIterator[RequestOutput]:
        """The request's output events, ending with the final one."""
        while True:
            event = await self._events.get()
            yield event
            if event.finished:
                return

    async def result(self) -> GenerationResult:
        """Wait for the request to finish and return the whole output."""
        async for _ in self.events():
            pass
        assert self.finish_reason is not None  # events() ends only after finish()
        return GenerationResult(
            request_id=self.request_id,
            text=self.text,
            token_ids=tuple(self.token_ids),
            finish_reason=self.finish_reason,
            error=self.error,
            error_kind=self.error_kind,
            usage=dataclasses.replace(self.usage),
            grammar=self._report(),
            logprobs=tuple(self._logprobs) if self._logprobs is not None else None,
        )
