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

MAX_KEY = 256


class Identifier:
    def __init__(self, trusted_cidrs=()):
        self.nets = [ipaddress.ip_network(c, strict=False) for c in trusted_cidrs]

    def trusted(self, addr: str) -> bool:
        if not self.nets:
            return False
        try:
            ip = ipaddress.ip_address(addr)
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
                ipaddress.ip_address(hop)
            except ValueError:
                return client          # a malformed entry: believe no further to the left
            client = hop
            if not self.trusted(hop):
                return hop
        return client                  # every hop trusted: the leftmost is the original client

    @staticmethod
    def label(api_key: bytes | None, ip: str) -> str:
        """The client as logs may show it (no limiting configured). ValueError if the key is too long."""
        if api_key is None:
            return "ip:" + ip
        if len(api_key) > MAX_KEY:
            raise ValueError(f"X-Api-Key longer than {MAX_KEY} bytes")
        from .keys import key_label
        return key_label(api_key)


def kind_name(text: str) -> str:
    """An identity as configured -> as the limiter sees it: "key:NAME" or "ip:ADDRESS" (canonical).

    A bare value (the form `--key-limit` and `[limits.keys]` have always taken) keeps working: an IP
    address is an ip:, anything else a key:. Write "key:10.0.0.5" for a key that looks like an address.
    """
    kind, sep, value = text.partition(":")
    if sep and kind in ("key", "ip"):
        if kind == "ip":
            return "ip:" + str(ipaddress.ip_address(value.strip()))   # ValueError when not an address
        if not value:
            raise ValueError(f"{text!r}: key: needs a name")
        return text
    try:
        return "ip:" + str(ipaddress.ip_address(text.strip()))
    except ValueError:
        return "key:" + text
