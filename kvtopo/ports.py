"""Ports for processes that bind them later: chosen so nothing else can take them first.

Owns `free_port`, the one way kvtopo's tools, benchmarks and tests choose a TCP port for a
process they start (a vLLM server, an operator's metrics or liveness endpoint). A port that
bind(0) returns comes from the kernel's ephemeral range, and so do the ports of every
outgoing connection and every socket bound to port 0 meanwhile: it can be taken before the
process binds it (seen: a vLLM pair's control ports after an hour of traffic; the
operator's liveness port at start under a busy CI run, "address already in use"). So the
port is chosen below that range, checked free by a bind, and never handed out twice by one
process.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
_HANDED_OUT: set[tuple[str, int]] = set()


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for outgoing connections and bind(0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = LOOPBACK) -> int:
    """A port free at `host` now, for a server that binds it later (a vLLM server's control
    API binds its port a minute or more after it is chosen).

    Chosen below the kernel's ephemeral range: a port bind(0) returns comes from that range,
    and so do the ports of every outgoing connection and of every socket the servers bind
    to port 0 meanwhile, so it can be taken before the server binds it. A side-by-side run
    lost both control ports of a pair that way ("address already in use") after an hour of
    traffic. Never the same port twice in one process."""
    high = _ephemeral_low() - 1
    low = max(1024, high - 12000)
    rng = secrets.SystemRandom()
    for _ in range(200):
        port = rng.randint(low, high)
        if (host, port) in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add((host, port))
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range
        s.bind((host, 0))
        return int(s.getsockname()[1])
