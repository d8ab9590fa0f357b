"""Who is asking: the X-Api-Key when present, else the client's IP address.

The IP is the socket peer, unless the peer is a trusted proxy: then X-Forwarded-For is walked from the
right, skipping trusted addresses, and the first untrusted one is the client (nginx's
`real_ip_recursive on`); when every hop is trusted, the leftmost entry is the original client. A client
that is not a trusted proxy cannot choose its identity by sending X-Forwarded-For.

Keys and addresses live in separate namespaces ("key:..." / "ip:..."), so an API key that looks like
an address cannot spend another client's quota.
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
    def limiter_key(api_key: bytes | None, ip: str) -> tuple[str, str]:
        """(limiter key, the value per-key overrides are matched against). ValueError if too long."""
        if api_key is not None:
            if len(api_key) > MAX_KEY:
                raise ValueError(f"X-Api-Key longer than {MAX_KEY} bytes")
            k = api_key.decode("latin-1")
            return "key:" + k, k
        return "ip:" + ip, ip
