"""lb/http/plan.py and the one-pass parsers' fast path: byte tables, no sockets.

Each head is written twice, from slices of the received bytes (the fast path, `spans` set) and field by
field (the same head with its `headers` set again, which drops the raw bytes): the two must agree, and
with the bytes the table states."""

import pytest

from lb.http.framing import HttpError, NOT_RELAYED, UpstreamError, not_relayed, parse_request, parse_response
from lb.http.plan import request_fields, request_head, response_fields, response_plan
from lb.proxy.tries import _REPLACED, _REPLACED_TRUSTED


def slow(head):
    """The same parsed head, made to take the field-by-field path."""
    head.headers = list(head.headers)
    assert head.spans is None and head.raw is None
    return head


NGINX = (b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 15:00:00 GMT\r\n"
         b"Content-Type: text/html\r\nContent-Length: 615\r\nConnection: keep-alive\r\nETag: \"63ce5b3c-267\"")

# (response head, skip, limiting, the fields the client gets, whether the parser found it canonical)
RESPONSES = [
    (NGINX, NOT_RELAYED, False,
     b"Server: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 15:00:00 GMT\r\nContent-Type: text/html\r\n"
     b"Content-Length: 615\r\nETag: \"63ce5b3c-267\"\r\n", True),
    (b"HTTP/1.1 200 OK\r\ncontent-LENGTH: 5\r\nX-A: b", NOT_RELAYED, False, b"Content-Length: 5\r\nX-A: b\r\n", True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\nX-A: b", NOT_RELAYED, False, b"Content-Length: 5\r\nX-A: b\r\n", True),
    (b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nX-A: b", NOT_RELAYED, False, b"X-A: b\r\n", True),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nTrailer: X\r\n"
     b"Upgrade: h2c\r\nProxy-Authenticate: Basic\r\nTransfer-Encoding: chunked\r\nTe-X: kept",
     NOT_RELAYED, False, b"Te-X: kept\r\n", True),
    # Connection names a field the parser did not locate: written field by field, that field dropped
    (b"HTTP/1.1 200 OK\r\nConnection: X-Hop, close\r\nX-Hop: 1\r\nX-Keep: 2\r\nContent-Length: 0",
     NOT_RELAYED, False, b"X-Keep: 2\r\nContent-Length: 0\r\n", True),
    # the edge writes its own rate-limit fields and X-Request-Id: the backend's are dropped
    (b"HTTP/1.1 200 OK\r\nX-RateLimit-Limit: 9\r\nX-Ratelimit-Whatever: 1\r\nRateLimit: x\r\nX-Request-Id: b1\r\n"
     b"Content-Length: 0", not_relayed(b"X-RateLimit-Limit: 5\r\nRateLimit: y\r\n", b"X-Request-Id: e\r\n"), True,
     b"Content-Length: 0\r\n", True),
    # ... and kept when it does not
    (b"HTTP/1.1 200 OK\r\nX-RateLimit-Limit: 9\r\nX-Request-Id: b1\r\nContent-Length: 0", NOT_RELAYED, False,
     b"X-RateLimit-Limit: 9\r\nX-Request-Id: b1\r\nContent-Length: 0\r\n", True),
    # not canonical (blanks around a value, no blank after the colon, an empty value): normalised
    (b"HTTP/1.1 200 OK\r\nX-A:  b \r\nX-B:c\r\nX-C:\r\nContent-Length: 1", NOT_RELAYED, False,
     b"X-A: b\r\nX-B: c\r\nX-C: \r\nContent-Length: 1\r\n", False),
    (b"HTTP/1.0 200 OK\r\nX-A: b\tc", NOT_RELAYED, False, b"X-A: b\tc\r\n", True),
    (b"HTTP/1.1 304 Not Modified", NOT_RELAYED, False, b"", True),
    (b"http/1.1 200 OK\r\nX-A: b", NOT_RELAYED, False, b"X-A: b\r\n", False),      # lowercase: line by line
]


@pytest.mark.parametrize("head,skip,limiting,want,fast", RESPONSES)
def test_the_relayed_fields_from_slices_equal_the_rebuilt_ones(head, skip, limiting, want, fast):
    rh = parse_response(head)
    assert (rh.spans is not None) == fast
    assert bytes(response_fields(rh, skip, limiting)) == want
    assert bytes(response_fields(slow(parse_response(head)), skip, limiting)) == want


# (response head, request method, HTTP/1.0 client, whether the client would keep, what follows the fields, mode, keep)
PLANS = [
    (NGINX, b"GET", False, True, b"\r\n", "length", True),
    (NGINX, b"HEAD", False, True, b"\r\n", "none", True),
    (NGINX, b"GET", False, False, b"Connection: close\r\n\r\n", "length", False),
    (NGINX, b"GET", True, True, b"Connection: keep-alive\r\n\r\n", "length", True),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", b"GET", False, True, b"Transfer-Encoding: chunked\r\n\r\n",
     "chunked", True),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", b"GET", True, True, b"Connection: close\r\n\r\n", "chunked",
     False),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked", b"GET", False, True,
     b"Transfer-Encoding: gzip, chunked\r\n\r\n", "chunked", True),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip", b"GET", False, True,
     b"Transfer-Encoding: gzip\r\nConnection: close\r\n\r\n", "raw", False),
    (b"HTTP/1.1 200 OK\r\nX-A: b", b"GET", False, True, b"Transfer-Encoding: chunked\r\n\r\n", "eof", True),
    (b"HTTP/1.1 204 No Content", b"GET", False, True, b"\r\n", "none", True),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x", b"GET", False, True, b"Connection: close\r\n\r\n", "none",
     False),
]


