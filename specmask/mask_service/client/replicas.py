"""Which mask-service replicas exist right now: fixed addresses and DNS names.

A router is given targets. ``host:port`` is one replica (gRPC resolves the
name for its own channel). ``dns:///name:port`` is a *set* of replicas: every
address the name resolves to, e.g. a Kubernetes headless Service, which has one
A record per ready pod. Handing such a name to a single gRPC channel would send
every session to whichever pod pick_first chose, so the mask service would not
scale out; the router instead resolves it here and hashes sessions over the
answers. The answer is refreshed every ``refresh_s`` and, rate-limited, when a
replica fails; a failed lookup keeps the last good answer (DNS hiccups must not
empty the set). Lookups after the first run on a background thread: a slow DNS
server must never stall a decoding step that asks for the current set. The one
exception is ``resolve_now``, for a call that every known replica has failed.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence

logger = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
# How often a DNS target is looked up again (new pods join within this).
DNS_REFRESH_S = 10.0
# A failure-triggered lookup happens at most this often.
MIN_FORCED_REFRESH_S = 1.0


def split_host_port(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError with the reason otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """(host, port) -> a gRPC bind/dial target; IPv6 literals (``::``) get brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def resolve_all(host: str, port: int) -> list[str]:
    """Every TCP address ``host`` resolves to, as gRPC targets (``ip:port``, ``[v6]:port``), sorted."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        out.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(out)


def parse_targets(targets: Sequence[str]) -> tuple[list[str], list[tuple[str, str, int]]]:
    """(static ``host:port`` targets, [(dns target, host, port)]); ValueError naming a bad one."""
    if not targets:
        raise ValueError("at least one mask-service target is required")
    static: list[str] = []
    dns: list[tuple[str, str, int]] = []
    for target in targets:
        if target.startswith("dns:"):
            if not target.startswith(DNS_SCHEME):
                raise ValueError(f"{target!r}: only dns:///name:port is supported (no DNS authority)")
            host, port = split_host_port(target[len(DNS_SCHEME) :])
            dns.append((target, host, port))
        else:
            split_host_port(target)
            static.append(target)
    return static, dns


class ReplicaSet:
    """The current concrete replica addresses for a list of targets. Thread-safe."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        refresh_s: float = DNS_REFRESH_S,
    ) -> None:
        self._static, self._dns = parse_targets(targets)  # dns: (target, host, port)
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._answers: dict[str, list[str]] = {}  # dns target -> last good answer
        self._last_forced = 0.0
        self._current: list[str] = list(self._static)
        self._wake = threading.Event()  # a forced refresh, or close()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self._dns:
            self._resolve_now()  # the first answer before any call needs it
            self._thread = threading.Thread(target=self._run, name="replica-dns", daemon=True)
            self._thread.start()

    @property
    def has_dns(self) -> bool:
        return bool(self._dns)

    def addresses(self) -> list[str]:
        """Current replicas (static first, then resolved, no duplicates). Never blocks on DNS."""
        with self._lock:
            return list(self._current)

    def refresh(self) -> None:
        """Ask for a lookup now (after a failure); rate-limited, done on the background thread."""
        now = time.monotonic()
        with self._lock:
            if not self._dns or now - self._last_forced < MIN_FORCED_REFRESH_S:
                return
            self._last_forced = now
        self._wake.set()

    def resolve_now(self) -> list[str]:
        """Look the DNS targets up now, on the caller's thread, and return the new set. For a
        caller whose every known replica just failed: the name may answer a replica the periodic
        lookup has not seen yet (a pod that became ready after it), and giving up first would fail
        a call the tier could serve. Never on a healthy path: a slow DNS server blocks here."""
        if self._dns:
            self._resolve_now()
        return self.addresses()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._refresh_s)
            self._wake.clear()
            if self._closed:
                return
            self._resolve_now()

    def _resolve_now(self) -> None:
        answers = {}
        for target, host, port in self._dns:
            try:
                answers[target] = resolve_all(host, port)
            except OSError as exc:
                logger.warning("resolving %s failed (%s); keeping its last answer", target, exc)
        with self._lock:
            for target, found in answers.items():
                if found:
                    before = self._answers.get(target)
                    if before != found:
                        logger.info("%s -> %s", target, ", ".join(found))
                    self._answers[target] = found
            merged = list(self._static)
            for target, _, _ in self._dns:
                merged += [a for a in self._answers.get(target, []) if a not in merged]
            self._current = merged
