"""One token's own bytes and text, for logprobs (OpenAI's ``token`` and ``bytes`` fields).

The output text is decoded incrementally over whole windows (detokenizer.py); a logprob
entry names one token alone, so it needs the token's own bytes:

* byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen): the vocabulary string maps back to
  bytes through the GPT-2 byte-to-unicode table, so a token holding half of a UTF-8
  character has exactly those bytes;
* SentencePiece byte fallback: ``<0xNN>`` is the byte NN; ``▁`` is a space;
* added and special tokens: their content, UTF-8.

``text(token_id)`` is those bytes as UTF-8 where they are whole characters, and otherwise
(a partial character) with the stray bytes written ``\\xNN``, as OpenAI writes them
(``bytes`` then holds the raw bytes, so clients can join them).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any, Protocol

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"


class VocabTokenizer(Protocol):
    """The slice of ``tokenizers.Tokenizer`` used here."""

    def to_str(self) -> str: ...

    def id_to_token(self, id: int, /) -> str | None: ...


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable stand-in character of each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_types(node: Any) -> set[str]:
    if not isinstance(node, dict):
        return set()
    found = {str(node.get("type", ""))}
    for child in node.get("decoders") or ():
        found |= _decoder_types(child)
    return found


class TokenTexts:
    """Per-token bytes and display text of one tokenizer; cached per id (the vocabulary is fixed)."""

    def __init__(self, tokenizer: VocabTokenizer) -> None:
        spec = json.loads(tokenizer.to_str())
        decoders = _decoder_types(spec.get("decoder")) | _decoder_types(spec.get("pre_tokenizer"))
        self._byte_level = "ByteLevel" in decoders
        self._added = {int(t["id"]): str(t["content"]) for t in spec.get("added_tokens") or ()}
        self._tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._compute(token_id)
        return cached

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="backslashreplace")

    def _compute(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:  # padding ids past the tokenizer's vocabulary
            return b""
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        return piece.replace(_METASPACE, " ").encode()