@pytest.mark.parametrize("head,method,http10,keep,tail,mode,kept", PLANS)
def test_the_response_plan_names_the_body_mode_and_the_connection(head, method, http10, keep, tail, mode, kept):
    for rh in (parse_response(head), slow(parse_response(head))):
        out, m, k = response_plan(rh, method, http10, keep, NOT_RELAYED, False, b"X-Edge: 1\r\n")
        status_line = head.split(b"\r\n", 1)[0]
        fields = bytes(response_fields(rh, NOT_RELAYED, False))
        assert bytes(out) == b"HTTP/1.1" + status_line[8:] + b"\r\n" + fields + b"X-Edge: 1\r\n" + tail
        assert (m, k) == (mode, kept)


@pytest.mark.parametrize("head,skip,limiting,want,fast", RESPONSES)
def test_the_plans_head_is_the_status_line_and_the_relayed_fields_whichever_path_wrote_it(head, skip, limiting, want,
                                                                                          fast):
    """response_plan copies a canonical HTTP/1.1 head whole, status line and all, but for the lines it drops:
    the same bytes as the line, then response_fields."""
    status_line = head.split(b"\r\n", 1)[0]
    for rh in (parse_response(head), slow(parse_response(head))):
        out, _, _ = response_plan(rh, b"GET", False, True, skip, limiting, b"")
        assert bytes(out).startswith(b"HTTP/1.1" + status_line[8:] + b"\r\n" + want)


REQ = b"GET /a?b=1 HTTP/1.1\r\nHost: api.example.com\r\nUser-Agent: t/1\r\nX-Api-Key: k1\r\nAccept: */*"

# (request head, replaced, underscores, length, the fields the backend gets, the length still to write,
#  whether the parser found it canonical)
REQUESTS = [
    (REQ, _REPLACED, False, None, b"Host: api.example.com\r\nUser-Agent: t/1\r\nX-Api-Key: k1\r\nAccept: */*\r\n",
     None, True),
    (b"POST / HTTP/1.1\r\nHost: h\r\ncontent-length: 3\r\nExpect: 100-continue\r\nX-Forwarded-For: 1.2.3.4\r\n"
     b"X-Forwarded-Proto: https\r\nX-Forwarded-Host: o\r\nX-Forwarded-Client-Cert: forged\r\nConnection: keep-alive\r\nX-A: b",
     _REPLACED, False, 3, b"Host: h\r\nContent-Length: 3\r\nX-A: b\r\n", None, True),
    (b"POST / HTTP/1.1\r\nHost: h\r\nX-Forwarded-Proto: https\r\nX-Forwarded-Host: o\r\nTransfer-Encoding: chunked",
     _REPLACED_TRUSTED, False, 7, b"Host: h\r\nX-Forwarded-Proto: https\r\nX-Forwarded-Host: o\r\n", 7, True),
    (b"GET / HTTP/1.1\r\nHost: h\r\nX_Forwarded_For: 6.6.6.6\r\nCookie: _ga=1", _REPLACED, False, None,
     b"Host: h\r\nCookie: _ga=1\r\n", None, True),
    (b"GET / HTTP/1.1\r\nHost: h\r\nX_Forwarded_For: 6.6.6.6\r\nCookie: _ga=1", _REPLACED, True, None,
     b"Host: h\r\nX_Forwarded_For: 6.6.6.6\r\nCookie: _ga=1\r\n", None, True),
    (b"GET / HTTP/1.1\r\nHost: h\r\nCookie: _ga=1", _REPLACED, False, None, b"Host: h\r\nCookie: _ga=1\r\n", None, True),
    (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: X-Hop\r\nX-Hop: 1\r\nX-Keep: 2", _REPLACED, False, None,
     b"Host: h\r\nX-Keep: 2\r\n", None, True),
    (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket", _REPLACED, False, None,
     b"Host: h\r\n", None, True),
    (b"GET / HTTP/1.1\r\nHost:  h \r\nX-A:b", _REPLACED, False, None, b"Host: h\r\nX-A: b\r\n", None, False),
    (b"GET / HTTP/1.0", _REPLACED, False, None, b"", None, True),
    (b"GET http://h/ HTTP/1.1\r\nHost: h", _REPLACED, False, None, b"Host: h\r\n", None, False),
    (b"GET / HTTP/1.1\r\nHost: h\r\nX-Request-Id: client", _REPLACED | {b"x-request-id"}, False, None,
     b"Host: h\r\n", None, True),
]


