"""Special tokens a grammar names by id (xgrammar's ``Token(id)``), kept in the output text.

Outputs are detokenized without special tokens, as vLLM returns them. A special token
the request's grammar names by id is part of the document, though: Mistral's
``[TOOL_CALLS]`` opens its calls, harmony's ``<|channel|>`` ... ``<|call|>`` frame each
call, Llama's ``<|python_tag|>`` may precede its calls (tool_formats), and a parser
reads them. So a request whose grammar names tokens by id gets a text that keeps exactly
those tokens, as their text, and drops every other special token: what the tokenizer
decodes with the others removed, so its decoder sees the kept tokens in place, as the
model wrote them (a SentencePiece decoder strips the space of the output's first piece,
not of the first piece after a marker).

Text alone cannot tell a kept token from the same characters written in ordinary
tokens. So the end check is told where each kept token is (``KeptToken``), read from
the token ids, and takes each as the mask service's engine does (output_check): by a
``Token(id)`` of the grammar, or as its text where the grammar admits that text
(xgrammar reads an added token as its text, inside a JSON string say). A marker the
model wrote anywhere else, or the marker's characters in ordinary tokens where the
grammar names the token, fail the check.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from specmask.common.grammar_spec import GrammarKind, GrammarSpec
from specmask.orchestrator.detokenizer import Decoder, StreamSource, stream_source

# A grammar's reference to a token by id (xgrammar EBNF); ids past 9 digits are beyond any vocabulary.
TOKEN_REF = re.compile(r"Token\((\d{1,9})\)")


@dataclass(frozen=True)
class KeptToken:
    """One kept special token in an output's text: ``offset`` characters of text before it."""

    offset: int
    token_id: int
    text: str


def named_token_ids(spec: GrammarSpec | None) -> frozenset[int]:
    """The token ids ``spec`` names (``Token(id)``; EBNF grammars only)."""
    if spec is None or spec.kind is not GrammarKind.EBNF:
        return frozenset()
    return frozenset(int(i) for i in TOKEN_REF.findall(spec.text))


def _special_ids(tokenizer: Any) -> frozenset[int] | None:
    """The ids ``skip_special_tokens`` drops: a ``tokenizers.Tokenizer``'s or a transformers
    tokenizer's special added tokens; None when the tokenizer does not say."""
    table = None
    if callable(getattr(tokenizer, "get_added_tokens_decoder", None)):
        table = tokenizer.get_added_tokens_decoder()
    elif isinstance(getattr(tokenizer, "added_tokens_decoder", None), dict):
        table = tokenizer.added_tokens_decoder
    if table is None:
        return None
    return frozenset(int(i) for i, t in table.items() if getattr(t, "special", False))


class KeepingDecoder:
    """A ``Decoder`` that keeps the special tokens in ``keep`` as their text and drops the others."""

    def __init__(self, tokenizer: Decoder, keep: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.keep = frozenset(keep)
        special = _special_ids(tokenizer)
        self._drop = None if special is None else special - self.keep
        self._texts: dict[int, str] = {}

    def text_of(self, token_id: int) -> str:
        """A kept token's text (its content in the vocabulary)."""
        found = self._texts.get(token_id)
        if found is None:
            found = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return found

    def stream_source(self, skip_special_tokens: bool) -> StreamSource | None:
        """How the incremental detokenizer streams ``decode``: the wrapped tokenizer's stream
        without the dropped ids, unskipped (None when the tokenizer does not list its special
        tokens, or is not a ``tokenizers.Tokenizer``)."""
        inner = stream_source(self._tokenizer, skip_special_tokens=False)
        if inner is None or inner.drop:  # a wrapper of a wrapper: the window code decodes it
            return None
        if not skip_special_tokens:
            return inner
        return None if self._drop is None else StreamSource(inner.tokenizer, False, self._drop)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if not skip_special_tokens:
            return self._tokenizer.decode(list(ids), skip_special_tokens=False)
        if self._drop is not None:
            drop = self._drop
            return self._tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)
        # A tokenizer that does not list its special tokens: ordinary runs decoded apart.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.keep:
                parts.append(self._tokenizer.decode(run, skip_special_tokens=True) if run else "")
                parts.append(self.text_of(i))
                run = []
            else:
                run.append(i)
        parts.append(self._tokenizer.decode(run, skip_special_tokens=True) if run else "")
        return "".join(parts)

    def kept(self, ids: Sequence[int]) -> tuple[KeptToken, ...]:
        """Where the kept tokens of ``ids`` are in ``decode(ids)``. Raises ``ValueError`` when the
        decoded text does not hold a token's text where the token is (the end check then fails)."""
        ids = list(ids)
        text = self.decode(ids)
        out = []
        for at, token in enumerate(ids):
            if token not in self.keep:
                continue
            offset = len(self.decode(ids[:at]))
            piece = self.text_of(token)
            if not piece or not text.startswith(piece, offset):
                raise ValueError(f"kept token {token} ({piece!r}) is not at offset {offset} of the decoded output")
            out.append(KeptToken(offset, token, piece))
        return tuple(out)

    def find(self, text: str) -> tuple[KeptToken, ...]:
        """The kept tokens' texts wherever they occur in ``text``, read as the tokens: for a text
        without its ids (a stop string's probe); the end check of a finished output uses ``kept``."""
        texts = sorted(((self.text_of(i), i) for i in self.keep), key=lambda p: -len(p[0]))
        out = []
        pos = 0
        while pos < len(text):
            hit = next(((t, i) for t, i in texts if t and text.startswith(t, pos)), None)
            if hit is None:
                pos += 1
                continue
            out.append(KeptToken(pos, hit[1], hit[0]))
            pos += len(hit[0])
        return tuple(out)


def decoder_for(tokenizer: Decoder, spec: GrammarSpec | None) -> Decoder:
    """The decoder of a request's output: ``tokenizer`` itself, or one that keeps the tokens its
    grammar names."""
    ids = named_token_ids(spec)
    return KeepingDecoder(tokenizer, ids) if ids else tokenizer


def kept_in(decoder: Decoder, ids: Sequence[int]) -> tuple[KeptToken, ...]:
    """``decoder.kept(ids)`` for a keeping decoder; () for any other."""
    return decoder.kept(ids) if isinstance(decoder, KeepingDecoder) else ()


def finder(decoder: Decoder) -> Callable[[str], tuple[KeptToken, ...]]:
    """``decoder.find`` for a keeping decoder; a finder of nothing for any other."""
    return decoder.find if isinstance(decoder, KeepingDecoder) else (lambda _text: ())
