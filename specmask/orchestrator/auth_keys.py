"""API keys of the orchestrator's public APIs (HTTP and gRPC): where they come from and how one is checked.

Keys come from three places, all added together:

* ``--api-key KEY`` (repeatable);
* ``--api-key-file PATH``: one key per line (blank lines and ``#`` comments skipped),
  so keys stay out of the process list;
* the environment: ``SPECMASK_API_KEY`` (one key) and ``SPECMASK_API_KEYS``
  (several, separated by commas or whitespace), e.g. from a Kubernetes Secret.

No key anywhere: the APIs are open (a local stack). With keys, every request must
carry one: HTTP ``Authorization: Bearer <key>`` (or ``x-api-key``), gRPC metadata
``authorization: Bearer <key>``; health and metrics stay open for probes. Each key
is one client for fairness (orchestrator.client_identity hashes it), so give each
tenant its own key.

This module has no server imports, so the HTTP middleware
(orchestrator.api.http.auth), the gRPC interceptor (orchestrator.api.grpc_auth)
and every command that serves (``specmask orchestrator``, ``specmask up``) share it.
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

API_KEY_ENV = "SPECMASK_API_KEY"
API_KEYS_ENV = "SPECMASK_API_KEYS"


class ApiKeyError(ValueError):
    """A key source that cannot be read (a missing file, an empty one): one line for the operator."""


def add_api_key_arguments(parser: argparse.ArgumentParser) -> None:
    """``--api-key`` and ``--api-key-file`` on a command that serves the public APIs."""
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"a key clients must send (HTTP 'Authorization: Bearer KEY', gRPC metadata 'authorization'); "
        f"repeatable, each key one client for fairness; also ${API_KEY_ENV} / ${API_KEYS_ENV} "
        "(none anywhere: no authentication)",
    )
    parser.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="a file of API keys, one per line ('#' comments and blank lines skipped)",
    )


def _read_key_file(path: str) -> list[str]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ApiKeyError(f"--api-key-file {path}: {exc.strerror or exc}") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ApiKeyError(f"--api-key-file {path}: no keys in it")
    return keys


def load_api_keys(
    keys: Iterable[str] = (), key_files: Iterable[str] = (), environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """Every key from the flags, the files and the environment, each once, in that order."""
    env = os.environ if environ is None else environ
    found: list[str] = [k.strip() for k in keys]
    if any(not k for k in found):
        raise ApiKeyError("--api-key: an empty key")
    for path in key_files:
        found += _read_key_file(path)
    found += [env.get(API_KEY_ENV, "").strip()]
    found += env.get(API_KEYS_ENV, "").replace(",", " ").split()
    return tuple(dict.fromkeys(k for k in found if k))


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys a parsed command line (``add_api_key_arguments``) and the environment name."""
    return load_api_keys(getattr(args, "api_key", ()) or (), getattr(args, "api_key_file", ()) or ())


def presented_key(pairs: Iterable[tuple[str, str]]) -> str:
    """The key a request carries (``authorization: Bearer`` or ``x-api-key``; any case), or ""."""
    for name, value in pairs:
        name = str(name).lower()
        value = str(value)
        if name == "authorization" and value[:7].lower() == "bearer ":
            return value[7:].strip()
        if name == "x-api-key" and value.strip():
            return value.strip()
    return ""


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys; empty = authentication off."""

    keys: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def accepts(self, presented: str) -> bool:
        """Whether ``presented`` is one of the keys (each compared in constant time)."""
        if not presented:
            return False
        given = presented.encode()
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(given, key.encode())
        return ok

    def allows(self, pairs: Sequence[tuple[str, str]] | Iterable[tuple[str, str]]) -> bool:
        """Whether a request with these headers / metadata may proceed."""
        return not self.enabled or self.accepts(presented_key(pairs))