@pytest.mark.parametrize("head,replaced,underscores,length,want,left,fast", REQUESTS)
def test_the_request_fields_from_slices_equal_the_rebuilt_ones(head, replaced, underscores, length, want, left, fast):
    req = parse_request(head)
    assert (req.spans is not None) == fast
    for r in (req, slow(parse_request(head))):
        out, still = request_fields(r, replaced, underscores, length)
        assert (bytes(out), still) == (want, left)


@pytest.mark.parametrize("head,replaced,underscores,length,want,left,fast", REQUESTS)
def test_the_request_head_is_the_request_line_and_the_forwarded_fields_whichever_path_wrote_it(
        head, replaced, underscores, length, want, left, fast):
    """request_head copies a canonical HTTP/1.1 head with nothing to drop whole, request line and all: the same
    bytes as the line as HTTP/1.1, then request_fields."""
    for r in (parse_request(head), slow(parse_request(head))):
        out, still = request_head(r, replaced, underscores, length)
        assert (bytes(out), still) == (r.method + b" " + r.target + b" HTTP/1.1\r\n" + want, left)


def test_a_canonical_head_parses_to_the_same_request_as_line_by_line():
    head = (b"POST /x HTTP/1.1\r\nHost: Api.Example.com\r\nX-Forwarded-For: 1.1.1.1\r\nx-forwarded-for: 2.2.2.2\r\n"
            b"Cookie: a=1\r\nCOOKIE: b=2\r\nContent-Length: 4\r\nConnection: keep-alive, X-Hop\r\nX-Api-Key: K\r\n"
            b"X-Request-Id: r-1\r\nExpect: 100-continue")
    fast = parse_request(head)
    lined = parse_request(head.replace(b"X-Api-Key: K", b"X-Api-Key:  K "))   # not canonical: line by line
    assert fast.spans is not None and lined.spans is None
    for f in ("method", "target", "version", "host", "content_length", "chunked", "keep_alive", "conn_tokens",
              "api_key", "xff", "cookie", "request_id", "expect_continue", "proto", "fwd_host"):
        assert getattr(fast, f) == getattr(lined, f), f
    assert fast.xff == b"1.1.1.1, 2.2.2.2" and fast.cookie == b"a=1; b=2" and fast.conn_tokens == {b"x-hop"}
    assert fast.headers == [(n, n.lower(), v) for n, _, v in lined.headers]     # made when asked for


