"""Control endpoints: where a worker's control API listens, and which endpoints may be dialled.

Owns the one rule that the operator and every worker apply before they dial an endpoint
(with a bearer token attached): an endpoint is an IP literal and a port, ``10.0.0.7:8975`` or
``[fd00::7]:8975``, and nothing else. No host names (no DNS answer decides where a token
goes), no path, query, fragment, userinfo, percent-escapes or zone ids, no unspecified,
multicast, broadcast or link-local address (``169.254.169.254`` is the cloud metadata
service; no pod has such an IP). `Endpoint` formats itself back (IPv6 bracketed) and builds
the URL of a route, so a URL is never made by pasting a string a pod author wrote.

Also owns how the operator derives a worker's endpoint from its pod (`pod_endpoint`): the
pod's IP (`status.podIPs`) and the control port; the pod's `kvtopo.dev/control-endpoint`
annotation may name another port, or say the engine is not serving yet (``pending``), and
may name a host only where the operator runs with its development flag.

Imports only the standard library; used by `agent` (peer metadata fetches), the operator
(`kvtopo_operator.handlers`, `kvtopo_operator.workers`) and kvtopo's tools.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

MAX_ENDPOINT_LEN = 64
"""Longer than any IP literal with a port; anything longer is refused unread."""

NOT_SERVING = "pending"
"""The annotation value that says the engine's control API is not up yet."""

_FORBIDDEN_CHARS = frozenset("/?#@%\\ \t\r\n")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class EndpointError(ValueError):
    """An endpoint that must not be dialled; the message says why (and what is allowed)."""


@dataclass(frozen=True)
class Endpoint:
    """An IP literal and a port: all a control endpoint may be."""

    ip: IPAddress
    port: int

    def __str__(self) -> str:
        host = f"[{self.ip}]" if self.ip.version == 6 else str(self.ip)
        return f"{host}:{self.port}"

    @property
    def host(self) -> str:
        """The IP as a socket bind address (no brackets)."""
        return str(self.ip)

    def url(self, path: str) -> str:
        """``http://<endpoint><path>``; `path` is the caller's own route, never pod input."""
        if not path.startswith("/"):
            raise ValueError("a route starts with /")
        return f"http://{self}{path}"


def parse_ip(text: str) -> IPAddress:
    """An IP literal that may be dialled; EndpointError otherwise."""
    if not text or len(text) > MAX_ENDPOINT_LEN or any(c in _FORBIDDEN_CHARS for c in text):
        raise EndpointError(f"{text[:MAX_ENDPOINT_LEN]!r} is not an IP address")
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        raise EndpointError(f"{text!r} is not an IP address (host names are not dialled)") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        raise EndpointError(f"{text!r}: IPv4-mapped IPv6 addresses are not dialled")
    if ip.is_unspecified or ip.is_multicast or ip.is_link_local:
        raise EndpointError(f"{text!r} is an unspecified, multicast or link-local address")
    if isinstance(ip, ipaddress.IPv4Address) and ip == ipaddress.IPv4Address("255.255.255.255"):
        raise EndpointError(f"{text!r} is the broadcast address")
    return ip


def parse_port(text: str) -> int:
    """A TCP port 1..65535 written as plain digits; EndpointError otherwise."""
    if not text.isascii() or not text.isdigit() or len(text) > 5 or not 0 < int(text) < 65536:
        raise EndpointError(f"{text[:16]!r} is not a port (1..65535)")
    return int(text)


def parse_endpoint(text: str) -> Endpoint:
    """``ip:port`` or ``[ipv6]:port``; EndpointError, saying why, for anything else (a path,
    query, fragment, userinfo, host name, a bare IPv6 address without brackets)."""
    if not isinstance(text, str) or not text:
        raise EndpointError("an endpoint is ip:port or [ipv6]:port, not empty")
    if len(text) > MAX_ENDPOINT_LEN:
        raise EndpointError(f"an endpoint is at most {MAX_ENDPOINT_LEN} characters")
    if any(c in _FORBIDDEN_CHARS for c in text):
        raise EndpointError(
            f"{text!r} is not ip:port (no path, query, fragment, userinfo or escapes)"
        )
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise EndpointError(f"{text!r} is not [ipv6]:port")
        ip = parse_ip(host)
        if ip.version != 6:
            raise EndpointError(f"{text!r}: only IPv6 addresses are bracketed")
        return Endpoint(ip, parse_port(rest[1:]))
    host, sep, port = text.rpartition(":")
    if not sep or ":" in host:
        raise EndpointError(f"{text!r} is not ip:port (write IPv6 as [ipv6]:port)")
    ip = parse_ip(host)
    return Endpoint(ip, parse_port(port))


def pod_endpoint(
    pod_ips: Sequence[str], annotation: str, control_port: int, *, allow_host: bool = False
) -> tuple[Endpoint | None, str]:
    """Where the operator reaches a pod's worker: (endpoint, "") when it may be dialled,
    (None, "") while the engine is not serving (no pod IP yet, or the annotation says
    ``pending``), (None, why) when the annotation is refused (it is then never dialled).

    The endpoint is the pod's first IP (`status.podIPs`) at `control_port`; the annotation
    may name another port (``8976``) and, only with `allow_host` (the operator's development
    flag), a whole ``ip:port``."""
    value = annotation.strip()
    if value == NOT_SERVING:
        return None, ""
    port = control_port
    if value:
        digits = value[1:] if value.startswith(":") else value
        if digits.isascii() and digits.isdigit():
            try:
                port = parse_port(digits)
            except EndpointError as exc:
                return None, f"refused control-endpoint annotation: {exc}"
        elif allow_host:
            try:
                return parse_endpoint(value), ""
            except EndpointError as exc:
                return None, f"refused control-endpoint annotation: {exc}"
        else:
            return None, (
                f"refused control-endpoint annotation {value[:80]!r}: it may name only a port "
                f"(the worker is reached at the pod IP) or {NOT_SERVING!r}"
            )
    if not pod_ips:
        return None, ""
    try:
        ip = parse_ip(pod_ips[0])
    except EndpointError as exc:
        return None, f"the pod IP cannot be dialled: {exc}"
    return Endpoint(ip, port), ""
