"""Stable content identity of a HuggingFace tokenizer (no torch, no transformers).

Clients and the server must agree on which tokenizer a session uses without
sharing paths (the server may run in another container), so a tokenizer is
named by a hash of the files that determine token ids and stop tokens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# Files whose bytes define the vocabulary and special tokens. Others (README,
# chat templates in separate files) do not change token ids.
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# 128 bits of sha256: collisions are not a practical concern, ids stay short in logs.
_ID_HEX_CHARS = 32


def tokenizer_files(path: str | Path) -> list[Path]:
    """The identity-defining files of a tokenizer dir (or a lone tokenizer.json)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer path does not exist: {p}")
    files = [p / name for name in TOKENIZER_FILES if (p / name).is_file()]
    if not any(f.name == "tokenizer.json" for f in files):
        raise FileNotFoundError(f"no tokenizer.json in {p}")
    return files


def tokenizer_id_for_path(path: str | Path) -> str:
    """Return ``"tok-" + hex digest`` of the tokenizer's defining files.

    The digest covers file names and contents in a fixed order, so the same
    tokenizer copied elsewhere gets the same id, and any edit changes it.
    """
    h = hashlib.sha256()
    for f in tokenizer_files(path):
        data = f.read_bytes()
        h.update(f.name.encode())
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return "tok-" + h.hexdigest()[:_ID_HEX_CHARS]
