"""Small byte-level BPE tokenizer for the toy models.

Byte-level (GPT-2 style): every string, any UTF-8 included, is representable
with no unknown token, and xgrammar recognises the vocabulary as BYTE_LEVEL
from the ByteLevel decoder. GPT-2's pre-tokenisation regex splits letters,
digits and punctuation runs apart, so merges form JSON punctuation such as
`{"`, `":"`, `","` and whole keys such as `email`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|eos|>"
# Special tokens come first, so EOS is id 0 in every toy vocabulary.
SPECIAL_TOKENS = (EOS_TOKEN,)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` tokens (specials and 256 bytes included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets byte-exact; it adds no BOS/EOS tokens.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def to_hf(tok: Tokenizer, model_max_length: int):
    """Wrap as a transformers fast tokenizer (EOS doubles as PAD; no BOS)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json loadable by AutoTokenizer and xgrammar."""
    to_hf(tok, model_max_length).save_pretrained(str(out_dir))
