"""What the stages learned about one request (lb/proxy/pipeline.py), carried to wherever its response is
written and read by the access log (lb/ops/accesslog.py). Protocol-neutral: x.req is an
lb.http.framing.Request, whichever codec made it."""

from __future__ import annotations

import socket

from lb.http.framing import Request


class Exchange:
    """What the stages learned about one request, carried to wherever its response is written.

    The access log reads the fields after `set_cookie`; a stage that learns one (a retry: tries; the
    rules: limited_by and the client's label, key) sets it here and the log line and JSON object carry it."""

    __slots__ = (
        "req",
        "start",
        "key",
        "rl",
        "backend",
        "set_cookie",
        "proto",
        "request_id",
        "rid_sent",
        "client_ip",
        "status",
        "bytes_sent",
        "upstream_start",
        "upstream_seconds",
        "tries",
        "limited_by",
        "upgrade",
        "tunnel",
        "key_name",
        "rid_header",
        "counted",
        "slots",
        "admitted",
        "reader",
        "bytes_received",
        "upstream_status",
        "hedge",
        "route",
        "pool",
        "upstream_sock",
        "abandoned",
    )

    def __init__(self, req: Request, start: float, proto: bytes = b"http"):
        self.req, self.start = req, start
        self.proto = proto  # the scheme the client used: X-Forwarded-Proto
        self.key = ""  # who, as logs may show it (never a raw API key)
        self.key_name = None  # a known API key's configured name (lb/limiting/keys.py)
        self.slots = None  # in-flight slots to give back (lb/limiting/stage.py: release)
        self.admitted = None  # the Breaker that admitted it, to leave() at its end
        self.limited_by = ""  # the rules that rejected (or, dry-run, would have)
        self.upgrade = None  # the Upgrade value forwarded, for an allowed upgrade (lb/proxy/tunnel.py)
        self.tunnel = None  # (bytes client->backend, bytes backend->client, why it ended) after a 101
        self.rl = b""  # X-RateLimit-* (and Retry-After) header lines, when limiting
        self.backend = None
        self.set_cookie = b""
        self.request_id = b""
        self.rid_sent = None  # the id the backend must get instead of the client's (generated)
        self.rid_header = b""  # its X-Request-Id line for the client (--request-id-response), else empty
        self.client_ip = None
        self.status: int | None = None  # set once the access-log line is written
        self.bytes_sent = None  # bytes written to the client (head and body)
        self.upstream_start = 0.0
        self.upstream_seconds = None
        self.tries = 0  # backends tried: 0 when answered by the edge, more than 1 after retries
        self.counted = None  # the backend whose in-flight count this request holds (lb/proxy/forward.py)
        self.reader = None  # the connection's Reader: bytes_received
        self.bytes_received = None
        self.upstream_status = None  # the backend's status code, when one answered
        self.hedge = None  # (won|lost|failed, the other backend's URL) when hedged (lb/proxy/hedge.py)
        self.route = None  # the lb/proxy/routes.py Route it matched, None: no route (the default pool)
        self.pool = None  # the lb/upstream/pools.py Pool chosen for it
        self.upstream_sock = None  # the backend socket a try waits on (lb/proxy/tries.py), for abandon()
        self.abandoned = False  # the client reset its HTTP/2 stream: the backend's answer is for nobody

    def extra_headers(self) -> bytes:
        """What every answer of the edge's own carries: its id (--request-id-response), the rate-limit headers."""
        return self.rid_header + self.rl

    def abandon(self) -> None:
        """(the HTTP/2 connection's thread, at the client's RST_STREAM) Free the backend now, as nginx does
        on a client abort: the try blocked on its socket sees it shut and answers ClientGone, not a backend
        failure. Flag first, socket second: a try records its socket, then reads the flag (no lock needed)."""
        self.abandoned = True
        sock = self.upstream_sock
        if sock is not None:
            try:
                # socket.socket's, not SSLSocket's (which drops its TLS state under the reading thread)
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass  # closed already: the try ended
