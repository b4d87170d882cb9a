"""A fresh clone's install resolves from PyPI alone.

`make venv` (under `make demo` and `make test`) runs on machines whose pip has no
configuration. A development box's pip may add an index, a wheel folder (find-links) or a
constraint file that hold builds PyPI lacks, so a lock that resolves there may resolve nowhere
else. This check takes the Makefile's own install commands (`make -n`, so it follows the
Makefile as it changes), resolves them together in pip's isolated mode with no configuration
file and no PIP_* variable, and checks that every distribution comes from PyPI. It then renders
the image lock files from the resolved metadata: the venv such a machine builds must give the
committed files, as tests/deploy's lock check demands of it there.

It needs PyPI, and fails saying so when PyPI is unreachable: a check that skipped offline would
let a lock that resolves only on one machine pass.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PYPI_SIMPLE = "https://pypi.org/simple/pip/"
# Where PyPI serves files; anything else in the resolve came from somewhere PyPI is not.
PYPI_FILES = "https://files.pythonhosted.org/"
# A cold resolve of the whole dev install reads ~140 distributions' metadata: about a minute on
# a fast link; the bound only matters for a stalled one.
RESOLVE_TIMEOUT_S = 480
# Flags of the Makefile's installs that change what it prints, not what it resolves.
OUTPUT_FLAGS = {"-q", "--quiet"}

pytestmark = pytest.mark.slow


def clean_env() -> dict[str, str]:
    """This process's environment without pip's: no PIP_* variable, no configuration file
    (PIP_CONFIG_FILE=/dev/null is the one setting that keeps pip from reading the global file;
    --isolated alone still reads it)."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def make(*args: str) -> str:
    """``make args`` in the repository, as a fresh clone runs it: PyPI alone (TORCH_INDEX empty),
    none of the variables a calling `make test` hands its children (MAKEFLAGS carries its
    command-line variables)."""
    env = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH_INDEX"}}
    done = subprocess.run(
        ["make", "--no-print-directory", "TORCH_INDEX=", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"make {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def makefile_installs(venv: Path) -> list[list[str]]:
    """The arguments of each `pip install` the Makefile runs to build ``venv`` (pip's own upgrade left out)."""
    make(f"VENV={venv}", "constraints")  # the file the installs name: really written
    installs = []
    for line in make("-n", f"VENV={venv}", "venv").splitlines():
        words = shlex.split(line, comments=True)
        for i in range(len(words) - 2):
            if words[i : i + 3] == ["-m", "pip", "install"]:
                args = [w for w in words[i + 3 :] if w not in OUTPUT_FLAGS]
                if args != ["--upgrade", "pip"]:
                    installs.append(args)
                break
    return installs


def pypi_reachable() -> str | None:
    """None when PyPI answers; else why not."""
    try:
        with urllib.request.urlopen(PYPI_SIMPLE, timeout=30) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except OSError as exc:
        return str(exc)


def resolve(installs: list[list[str]]) -> dict[str, Any]:
    """pip's installation report for all of ``installs`` resolved together, from PyPI alone."""
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed"]
    # Wheels only: nothing is built to read its metadata, and a pin that only an sdist could
    # meet (a build step a user's machine may fail) fails here too.
    cmd += ["--only-binary=:all:", "--quiet", "--report", "-", "--timeout", "60", "--retries", "2"]
    for args in installs:
        cmd += args
    done = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S)
    if done.returncode != 0:
        down = pypi_reachable()
        where = f"PyPI is unreachable ({down}); this check needs it" if down else "PyPI answers"
        pytest.fail(
            f"the Makefile's install does not resolve from PyPI alone ({where}).\n"
            f"command: {shlex.join(cmd)}\n{done.stderr[-6000:]}"
        )
    return json.loads(done.stdout)


def load_lock() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_deploy_lock", REPO / "deploy" / "docker" / "lock.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_makefile_install_resolves_from_pypi_alone(tmp_path: Path) -> None:
    down = pypi_reachable()
    assert down is None, f"PyPI ({PYPI_SIMPLE}) is unreachable: {down}. This check resolves the install against it."
    installs = makefile_installs(tmp_path / "venv")
    # The torch install and the project's: a Makefile reshaped past this parser must not
    # leave the check resolving nothing.
    assert len(installs) >= 2 and any("-e" in args for args in installs), installs
    constraints = [args[args.index("-c") + 1] for args in installs if "-c" in args]
    assert constraints, f"the Makefile installs without the lock's constraints: {installs}"
    pins = [ln for ln in Path(constraints[0]).read_text().splitlines() if ln.strip()]
    assert pins and all("==" in ln and "+" not in ln for ln in pins), pins  # no local labels

    report = resolve(installs)
    by_name = {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}
    assert "specmask" in by_name and "torch" in by_name, sorted(by_name)
    elsewhere = {
        name: item["download_info"]["url"]
        for name, item in by_name.items()
        if name != "specmask" and not item["download_info"]["url"].startswith(PYPI_FILES)
    }
    assert not elsewhere, f"resolved from outside PyPI: {elsewhere}"
    # Every pin is in the resolve, at its version (a constraint on a package nothing requires
    # would be silently unused: the lock and the venv would have drifted apart).
    versions = {name: item["metadata"]["version"] for name, item in by_name.items()}
    used = [ln for ln in pins if canonicalize_name(ln.split("==")[0]) in versions]
    assert len(used) == len(pins), sorted(set(pins) - set(used))
    for ln in used:
        name, version = ln.split("==")
        assert versions[canonicalize_name(name)] == version, (ln, versions[canonicalize_name(name)])

    # The venv this resolve builds renders the committed lock files (tests/deploy checks
    # the installed venv the same way).
    lock = load_lock()

    def lookup(name: str) -> Any:
        meta = by_name[canonicalize_name(name)]["metadata"]
        return lock.Dist(meta["version"], list(meta.get("requires_dist", [])))

    for image in lock.IMAGES:
        committed = (REPO / "deploy" / "docker" / "requirements" / f"{image}.txt").read_text()
        assert lock.render(image, lookup) == committed, f"{image}: a PyPI-only venv renders another lock"
