"""The edge's own replies (lb/proxy/replies.py): one builder, and HTTP/1.1's encoding of it byte for byte what
framing.own_response writes (the answers the listener and admin still write with it must not differ)."""

from __future__ import annotations

import pytest

from lb.http.framing import own_response, parse_request
from lb.proxy import replies
from lb.proxy.exchange import Exchange


def exchange(method: bytes = b"GET", rl: bytes = b"", rid: bytes = b"") -> Exchange:
    x = Exchange(parse_request(method + b" / HTTP/1.1\r\nHost: h"), 0.0)
    x.rl, x.rid_header = rl, rid
    return x


RL = b"X-RateLimit-Limit: 10\r\nX-RateLimit-Remaining: 0\r\nX-RateLimit-Reset: 3\r\nRetry-After: 3\r\n"


@pytest.mark.parametrize("method, status, reason, keep, rl, rid", [
    (b"GET", 429, "rate limit exceeded", True, RL, b""),
    (b"GET", 503, "no healthy backend", False, b"", b"X-Request-Id: abc\r\n"),
    (b"HEAD", 502, "backend unreachable", True, RL, b"X-Request-Id: abc\r\n"),
    (b"POST", 413, "request body too large", False, b"", b""),
    (b"GET", 599, "r\u00e9ason", True, b"", b""),
])
def test_the_http11_encoding_is_own_responses_bytes(method, status, reason, keep, rl, rid):
    x = exchange(method, rl, rid)
    assert replies.h1(replies.build(x, status, reason, keep)) == \
        own_response(status, reason, close=not keep, extra=rid + rl, head_only=method == b"HEAD")


def test_a_reply_carries_the_exchanges_headers_as_fields_for_other_codecs():
    r = replies.build(exchange(rl=RL, rid=b"X-Request-Id: abc\r\n"), 429, "rate limit exceeded", False)
    assert (r.status, r.phrase, r.body, r.close) == (429, b"Too Many Requests", b"rate limit exceeded\n", True)
    assert r.headers == [(b"X-Request-Id", b"abc"), (b"X-RateLimit-Limit", b"10"), (b"X-RateLimit-Remaining", b"0"),
                         (b"X-RateLimit-Reset", b"3"), (b"Retry-After", b"3")]


def test_a_refusal_closes_and_has_no_exchange():
    assert replies.h1(replies.refusal(400, "malformed request line")) == \
        own_response(400, "malformed request line", close=True)
