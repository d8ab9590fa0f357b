"""One client connection: what every exchange on it shares, made once when it is accepted.

HTTP/1.1's connection loop (lb/proxy/edge.py) makes one per connection and hands it to every request on
it; HTTP/2's driver makes one per connection and hands it to every stream. The stages read the peer from
here rather than from a row of parameters threaded through each call.
"""

from __future__ import annotations

import socket


class ClientConn:
    """sock: the socket the client's bytes come and go on (an SSLSocket over TLS);
    reader: its lb.http.framing.Reader (None for HTTP/2 streams: their bytes are the codec's);
    peer / peer_ip: the address the edge saw (bytes for X-Forwarded-For, str for logs and keys);
    peer_trusted: whether the peer is a trusted proxy (its X-Forwarded-For is believed), decided by the
    Identifier current when it is asked (Edge refreshes it per reload);
    over_tls / scheme: b"https" when it came over the edge's TLS, for X-Forwarded-Proto;
    cert: the verified client certificate (lb/http/tls.py), or None;
    accepted: the socket EdgeServer accepted and counts (the TCP socket under sock)."""

    __slots__ = (
        "sock",
        "reader",
        "peer",
        "peer_ip",
        "peer_trusted",
        "over_tls",
        "scheme",
        "cert",
        "accepted",
        "identifier",
    )

    def __init__(
        self,
        sock: socket.socket | None,
        peer_ip: str,
        over_tls: bool = False,
        reader=None,
        cert=None,
        accepted: socket.socket | None = None,
        peer_trusted: bool = False,
    ):
        self.sock = sock
        self.reader = reader
        self.peer_ip = peer_ip
        self.peer = peer_ip.encode()
        self.peer_trusted = peer_trusted
        self.over_tls = over_tls
        self.scheme = b"https" if over_tls else b"http"
        self.cert = cert
        self.accepted = accepted if accepted is not None else sock
        self.identifier = None  # the Identifier peer_trusted was decided by (re-asked after a reload)

    def trust(self, identifier) -> bool:
        """peer_trusted, as `identifier` (the current configuration's) decides it: asked once per
        connection and per reload."""
        if identifier is not self.identifier:
            self.identifier = identifier
            self.peer_trusted = identifier.trusted(self.peer_ip)
        return self.peer_trusted
