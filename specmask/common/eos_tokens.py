"""The end-of-sequence tokens a model directory names in its configuration files.

``tokenizer_config.json`` names ``eos_token`` (a token's text) and
``generation_config.json`` ``eos_token_id`` (one id or a list: gpt-oss ends a tool
call with ``<|call|>``, a stop token beside ``<|return|>``). The mask service's
stop set and the orchestrator's reading of a tool format's markers both start
from this one reading.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

CONFIG_FILES = ("tokenizer_config.json", "generation_config.json")


def configured_eos_ids(path: str | Path, token_id: Callable[[str], Any]) -> set[int]:
    """The ids ``path``'s config files name as end of sequence (``path``: the model directory,
    or a file in it). ``token_id``: a token's text -> its id (anything but a non-negative int:
    not in the vocabulary)."""
    path = Path(path)
    ids: set[int] = set()
    directory = path if path.is_dir() else path.parent
    for name in CONFIG_FILES:
        f = directory / name
        if not f.is_file():
            continue
        cfg = json.loads(f.read_text())
        eos = cfg.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            tid = token_id(eos)
            if isinstance(tid, int) and tid >= 0:
                ids.add(tid)
        eos_id = cfg.get("eos_token_id")
        if isinstance(eos_id, int):
            ids.add(eos_id)
        elif isinstance(eos_id, list):
            ids.update(int(x) for x in eos_id)
    return ids
