"""Who is asking: the X-Api-Key when present, else the client's IP address.

The IP is the socket peer, unless the peer is a trusted proxy: then X-Forwarded-For is walked from the
right, skipping trusted addresses, and the first untrusted one is the client (nginx's
`real_ip_recursive on`); when every hop is trusted, the leftmost entry is the original client. A client
that is not a trusted proxy cannot choose its identity by sending X-Forwarded-For.

Keys and addresses live in separate namespaces ("key:..." / "ip:..."), so an API key that looks like
an address cannot spend another client's quota -- nor claim an address's override: overrides, exempt
entries and known keys name their kind too (`kind_name`).
"""

from __future__ import annotations

import ipaddress

from lb import netaddr
from lb.limiting.keys import key_label

MAX_KEY = 256


# The address X-Forwarded-For names, as one value: an IPv4-mapped IPv6 address (what a dual-stack proxy
# writes for an IPv4 client, ::ffff:a.b.c.d) is that IPv4 address, as the socket peer is
# (netaddr.client_ip); any IPv6 spelling is the compressed one. ValueError when it is no address.
_address = netaddr.ip


class Identifier:
    def __init__(self, trusted_cidrs=()):
        self.nets = [netaddr.network(c) for c in trusted_cidrs]  # ::ffff:10.0.0.0/104 is 10.0.0.0/8

    def trusted(self, addr: str) -> bool:
        if not self.nets:
            return False
        try:
            ip = _address(addr)
        except ValueError:
            return False
        return any(ip in n for n in self.nets)

    def client_ip(self, peer: str, peer_trusted: bool, xff: bytes | None) -> str:
        if not peer_trusted or not xff:
            return peer
        hops = [h.strip() for h in xff.decode("latin-1").split(",")]
        client = peer
        for hop in reversed(hops):
            try:
                client = str(_address(hop))  # one spelling per client: its limits, exempt, log line
            except ValueError:
                return client  # a malformed entry: believe no further to the left
            if not self.trusted(client):
                return client
        return client  # every hop trusted: the leftmost is the original client

    @staticmethod
    def label(api_key: bytes | None, ip: str) -> str:
        """The client as logs may show it (no limiting configured). ValueError if the key is too long."""
        if api_key is None:
            return "ip:" + ip
        if len(api_key) > MAX_KEY:
            raise ValueError(f"X-Api-Key longer than {MAX_KEY} bytes")
        return key_label(api_key)


def kind_name(text: str, ipv6_prefix: int = 128) -> str:
    """An identity as configured -> as the limiter sees it: "key:NAME" or "ip:ADDRESS" (canonical).

    A bare value (the form `--key-limit` and `[limits.keys]` have always taken) keeps working: an IP
    address is an ip:, anything else a key:. Write "key:10.0.0.5" for a key that looks like an address.
    With IPv6 clients keyed by prefix (ipv6_prefix < 128), an IPv6 address names its prefix's identity
    ("ip:2001:db8:1:2::/64", as ip_key writes it), and so does that prefix written as a CIDR.
    """
    kind, sep, value = text.partition(":")
    if sep and kind in ("key", "ip"):
        if kind == "ip":
            return _ip_ident(value.strip(), ipv6_prefix)  # ValueError when not an address
        if not value:
            raise ValueError(f"{text!r}: key: needs a name")
        return text
    try:
        return _ip_ident(text.strip(), ipv6_prefix)
    except ValueError:
        if "/" in text and ":" in text:  # an IPv6 CIDR of the wrong length is a mistake, not a key
            raise
        return "key:" + text


def _ip_ident(text: str, ipv6_prefix: int) -> str:
    if "/" not in text:
        return ip_key(str(netaddr.ip(text)), ipv6_prefix)
    n = netaddr.network(text)
    if n.version == 6 and n.prefixlen == ipv6_prefix < 128:
        return f"ip:{n}"
    raise ValueError(
        f"{text!r}: a network names a client only as an IPv6 /{ipv6_prefix} "
        f"(the ipv6_prefix clients are keyed by); otherwise write an address"
    )


def ip_key(ip: str, ipv6_prefix: int = 128) -> str:
    """The limiter identity of a client address: "ip:ADDRESS", or for IPv6 "ip:NETWORK/PREFIX" when
    clients are keyed by prefix (`[limits] ipv6_prefix`, default 64). Any IPv6 client holds at least a
    /64 and can send from any address in it; keyed per address, it would mint a fresh bucket per
    request (issue 29: 398 of 399 admitted at 5/s). ip is as the edge identified it (an IPv4-mapped
    address is already its IPv4 one: netaddr.client_ip, Identifier.client_ip)."""
    if ":" not in ip or not 0 < ipv6_prefix < 128:
        return "ip:" + ip
    key = _v6_keys.get((ip, ipv6_prefix))
    if key is None:
        if len(_v6_keys) >= 4096:
            _v6_keys.clear()  # bounded: a rotating client costs one computation per address
        try:
            key = "ip:" + str(ipaddress.IPv6Network((ip, ipv6_prefix), strict=False))
        except ValueError:
            key = "ip:" + ip
        _v6_keys[(ip, ipv6_prefix)] = key
    return key


_v6_keys: dict = {}