@pytest.mark.parametrize("head,status,reason", [
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b", 400, "duplicate Host header"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2", 400, "conflicting Content-Length headers"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nTransfer-Encoding: chunked", 400,
     "both Content-Length and Transfer-Encoding"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX-Api-Key: 1\r\nx-api-key: 2", 400, "more than one X-Api-Key header"),
    (b"GET / HTTP/1.1\r\nX-A: b", 400, "missing Host header"),
    (b"TRACE / HTTP/1.1\r\nHost: a", 405, "TRACE is not allowed"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x00", 400, "control character in the request head"),
    (b"GET / HTTP/1.1\r\nHost: a\r\n X-A: b", 400, "obsolete header line folding"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX A: b", 400, "malformed header line"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\rc", 400, "bare CR or LF in the request head"),
    (b"GET / HTTP/1.1\r\nHost: a" + b"\r\nX-A: b" * 100, 431, "more than 100 header fields"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nExpect: other", 417, "unsupported expectation"),
])
def test_the_fast_path_refuses_what_the_line_by_line_path_refuses(head, status, reason):
    with pytest.raises(HttpError) as e:
        parse_request(head)
    assert (e.value.status, e.value.reason) == (status, reason)


@pytest.mark.parametrize("head,reason", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2", "conflicting Content-Length headers"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked", "both Content-Length and Transfer-Encoding"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked", "chunked applied twice"),
    (b"HTTP/1.1 200 OK\r\nX-A: b\x7f", "control character in the response head"),
    (b"HTTP/1.1 200 OK\r\nX-A: b\nX-B: c", "bare CR or LF in the response head"),
    (b"HTTP/1.1 200 OK\r\nX-A: b" * 101, "more than 100 header fields"),
    (b"HTTP/1.1 2000 OK\r\nX-A: b", "bad status code"),
])
def test_a_response_the_fast_path_would_not_take_is_refused_as_before(head, reason):
    with pytest.raises(UpstreamError) as e:
        parse_response(head)
    assert e.value.detail == reason


_FIELDS = ("status", "status_line", "raw", "spans", "headers", "content_length", "chunked", "codings", "close",
           "early", "conn_tokens")


def test_a_head_parsed_again_from_the_connections_memo_is_the_same_and_its_own():
    memo = [None, None]
    heads = [h for h, *_ in RESPONSES] + [NGINX.replace(b"615", b"616"), NGINX]
    for head in heads + heads:  # each once fresh (or after another), then again
        fresh, again = parse_response(head), parse_response(head, memo)
        assert [getattr(again, f) for f in _FIELDS] == [getattr(fresh, f) for f in _FIELDS]
        twice = parse_response(head, memo)
        assert [getattr(twice, f) for f in _FIELDS] == [getattr(fresh, f) for f in _FIELDS]
        again.early = again.close = True  # what attempt() and relay() may set on theirs
        assert parse_response(head, memo).early is False
        assert parse_response(head, memo).close is fresh.close
    # a head the fast path did not take is never remembered, however often it comes; nor is one refused
    for _ in range(3):
        parse_response(b"HTTP/1.1 200 OK\r\nX-A:  b ", memo)
        assert memo[1] is None
    for _ in range(3):
        with pytest.raises(UpstreamError):
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2", memo)
        assert memo[1] is None


def test_what_a_parse_found_is_kept_from_a_heads_second_time_in_a_row():
    # heads that differ each time (a varying Content-Length, an id) cost a compare and a store, no more
    memo = [None, None]
    a, b = NGINX, NGINX.replace(b"615", b"616")
    for head in (a, b, a, b):
        parse_response(head, memo)
        assert memo == [head, None]
    parse_response(b, memo)
    assert memo[0] == b and memo[1] is not None
    memo = [None, None]
    ra, rb = b"GET /a HTTP/1.1\r\nHost: h", b"GET /b HTTP/1.1\r\nHost: h"
    for head in (ra, rb, ra):
        parse_request(head, memo)
        assert memo == [head, None]
    parse_request(ra, memo)
    assert memo[0] == ra and memo[1] is not None


_REQUEST_FIELDS = ("method", "target", "version", "headers", "content_length", "chunked", "keep_alive", "host",
                   "expect_continue", "conn_tokens", "api_key", "xff", "proto", "fwd_host", "cookie", "request_id",
                   "client_cert", "raw", "spans")


def test_a_request_parsed_again_from_the_connections_memo_is_the_same_and_its_own():
    memo = [None, None]
    heads = [h for h, *_ in REQUESTS] + [b"GET /a HTTP/1.1\r\nHost: h\r\nX-Api-Key: k", b"GET /b HTTP/1.0"]
    for head in heads + heads:
        fresh, again = parse_request(head), parse_request(head, memo)
        assert [getattr(again, f) for f in _REQUEST_FIELDS] == [getattr(fresh, f) for f in _REQUEST_FIELDS]
        again.client_cert = object()  # what the connection loop sets on its own
        twice = parse_request(head, memo)
        assert [getattr(twice, f) for f in _REQUEST_FIELDS] == [getattr(fresh, f) for f in _REQUEST_FIELDS]
    for refused in (b"TRACE / HTTP/1.1\r\nHost: h", b"GET / HTTP/1.1\r\nHost: h\r\nHost: i", b"GET /  HTTP/1.1"):
        for _ in range(3):
            with pytest.raises(HttpError):
                parse_request(refused, memo)
            assert memo[1] is None
    for _ in range(3):
        parse_request(b"GET http://h/x HTTP/1.1\r\nHost: h", memo)  # not canonical: not remembered
        assert memo[1] is None


@pytest.mark.parametrize("head,skip,limiting,want,fast", RESPONSES)
def test_a_head_relayed_again_from_the_memo_is_the_one_written_from_its_bytes(head, skip, limiting, want, fast):
    memo = [None, None]
    for other in (skip, NOT_RELAYED, skip):  # written, then again (the same skip, or another)
        for lim in (limiting, not limiting, limiting):
            expected = bytes(response_plan(parse_response(head), b"GET", False, True, other, lim, b"X: y\r\n")[0])
            for _ in range(2):
                out, _, _ = response_plan(parse_response(head, memo), b"GET", False, True, other, lim, b"X: y\r\n")
                assert bytes(out) == expected
                out += b"changed"  # the caller's own copy
