"""Start-up checks of the server processes: operator mistakes become one-line errors.

A server that finds a mistake in its flags (a missing tokenizer, a port already
taken) raises ``StartupError`` before it loads anything slow (Ray, models);
``specmask`` prints ``specmask <command>: error: <message>`` and exits with
``EXIT_USAGE``, with no traceback. Crashes that are bugs still show theirs.

Port flags share one convention across subcommands (``port_flag``):
``-1`` = off, ``0`` = a free port picked at bind time (logged), else that port.
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Iterable
from pathlib import Path

# Exit status for a refused configuration (argparse uses 2 for bad flags too).
EXIT_USAGE = 2
PORT_OFF = -1


class StartupError(Exception):
    """A configuration the process cannot start with; the message is the whole story."""


def port_flag(value: int | None) -> int | None:
    """A port flag's value -> None (off), 0 (pick one) or the port; StartupError when out of range."""
    if value is None or value == PORT_OFF:
        return None
    if not 0 <= value <= 65535:
        raise StartupError(f"port {value} is out of range (use 1-65535, 0 for a free port, -1 for off)")
    return value


def check_ports_free(host: str, ports: Iterable[tuple[str, int | None]]) -> None:
    """Each named port can be bound on ``host`` now, and no two flags name the same one.

    Binds and releases each, as the server's own bind would meet it.
    Port 0 and None are skipped (a free port is picked later; None is off).
    """
    seen: dict[int, str] = {}
    for name, port in ports:
        if not port:
            continue
        if port in seen:
            raise StartupError(f"{name} and {seen[port]} both name port {port}")
        seen[port] = name
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # SO_REUSEADDR as gRPC and the metrics server set it: a port left in TIME_WAIT
            # by a restarted server is free to them, only a live listener is not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host.strip("[]"), port))
            except OSError as exc:
                reason = _BIND_ERRORS.get(exc.errno or 0, exc.strerror)
                raise StartupError(f"{name} {port} on {host}: {reason}") from None


_BIND_ERRORS = {
    errno.EADDRINUSE: "already in use",
    errno.EACCES: "permission denied (ports below 1024 are privileged)",
    errno.EADDRNOTAVAIL: "the host is not an address of this machine",
}


def check_tokenizer(path: str, what: str = "tokenizer") -> None:
    """``path`` is a HF model/tokenizer dir with a readable tokenizer.json, or such a file."""
    p = Path(path)
    if not p.exists():
        raise StartupError(f"{what} {path}: no such file or directory")
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise StartupError(f"{what} {path}: no tokenizer.json in this directory")
    try:
        with open(file, "rb") as f:
            json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise StartupError(f"{what} {file}: not a readable tokenizer.json ({exc})") from None


def check_model_dir(path: str, what: str, *, tokenizer: bool = True) -> None:
    """``path`` is a HF model dir: config.json, and a tokenizer unless ``tokenizer`` is False
    (a draft may share the target's). The workers load the weights themselves."""
    p = Path(path)
    if not p.is_dir():
        raise StartupError(f"{what} {path}: not a directory")
    if not (p / "config.json").is_file():
        raise StartupError(f"{what} {path}: no config.json (not a Hugging Face model directory)")
    if tokenizer:
        check_tokenizer(path, what)
