"""Models named by a Hugging Face Hub id (``org/name``), found in the local Hugging Face cache.

``specmask serve HuggingFaceTB/SmolLM2-135M-Instruct`` serves the snapshot that
``hf download`` (or transformers, or vLLM) already put into the
Hugging Face cache (``$HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``).
Resolution is offline (``local_files_only``): nothing is downloaded, and an id
that is not cached is a clear error naming the command that fetches it. The
snapshot directory is served as is: it must hold ``config.json``, the weights as
``*.safetensors`` and a ``tokenizer.json`` (the mask service builds its token
tables from it).
"""

from __future__ import annotations

import re
from pathlib import Path

from specmask.gpu_worker.models.errors import ModelError

# org/name with the characters the Hub allows (a revision is not part of the id here).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REQUIRED_FILES = ("config.json", "tokenizer.json")


def looks_like_repo_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec)) and not Path(spec).exists()


def cached_snapshot(repo_id: str, cache_dir: str | Path | None = None) -> str:
    """The cached snapshot directory of ``repo_id``; ``ModelError`` when it is not cached or incomplete."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = cache_dir if cache_dir is not None else constants.HF_HUB_CACHE
    try:
        path = snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)
    except LocalEntryNotFoundError:
        raise ModelError(
            f"{repo_id!r} is not in the local Hugging Face cache ({where}); this server does not download: "
            f"fetch it first with `hf download {repo_id}`"
        ) from None
    assert isinstance(path, str)
    snapshot = Path(path)
    missing = [name for name in REQUIRED_FILES if not (snapshot / name).is_file()]
    if not any(snapshot.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelError(f"the cached snapshot of {repo_id!r} ({snapshot}) lacks {', '.join(missing)}")
    return str(snapshot)
