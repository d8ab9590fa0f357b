"""The edge's own replies (Envoy's sendLocalReply): ONE place decides what a 413, 429, 502, 503 ... carries.

Every answer that does not come from a backend is built here from the Exchange -- its status, the reason
as a short text/plain body, the rate-limit headers (and Retry-After) the limit stage left in x.rl, the
request id (--request-id-response), Connection: close when the connection ends -- and a Downstream only
encodes it for its protocol (lb/proxy/downstream.py). HTTP/1.1's encoding is byte for byte what
lb/http/framing.own_response writes (that function stays for the listener and admin, which have no
Exchange).
"""

from __future__ import annotations

from http import HTTPStatus

from lb.http.framing import http_date

CONTENT_TYPE = b"text/plain; charset=utf-8"


def phrase(status: int) -> bytes:
    return HTTPStatus(status).phrase.encode() if status in HTTPStatus._value2member_map_ else b"Error"


class LocalReply:
    """status, its reason phrase, the headers in order [(name, value)] (Date and framing excluded: the
    codec writes those), the body, and whether the connection closes after it (an HTTP/1.1 codec writes
    Connection: close; HTTP/2 ignores it). head_only: a HEAD's answer (the body's length, not its bytes)."""

    __slots__ = ("status", "phrase", "headers", "body", "close", "head_only", "extra")

    def __init__(self, status: int, body: bytes, extra: bytes, close: bool, head_only: bool):
        self.status, self.phrase, self.body, self.close, self.head_only = status, phrase(status), body, close, head_only
        self.extra = extra  # the same headers as HTTP/1.1 lines (the H1 codec's fast copy)
        self.headers = _pairs(extra)


def build(x, status: int, reason: str, keep: bool) -> LocalReply:
    """The reply to the exchange x: what every answer of the edge's own carries (its id, the rate-limit
    headers and Retry-After), a text/plain reason."""
    return LocalReply(status, body(reason), x.rid_header + x.rl, not keep, x.req.method == b"HEAD")


def refusal(status: int, reason: str, extra: bytes = b"") -> LocalReply:
    """The answer to a request that could not be read (no Exchange: a bad or late head), then a close.
    extra: its X-Request-Id line, when asked for."""
    return LocalReply(status, body(reason), extra, True, False)


def body(reason: str) -> bytes:
    return reason.encode("utf-8", "replace") + b"\n"


def h1(r: LocalReply) -> bytes:
    """An HTTP/1.1 encoding of r (the bytes framing.own_response writes)."""
    head = b"HTTP/1.1 %d %s\r\nDate: %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s%s\r\n" % (
        r.status,
        r.phrase,
        http_date(),
        CONTENT_TYPE,
        len(r.body),
        r.extra,
        b"Connection: close\r\n" if r.close else b"",
    )
    return head if r.head_only else head + r.body


def _pairs(lines: bytes) -> list[tuple[bytes, bytes]]:
    out = []
    for line in lines.split(b"\r\n"):
        if line:
            name, _, value = line.partition(b":")
            out.append((name, value.strip()))
    return out
