"""Addresses, IPv4 and IPv6 alike: `HOST:PORT` with brackets around an IPv6 host, as in URLs.

One place for the rule, so a listener, a backend URL, a log line, /status and a metric label all write
`[::1]:9001`, never the ambiguous `::1:9001`.
"""

from __future__ import annotations

import ipaddress
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
    if not sep or not host or ":" in host:  # an IPv6 address needs its brackets
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
            pass  # an IPv6-only kernel: [::] serves IPv6 only


def held(host: str, port: int) -> bool:
    """True when a socket already holds HOST:PORT, listening or bound (--workers' reserve): a bind without
    SO_REUSEPORT fails then, whatever the holder set, so every edge listener can set SO_REUSEPORT (for
    --takeover) and a second edge still learns it is not alone. SO_REUSEADDR: connections a stopped edge
    left in TIME_WAIT do not hold the port."""
    if not port:
        return False  # port 0: a free one is picked
    s = socket.socket(family(host))
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bind_options(s, host)
        s.bind((host, port))
        return False
    except OSError as e:
        import errno

        return e.errno == errno.EADDRINUSE
    finally:
        s.close()


def migrate_req() -> str:
    """The kernel's net.ipv4.tcp_migrate_req ("n/a" off Linux): 1 hands the connections queued on a closing
    SO_REUSEPORT listener to another listener on the port; 0 resets them (a --takeover's last microseconds)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_migrate_req") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def client_ip(addr: str) -> str:
    """The peer as the client knows itself: an IPv4 client of a dual-stack listener is a.b.c.d."""
    if addr.startswith("::ffff:") and "." in addr:
        return addr[7:]
    return addr


# An IPv4 client has two spellings, a.b.c.d and ::ffff:a.b.c.d (a dual-stack socket's peer, a dual-stack
# proxy's X-Forwarded-For, an operator's config): every address and network the edge compares goes
# through these two, so both spellings are one client, in one network, on either side of the comparison.
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address, an IPv4-mapped one as its IPv4 address; IPv6 compressed. ValueError if none."""
    a = ipaddress.ip_address(text)
    return (a.ipv4_mapped or a) if a.version == 6 else a


def network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A CIDR (or one address), non-strict; one inside ::ffff:0:0/96 (`::ffff:10.0.0.0/104`) as the
    IPv4 network it maps (10.0.0.0/8), so it matches the IPv4 clients it names. ValueError if none."""
    n = ipaddress.ip_network(text, strict=False)
    if isinstance(n, ipaddress.IPv6Network) and n.prefixlen >= 96 and n.subnet_of(_MAPPED):
        return ipaddress.IPv4Network((int(n.network_address) & 0xFFFFFFFF, n.prefixlen - 96))
    return n
