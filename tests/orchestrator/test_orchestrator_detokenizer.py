"""Incremental detokenization: deltas concatenate to the full decode, never split a character."""

from __future__ import annotations

import functools
import random

import pytest

from specmask.orchestrator.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tests.fixtures.shared_data import require

TEXTS = [
    '{"name":"Zoë","city":"Zürich","emoji":"🙂👍🏽","kanji":"日本語テキスト"}',
    "plain ascii, with spaces  and\nnewlines\t and tabs",
    "€uro ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 — ünïcödé",
]


def _feed(tokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas, i = [], 0
    for size in chunk_sizes:
        deltas.append(detok.push(ids[i : i + size]))
        i += size
    deltas.append(detok.flush())
    return deltas


def _chunkings(n: int, rng: random.Random) -> list[list[int]]:
    one_by_one = [1] * n
    sizes = []
    left = n
    while left:
        s = min(left, rng.randint(1, 5))
        sizes.append(s)
        left -= s
    return [one_by_one, sizes]


def _check(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    for sizes in _chunkings(len(ids), random.Random(0)):
        deltas = _feed(tokenizer, ids, sizes)
        assert "".join(deltas) == expected
        # No delta may carry half a character: held back until complete.
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_multibyte_boundaries(bpe_tokenizer, text: str) -> None:
    # The small BPE never saw these characters: they are split into byte tokens,
    # so most characters span several tokens.
    ids = bpe_tokenizer.encode(text).ids
    assert len(ids) > len(text) // 2
    _check(bpe_tokenizer, text)


@pytest.mark.shared_data
@pytest.mark.parametrize("name", ["llama3", "qwen3", "gpt2"])
@pytest.mark.parametrize("text", TEXTS)
def test_real_tokenizers(shared_tokenizers, name: str, text: str) -> None:
    _check(_load(str(require(shared_tokenizers, name, "tokenizer.json"))), text)


@functools.cache
def _load(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def test_incomplete_character_is_held_then_flushed(bpe_tokenizer) -> None:
    ids = bpe_tokenizer.encode("🙂").ids
    assert len(ids) >= 2, "the emoji should be split into byte tokens"
    detok = IncrementalDetokenizer(bpe_tokenizer)
    assert detok.push(ids[:1]) == ""  # half a character: nothing yet
    # Generation ends mid-character: the remainder comes out on flush, as U+FFFD.
    tail = detok.flush()
    assert tail == bpe_tokenizer.decode(ids[:1])
    assert REPLACEMENT_CHAR in tail
    assert detok.flush() == ""


def test_special_tokens_are_skipped(bpe_tokenizer) -> None:
    eos = bpe_tokenizer.token_to_id("<|endoftext|>")
    ids = bpe_tokenizer.encode('{"a":1}').ids + [eos]
    assert "".join(_feed(bpe_tokenizer, ids, [1] * len(ids))) == '{"a":1}'


def test_empty_push(bpe_tokenizer) -> None:
    detok = IncrementalDetokenizer(bpe_tokenizer)
    assert detok.push([]) == ""
    assert detok.flush() == ""
