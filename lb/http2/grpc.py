"""gRPC's view of the edge's own answers: a trailers-only response (HTTP 200, grpc-status, grpc-message).

A gRPC client library reads the status from the grpc-status field, never from the HTTP status: a bare 429
or 503 reaches the application as "UNKNOWN: unexpected HTTP status", which no retry policy can act on.
So an answer of the edge's own (a limit, no healthy backend, a backend timeout) to a request with
content-type application/grpc* is the gRPC status the HTTP one means (the issue's mapping for 429 and
504; gRPC's doc/http-grpc-status-mapping.md for the rest), with every other field of the answer kept as
metadata: the rate-limit fields and Retry-After, which a client's retry policy can read.
"""

from __future__ import annotations

from urllib.parse import quote_from_bytes

OK, CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED = 0, 1, 2, 4, 8
INTERNAL, UNIMPLEMENTED, UNAVAILABLE, PERMISSION_DENIED, UNAUTHENTICATED = 13, 12, 14, 7, 16

_BY_HTTP = {
    400: INTERNAL,
    401: UNAUTHENTICATED,
    403: PERMISSION_DENIED,
    404: UNIMPLEMENTED,
    408: DEADLINE_EXCEEDED,
    413: RESOURCE_EXHAUSTED,
    429: RESOURCE_EXHAUSTED,
    431: RESOURCE_EXHAUSTED,
    499: CANCELLED,
    502: UNAVAILABLE,
    503: UNAVAILABLE,
    504: DEADLINE_EXCEEDED,
}

# Fields of an HTTP answer that say nothing in a trailers-only one (its body is gone; HTTP/2 frames it).
_DROPPED = frozenset({b"content-type", b"content-length", b"connection", b"keep-alive", b"transfer-encoding"})


def is_grpc(content_type: bytes | None) -> bool:
    """application/grpc, application/grpc+proto, application/grpc-web... (gRPC's PROTOCOL-HTTP2.md)."""
    return content_type is not None and content_type[:16].lower() == b"application/grpc"


def status_for(http_status: int) -> int:
    return _BY_HTTP.get(http_status, UNKNOWN)


def message(text: bytes) -> bytes:
    """grpc-message is percent-encoded (PROTOCOL-HTTP2.md: printable ASCII but '%' kept as it is)."""
    return quote_from_bytes(
        text.strip(),
        safe=" !\"#$&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~",
    ).encode()


def trailers_only(
    http_status: int, reason: bytes, fields: list[tuple[bytes, bytes]], content_type: bytes = b"application/grpc"
) -> list[tuple[bytes, bytes]]:
    """The fields of the one HEADERS block (END_STREAM, :status 200) of a trailers-only answer for an HTTP
    answer of the edge's own. fields: the answer's own, lowercase names (X-RateLimit-*, Retry-After,
    X-Request-Id... kept)."""
    out = [
        (b"content-type", content_type),
        (b"grpc-status", b"%d" % status_for(http_status)),
        (b"grpc-message", message(reason)),
    ]
    out += [(n, v) for n, v in fields if n not in _DROPPED and n[:1] != b":"]
    return out


def parse_timeout(value: bytes) -> float | None:
    """grpc-timeout (TimeoutValue TimeoutUnit, at most 8 digits) in seconds; None when malformed."""
    units = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
    digits, unit = value[:-1], value[-1:]
    if not digits.isdigit() or len(digits) > 8 or unit not in units:
        return None
    return int(digits) * units[unit]
