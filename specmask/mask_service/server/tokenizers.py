"""Registry of the tokenizers a mask-service process serves.

Loaded once at startup (``warm-up is an explicit call``), each identified by
the content hash from ``tokenizer_id``. A session may ask for a larger
``vocab_size`` than the tokenizer defines (models pad their embedding), which
gives a different ``xgrammar.TokenizerInfo``; those variants are built lazily
and cached.

Stop tokens: an explicit override wins. Otherwise the ids named by
tokenizer_config.json / generation_config.json ``eos_token(_id)`` plus those
xgrammar detects that are *special added tokens* — this gives Llama-3
{128001, 128009} and Qwen3 {151643, 151645}, where xgrammar's detection alone
picks a non-special token for Qwen3 (shared/data README quirk).
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specmask.common.eos_tokens import configured_eos_ids
from specmask.common.tokenizer_id import tokenizer_id_for_path
from specmask.mask_service.errors import InvalidArgument, UnknownTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizerSource:
    """One ``--tokenizer DIR[:VOCAB_SIZE]`` flag."""

    path: str
    vocab_size: int | None = None
    stop_token_ids: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, flag: str) -> TokenizerSource:
        path, sep, size = flag.rpartition(":")
        if sep and size.isdigit() and path:
            return cls(path=path, vocab_size=int(size))
        return cls(path=flag)


@dataclass
class LoadedTokenizer:
    tokenizer_id: str
    path: str
    default_vocab_size: int
    stop_token_ids: tuple[int, ...]
    hf_tokenizer: Any  # transformers.PreTrainedTokenizerFast
    infos: dict[int, Any] = field(default_factory=dict)  # vocab_size -> xgrammar.TokenizerInfo
    lock: threading.Lock = field(default_factory=threading.Lock)


def _config_eos_ids(path: Path, hf_tokenizer: Any) -> set[int]:
    return configured_eos_ids(path, hf_tokenizer.convert_tokens_to_ids)


def load_tokenizer(source: TokenizerSource) -> LoadedTokenizer:
    """Load one HF tokenizer and build its default xgrammar TokenizerInfo."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    path = Path(source.path)
    tok_file = path / "tokenizer.json" if path.is_dir() else path
    tid = tokenizer_id_for_path(path)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_file))
    with warnings.catch_warnings():
        # xgrammar warns when it has to guess stop tokens; we refine its guess below.
        warnings.simplefilter("ignore")
        detected = xgr.TokenizerInfo.from_huggingface(hf).stop_token_ids
    if source.stop_token_ids is not None:
        stops = tuple(source.stop_token_ids)
    else:
        special = {int(i) for i, t in hf.added_tokens_decoder.items() if t.special}
        configured = _config_eos_ids(path, hf)
        chosen = configured | {i for i in detected if i in special} if configured else set(detected)
        stops = tuple(sorted(chosen))
    base_size = len(hf)
    vocab_size = source.vocab_size or base_size
    if vocab_size < base_size:
        raise InvalidArgument(f"vocab_size {vocab_size} < tokenizer size {base_size} for {path}")
    loaded = LoadedTokenizer(tid, str(path), vocab_size, stops, hf)
    _info(loaded, vocab_size)
    logger.info("tokenizer %s loaded from %s: vocab %d, stop ids %s", tid, path, vocab_size, stops)
    return loaded


def _info(tok: LoadedTokenizer, vocab_size: int) -> Any:
    import xgrammar as xgr

    with tok.lock:
        info = tok.infos.get(vocab_size)
        if info is None:
            info = xgr.TokenizerInfo.from_huggingface(
                tok.hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(tok.stop_token_ids)
            )
            tok.infos[vocab_size] = info
        return info


# Guard against a client asking for an absurd padded vocab (each variant costs
# a TokenizerInfo and its compiled grammars): padding beyond this is refused.
MAX_VOCAB_PADDING = 1 << 16


class TokenizerRegistry:
    """tokenizer_id -> loaded tokenizer; thread-safe lookups."""

    def __init__(self, sources: list[TokenizerSource]) -> None:
        self._by_id: dict[str, LoadedTokenizer] = {}
        for src in sources:
            tok = load_tokenizer(src)
            self._by_id[tok.tokenizer_id] = tok

    def ids(self) -> list[str]:
        return sorted(self._by_id)

    def get(self, tokenizer_id: str) -> LoadedTokenizer:
        tok = self._by_id.get(tokenizer_id)
        if tok is None:
            raise UnknownTokenizer(f"unknown tokenizer_id {tokenizer_id!r}; served: {self.ids()}")
        return tok

    def info(self, tokenizer_id: str, vocab_size: int | None) -> Any:
        """The xgrammar TokenizerInfo for a tokenizer at a (possibly padded) vocab size."""
        tok = self.get(tokenizer_id)
        size = vocab_size or tok.default_vocab_size
        base = len(tok.hf_tokenizer)
        if size < base or size > base + MAX_VOCAB_PADDING:
            raise InvalidArgument(f"vocab_size {size} outside [{base}, {base + MAX_VOCAB_PADDING}] for {tokenizer_id}")
        return _info(tok, size)
