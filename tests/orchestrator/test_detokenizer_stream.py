"""The detokenizer on ``tokenizers.decoders.DecodeStream`` against the window code it replaced.

Random id sequences through real tokenizers (the shared GPT-2, Llama 3 and Qwen 3 ones, SmolLM2's
when it is cached, the test BPE, and a SentencePiece tokenizer with byte fallback built here):
bytes of multi-byte characters split across tokens, CJK, emoji, combining marks, special tokens
mid-stream, pushed one by one and in chunks. The streaming detokenizer and the window code (the
same class over a decoder that is not a ``tokenizers.Tokenizer``) must return the same deltas
chunk for chunk, and both must concatenate, with the flush, to ``tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from specmask.orchestrator.detokenizer import REPLACEMENT_CHAR, Decoder, IncrementalDetokenizer
from specmask.orchestrator.kept_tokens import KeepingDecoder
from tests.fixtures.shared_data import require

# Characters the generated sequences are built from: CJK, emoji (a skin tone, a ZWJ family, a
# flag), combining marks, right-to-left text, astral math letters, a literal U+FFFD.
CHARS = '日本語テキスト中文한국어🙂👍🏽👨‍👩‍👧🇯🇵e\u0301n\u0303a\u0308\u0301עבריתالعربية𝔘𝔫𝔦€½∑\ufffd \n\t{}":,'
TEXTS = (
    '{"name":"Zoë","emoji":"🙂👍🏽","kanji":"日本語テキスト"}',
    "e\u0301 n\u0303 a\u0308\u0301 עברית 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 — ünïcödé",
    "plain ascii, with spaces  and\nnewlines\t and tabs",
)
TRIALS = 250


class Window:
    """A ``Decoder`` that is not a ``tokenizers.Tokenizer``: the detokenizer decodes it with its
    window code, the implementation the stream replaced (the reference here)."""

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._decoder.decode(ids, skip_special_tokens=skip_special_tokens)


def _run(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int], peek_at: set[int]) -> list[str]:
    """Push ``ids`` in chunks of ``sizes``, then flush; before chunk ``i`` in ``peek_at``, record a
    peek of that chunk too. Returns every delta and peek, in order, then whether the pushes all
    went through the stream."""
    out, at = [], 0
    for n, size in enumerate(sizes):
        chunk = ids[at : at + size]
        at += size
        if n in peek_at:
            out.append("peek:" + detok.peek(chunk))
        out.append(detok.push(chunk))
    streamed = detok.streams
    out.append(detok.flush())
    out.append(detok.flush())
    out.append(f"streamed:{streamed}")
    return out


def _check(
    decoder: Decoder, ids: list[int], rng: random.Random, *, skip: bool = True, expected: str | None = None
) -> None:
    """Old and new give the same deltas (and peeks), concatenating to the whole decode."""
    for sizes in ([1] * len(ids), _chunks(len(ids), rng)):
        peek_at = {i for i in range(len(sizes)) if rng.random() < 0.2}
        new = IncrementalDetokenizer(decoder, skip_special_tokens=skip)
        assert new.streams
        deltas = _run(new, ids, sizes, peek_at)
        old = _run(IncrementalDetokenizer(Window(decoder), skip_special_tokens=skip), ids, sizes, peek_at)
        assert deltas[-1] == "streamed:True", "the stream refused a push the window code decoded"
        assert old.pop() == "streamed:False"
        assert deltas[:-1] == old, (ids, sizes)
        assert deltas[-2] == "", "a second flush has nothing left"
        whole = decoder.decode(ids, skip_special_tokens=skip) if expected is None else expected
        pushed = [d for d in deltas[:-3] if not d.startswith("peek:")]
        assert "".join(pushed) + deltas[-3] == whole, (ids, sizes)
        # Only the flush may end in half a character (or a U+FFFD not yet known to be whole).
        assert not any(d.endswith(REPLACEMENT_CHAR) for d in pushed), (ids, sizes)


def _chunks(n: int, rng: random.Random) -> list[int]:
    sizes, left = [], n
    while left:
        sizes.append(min(left, rng.randint(1, 5)))
        left -= sizes[-1]
    return sizes


def _special_ids(tok: Any) -> list[int]:
    return sorted(int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special)


def _byte_level_ids(tok: Any, rng: random.Random) -> list[int]:
    """Random ids of a byte-level BPE: real text with ids spliced in, bytes of characters cut
    anywhere (the text's own byte tokens), or ids drawn from the whole vocabulary."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    special = _special_ids(tok)
    kind = rng.random()
    if kind < 0.4:
        ids = list(tok.encode(rng.choice(TEXTS), add_special_tokens=False).ids)
        ids = ids[: rng.randint(1, len(ids))] if rng.random() < 0.3 else ids  # may end mid-character
    elif kind < 0.7:
        text = "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 12)))
        ids = list(tok.encode(text, add_special_tokens=False).ids)
    else:
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
    for _ in range(rng.randint(0, 3)):
        pick = rng.choice(special) if special and rng.random() < 0.6 else rng.randrange(vocab)
        ids.insert(rng.randint(0, len(ids)), pick)
    return ids


@functools.cache
def _shared(path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def _byte_level_cases() -> list[tuple[str, Callable[[Any], Any]]]:
    def shared(name: str) -> Callable[[Any], Any]:
        def load(request: Any) -> Any:
            base = request.getfixturevalue("shared_tokenizers")
            return _shared(str(require(base, name, "tokenizer.json")))

        return load

    def smollm2(request: Any) -> Any:
        return _shared(str(request.getfixturevalue("smollm2_dir") / "tokenizer.json"))

    return [
        ("test-bpe", lambda request: request.getfixturevalue("bpe_tokenizer")),
        ("gpt2", shared("gpt2")),
        ("llama3", shared("llama3")),
        ("qwen3", shared("qwen3")),
        ("smollm2", smollm2),
    ]


@pytest.mark.parametrize(("name", "load"), _byte_level_cases(), ids=[c[0] for c in _byte_level_cases()])
def test_byte_level_tokenizers(request: pytest.FixtureRequest, name: str, load: Callable[[Any], Any]) -> None:
    tok = load(request)
    rng = random.Random(f"byte-level {name}")
    for trial in range(TRIALS):
        _check(tok, _byte_level_ids(tok, rng), rng, skip=trial % 3 != 0)


@pytest.mark.parametrize(("name", "load"), _byte_level_cases(), ids=[c[0] for c in _byte_level_cases()])
def test_kept_special_tokens(request: pytest.FixtureRequest, name: str, load: Callable[[Any], Any]) -> None:
    """A grammar that names special tokens keeps exactly those in the text (kept_tokens.py): the
    stream drops the others and decodes the rest unskipped, as ``KeepingDecoder.decode`` does."""
    tok = load(request)
    special = _special_ids(tok)
    rng = random.Random(f"kept {name}")
    for _ in range(TRIALS // 2):
        keep = rng.sample(special, min(len(special), rng.randint(1, 3)))
        decoder = KeepingDecoder(tok, keep)
        ids = _byte_level_ids(tok, rng)
        for _ in range(rng.randint(1, 3)):
            ids.insert(rng.randint(0, len(ids)), rng.choice(keep))
        expected = tok.decode([i for i in ids if i in decoder.keep or i not in special], skip_special_tokens=False)
        _check(decoder, ids, rng, expected=expected)


# A SentencePiece BPE with byte fallback, as Llama 2's and Mistral's tokenizer.json are built.
_SP_CORPUS = ["the quick brown fox jumps over the lazy dog", '{"name": "value", "count": 12}', "hello world"]
_SPECIALS = ("<unk>", "<s>", "</s>")


@pytest.fixture(scope="module")
def byte_fallback_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=list(_SPECIALS), show_progress=False)
    base.train_from_iterator(_SP_CORPUS * 10, trainer=trainer)
    data = json.loads(base.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"].update(byte_fallback=True, fuse_unk=True)
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    path = Path(tmp_path_factory.mktemp("byte-fallback")) / "tokenizer.json"
    tok.save(str(path))
    loaded = Tokenizer.from_file(str(path))
    assert any(t.startswith("<0x") for t in loaded.encode("日本 🙂").tokens), "unseen text should fall back to bytes"
    return loaded


def _byte_pieces(tok: Any, char: str) -> list[int]:
    return [tok.token_to_id(f"<0x{b:02X}>") for b in char.encode()]


def _byte_fallback_ids(tok: Any, rng: random.Random) -> list[int]:
    """Units of an output: an ordinary piece (special tokens included), or one character as its
    byte pieces. Every byte run is whole characters, so valid UTF-8, with a special token between
    two runs skipped or not. A cut character only at the end, after an ordinary piece that is not
    special (see test_byte_fallback_rewrite for what a cut inside a run does)."""
    special = set(_special_ids(tok))
    ordinary = [i for i in range(tok.get_vocab_size()) if not tok.id_to_token(i).startswith("<0x")]
    plain = [i for i in ordinary if i not in special]
    ids: list[int] = []
    if rng.random() < 0.3:
        ids = list(tok.encode(rng.choice(TEXTS)).ids)
    for _ in range(rng.randint(1, 12)):
        roll = rng.random()
        if roll < 0.5:
            ids.extend(_byte_pieces(tok, rng.choice(CHARS)))
        else:
            ids.append(rng.choice(sorted(special)) if roll < 0.6 else rng.choice(ordinary))
    if rng.random() < 0.3:
        cut = _byte_pieces(tok, rng.choice("日🙂é𝔘"))
        ids += [rng.choice(plain), *cut[: rng.randint(1, len(cut) - 1)]]
    return ids


def test_byte_fallback_tokenizer(byte_fallback_tokenizer: Any) -> None:
    tok = byte_fallback_tokenizer
    rng = random.Random("byte fallback")
    for trial in range(TRIALS * 2):
        ids = _byte_fallback_ids(tok, rng)
        if trial % 3 == 0:  # unskipped, a special token may split a run: both halves are complete
            _check(tok, ids, rng, skip=False)
        else:
            _check(tok, ids, rng)


def test_byte_fallback_rewrite(byte_fallback_tokenizer: Any) -> None:
    """A byte run that turns invalid rewrites text already emitted: ``ByteFallback`` decodes the
    whole run to one U+FFFD per byte, its earlier valid characters included, so no delta can be
    right and the stream refuses the push. The window code takes over (the same deltas as it
    always gave), and the detokenizer stays usable."""
    tok = byte_fallback_tokenizer
    plain = tok.encode("hello").ids
    ids = [*plain, *_byte_pieces(tok, "\x10"), *_byte_pieces(tok, "日")[:2], *tok.encode("the").ids]
    # "\x10" is a whole character, so it is emitted; the cut "日" then makes the run invalid.
    assert not tok.decode(ids).startswith(tok.decode(ids[: len(plain) + 1]))
    rng = random.Random(0)
    for sizes in ([1] * len(ids), _chunks(len(ids), rng)):
        new = IncrementalDetokenizer(tok)
        deltas = _run(new, ids, sizes, set())
        old = _run(IncrementalDetokenizer(Window(tok)), ids, sizes, set())
        assert deltas[:-1] == old[:-1]
        if sizes[0] == 1:  # one by one, the \x10 is emitted before the run turns invalid
            assert deltas[-1] == "streamed:False"


def test_only_tokenizers_stream(bpe_tokenizer: Any) -> None:
    """A ``tokenizers.Tokenizer`` and a keeping decoder over one stream; any other decoder, and a
    keeping decoder over a tokenizer that does not list its special tokens, use the window code."""
    eos = bpe_tokenizer.token_to_id("<|endoftext|>")
    assert IncrementalDetokenizer(bpe_tokenizer).streams
    assert IncrementalDetokenizer(KeepingDecoder(bpe_tokenizer, [eos])).streams
    assert IncrementalDetokenizer(KeepingDecoder(bpe_tokenizer, [eos]), skip_special_tokens=False).streams
    assert not IncrementalDetokenizer(Window(bpe_tokenizer)).streams
    assert not IncrementalDetokenizer(KeepingDecoder(Window(bpe_tokenizer), [eos])).streams


def test_push_after_flush_matches_the_window_code(bpe_tokenizer: Any) -> None:
    """A flush that emits half a character moves the window past what the stream holds: pushes
    after it go through the window code, as they always did."""
    ids = bpe_tokenizer.encode("a🙂b日").ids
    cut = next(n for n in range(1, len(ids)) if bpe_tokenizer.decode(ids[:n]).endswith(REPLACEMENT_CHAR))
    outs = []
    for decoder in (bpe_tokenizer, Window(bpe_tokenizer)):
        detok = IncrementalDetokenizer(decoder)
        outs.append([detok.push(ids[:cut]), detok.flush(), detok.push(ids[cut:]), detok.flush()])
    assert outs[0] == outs[1]
    assert outs[0][1].endswith(REPLACEMENT_CHAR)


def test_ids_no_tokenizer_has(bpe_tokenizer: Any) -> None:
    """Ids past the vocabulary decode to nothing in both; a negative id raises from both."""
    vocab = bpe_tokenizer.get_vocab_size(with_added_tokens=True)
    ids = [*bpe_tokenizer.encode('{"a":1}').ids, vocab + 5]
    new, old = IncrementalDetokenizer(bpe_tokenizer), IncrementalDetokenizer(Window(bpe_tokenizer))
    assert [new.push([i]) for i in ids] == [old.push([i]) for i in ids]
    for detok in (new, old):
        with pytest.raises(OverflowError):
            detok.push([-1])
    assert not new.streams
