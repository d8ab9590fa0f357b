"""Addresses, IPv4 and IPv6 alike: `HOST:PORT` with brackets around an IPv6 host, as in URLs.

One place for the rule, so a listener, a backend URL, a log line, /status and a metric label all write
`[::1]:9001`, never the ambiguous `::1:9001`.
"""

from __future__ import annotations

import socket


def split_hostport(value: str) -> tuple[str, str] | None:
    """("host", "port") from `host:port` or `[v6]:port`; None when it is neither."""
    value = str(value)
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or not rest.startswith(":") or not host:
            return None
        return host, rest[1:]
    host, sep, port = value.rpartition(":")
    if not sep or not host or ":" in host:      # an IPv6 address needs its brackets
        return None
    return host, port


def hostport(host: str, port: int) -> str:
    """`127.0.0.1:80`, `[::1]:80`: how every address is written."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_options(sock: socket.socket, host: str) -> None:
    """`[::]` is dual-stack where the OS allows (IPv4 clients arrive as ::ffff:a.b.c.d, unmapped
    below); any other IPv6 address serves IPv6 only. Set explicitly: the system default varies."""
    if sock.family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
        try:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if host == "::" else 1)
        except OSError:
            pass    # an IPv6-only kernel: [::] serves IPv6 only


def client_ip(addr: str) -> str:
    """The peer as the client knows itself: an IPv4 client of a dual-stack listener is a.b.c.d."""
    if addr.startswith("::ffff:") and "." in addr:
        return addr[7:]
    return addr
