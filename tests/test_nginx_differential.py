"""The edge against nginx, a proxy no one here wrote: the same raw requests through both, to one kind of
recording backend (tests/rawserver.py), compared by what each backend received.

The corpus collects the framing, smuggling, header and method edge cases of RFC 9112 (message framing
§6, chunked coding §7.1, field syntax §5, request line §3) and the kinds of cases HAProxy's
reg-tests (http-messages) and nginx's tests (proxy_chunked, http_host, http_method, http_uri) cover.
For every entry: the backend behind the edge receives the same requests (method, target, body) as the
one behind nginx, or the edge refuses what nginx refuses -- or, listed in STRICTER with the reason,
the edge refuses something nginx lets through. Never the other way round: the edge never forwards what
nginx refuses. After every entry a victim request on another client connection must get its own
response (a request smuggled onto a pooled backend connection would answer it instead), which also
shows the edge still serving.

The second half does the same for responses: a scripted backend misbehaves on the response side
(RESPONSES), the client's view through each proxy is compared, and each entry's victim checked.
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from tests.rawserver import ConnReader, RawServer, RecordingBackend, Unparseable, read_request
from tests.support import Edge, wait_until
from wrk.nginx_target import find_nginx, run_nginx

H = b"Host: x\r\n"
BIG = b"a" * 70000          # larger than the edge's small-body buffer: streamed


def _get(extra: bytes = b"", target: bytes = b"/", method: bytes = b"GET", version: bytes = b"HTTP/1.1") -> bytes:
    return method + b" " + target + b" " + version + b"\r\n" + extra + b"\r\n"


def _post(headers: bytes, body: bytes, target: bytes = b"/p") -> bytes:
    return b"POST " + target + b" HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n" + body


CHUNKED = b"Transfer-Encoding: chunked\r\n"
STEAL = b"GET /steal HTTP/1.1\r\nX-Ignore: "          # the attack: a half request as the body
INSIDE = b"GET /inside HTTP/1.1\r\nHost: x\r\n\r\n"

CORPUS: dict[str, bytes] = {
    # ---- Content-Length and Transfer-Encoding together, or ambiguous (RFC 9112 6.1, 6.3)
    "cl-te": _post(b"Content-Length: 5\r\n" + CHUNKED, b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"),
    "te-cl": _post(CHUNKED + b"Content-Length: 40\r\n", b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"),
    "cl-differ": _post(b"Content-Length: 3\r\nContent-Length: 4\r\n", b"abcd"),
    "cl-equal-twice": _post(b"Content-Length: 3\r\nContent-Length: 3\r\n", b"abc"),
    "cl-list-equal": _post(b"Content-Length: 3, 3\r\n", b"abc"),
    "cl-list-differ": _post(b"Content-Length: 3, 4\r\n", b"abcd"),
    "cl-plus": _post(b"Content-Length: +3\r\n", b"abc"),
    "cl-negative": _post(b"Content-Length: -1\r\n", b"abc"),
    "cl-hex": _post(b"Content-Length: 0x3\r\n", b"abc"),
    "cl-inner-space": _post(b"Content-Length: 1 2\r\n", b"abcdefghijkl"),
    "cl-leading-zeros": _post(b"Content-Length: 003\r\n", b"abc"),
    "cl-empty": _post(b"Content-Length: \r\n", b""),
    "cl-huge": _post(b"Content-Length: 99999999999999999999\r\n", b"abc"),
    "cl-too-large-for-the-limit": _post(b"Content-Length: 2000000\r\n", b"abc"),
    "te-uppercase": _post(b"Transfer-Encoding: CHUNKED\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    "te-xchunked": _post(b"Transfer-Encoding: xchunked\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    "te-chunked-identity": _post(b"Transfer-Encoding: chunked, identity\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    "te-identity-chunked": _post(b"Transfer-Encoding: identity, chunked\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    "te-gzip-chunked": _post(b"Transfer-Encoding: gzip, chunked\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    "te-twice": _post(CHUNKED + CHUNKED, b"3\r\nabc\r\n0\r\n\r\n"),
    "te-space-before-colon": _post(b"Transfer-Encoding : chunked\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    "te-leading-tab": _post(b"Transfer-Encoding:\tchunked\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    "te-vertical-tab": _post(b"Transfer-Encoding: \x0bchunked\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    "te-obs-fold": _post(b"Transfer-Encoding:\r\n chunked\r\n", b"3\r\nabc\r\n0\r\n\r\n"),
    "te-empty": _post(b"Transfer-Encoding: \r\n", b""),
    "te-http10": b"POST /p HTTP/1.0\r\nHost: x\r\n" + CHUNKED + b"\r\n3\r\nabc\r\n0\r\n\r\n",
    # ---- chunked bodies (RFC 9112 7.1): sizes, extensions, terminators, trailers
    "chunked-ok": _post(CHUNKED, b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"),
    "chunked-streamed": _post(CHUNKED, b"%x\r\n%s\r\n0\r\n\r\n" % (len(BIG), BIG)),
    "chunk-size-0x": _post(CHUNKED, b"0x3\r\nabc\r\n0\r\n\r\n"),
    "chunk-size-plus": _post(CHUNKED, b"+3\r\nabc\r\n0\r\n\r\n"),
    "chunk-size-minus": _post(CHUNKED, b"-3\r\nabc\r\n0\r\n\r\n"),
    "chunk-size-underscore": _post(CHUNKED, b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n"),
    "chunk-size-leading-space": _post(CHUNKED, b" 3\r\nabc\r\n0\r\n\r\n"),
    "chunk-size-overflow": _post(CHUNKED, b"fffffffffffffffff3\r\nabc\r\n0\r\n\r\n"),
    "chunk-size-empty": _post(CHUNKED, b"\r\nabc\r\n0\r\n\r\n"),
    "chunk-extension": _post(CHUNKED, b"3;name=value\r\nabc\r\n0\r\n\r\n"),
    "chunk-extension-quoted": _post(CHUNKED, b'3;name="a b"\r\nabc\r\n0\r\n\r\n'),
    "chunk-longer-than-declared": _post(CHUNKED, b"3\r\nabcdef\r\n0\r\n\r\n"),
    "chunk-missing-crlf": _post(CHUNKED, b"3\r\nabc0\r\n\r\n"),
    "chunk-lf-only": _post(CHUNKED, b"3\nabc\n0\n\n"),
    "chunk-trailers": _post(CHUNKED, b"3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n"),
    "chunk-then-pipelined": _post(CHUNKED, b"3\r\nabc\r\n0\r\n\r\n" + _get(H, b"/second")),
    "chunk-large-then-bad": _post(CHUNKED, b"%x\r\n%s\r\n0x1\r\nA\r\n0\r\n\r\n" % (len(BIG), BIG)),
    "chunk-zero-without-final-crlf-then-request": _post(CHUNKED, b"0\r\n" + _get(H, b"/smuggled")),
    # ---- Connection must not take the framing or Host away (RFC 9110 7.6.1 vs 9112 6)
    "connection-content-length": _post(b"Connection: content-length\r\nContent-Length: %d\r\n" % len(STEAL), STEAL),
    "connection-transfer-encoding": _post(b"Connection: transfer-encoding\r\n" + CHUNKED, b"3\r\nabc\r\n0\r\n\r\n"),
    "connection-host": _get(H + b"Connection: host\r\n", b"/c"),
    "connection-close-then-pipelined": _get(H + b"Connection: close\r\n", b"/first") + _get(H, b"/after-close"),
    "connection-keep-alive-http10": b"GET /k HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" + _get(H, b"/k2"),
    # ---- bodies and pipelining
    "cl-zero-with-pipelined": _post(b"Content-Length: 0\r\n", _get(H, b"/second")),
    "cl-body-looks-like-request": _post(b"Content-Length: %d\r\n" % len(INSIDE), INSIDE),
    "pipelined-gets": _get(H, b"/one") + _get(H, b"/two") + _get(H, b"/three"),
    "get-with-body": b"GET /g HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
    "head-with-body": b"HEAD /h HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
    "post-no-length": b"POST /n HTTP/1.1\r\nHost: x\r\n\r\n",
    "post-large-cl": _post(b"Content-Length: %d\r\n" % len(BIG), BIG),
    "expect-100-continue": _post(b"Expect: 100-continue\r\nContent-Length: 3\r\n", b"abc"),
    "expect-unknown": _post(b"Expect: something\r\nContent-Length: 3\r\n", b"abc"),
    "http10-post": b"POST /o HTTP/1.0\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
    # ---- header syntax (RFC 9112 5, 2.2)
    "header-space-before-colon": _get(H + b"X-Foo : bar\r\n"),
    "header-no-colon": _get(H + b"X-Foo bar\r\n"),
    "header-obs-fold": _get(H + b"X-Foo: a\r\n b\r\n"),
    "header-nul": _get(H + b"X-Foo: a\x00b\r\n"),
    "header-bare-cr": _get(H + b"X-Foo: a\rb\r\n"),
    "header-empty-name": _get(H + b": value\r\n"),
    "header-name-non-token": _get(H + b"X@Foo: 1\r\n"),
    "header-long-ok": _get(H + b"X-Long: " + b"v" * 4000 + b"\r\n"),
    "bare-lf-line-endings": b"GET /lf HTTP/1.1\nHost: x\n\n",
    # ---- Host (RFC 9112 3.2)
    "host-missing": _get(b"", b"/nohost"),
    "host-empty": _get(b"Host:\r\n"),
    "host-duplicate": _get(H + H),
    "host-differing": _get(H + b"Host: y\r\n"),
    "host-with-slash": _get(b"Host: a/b\r\n"),
    "host-with-backslash": _get(b"Host: a\\b\r\n"),
    "host-with-port": _get(b"Host: x:8080\r\n", b"/port"),
    "host-http10-missing": b"GET /old HTTP/1.0\r\n\r\n",
    "absolute-form-same-host": _get(H, b"http://x/abs"),
    "absolute-form-other-host": _get(H, b"http://elsewhere/abs"),
    # ---- request line and methods (RFC 9112 3)
    "method-lowercase": _get(H, method=b"get"),
    "method-custom": _get(H, b"/purge", method=b"PURGE"),
    "method-non-token": _get(H, method=b"GE(T"),
    "method-connect": _get(H, b"x:443", method=b"CONNECT"),
    "method-trace": _get(H, b"/t", method=b"TRACE"),
    "options-asterisk": _get(H, b"*", method=b"OPTIONS"),
    "version-1.0": b"GET /v10 HTTP/1.0\r\nHost: x\r\n\r\n",
    "version-2.0": _get(H, version=b"HTTP/2.0"),
    "version-lowercase": _get(H, version=b"http/1.1"),
    "version-missing": b"GET /\r\nHost: x\r\n\r\n",
    "target-with-space": _get(H, b"/a b"),
    "target-percent-encoded": _get(H, b"/a%2Fb%20c?q=%00"),
    "target-fragment": _get(H, b"/a#frag"),
    "target-control-byte": _get(H, b"/a\x01b"),
    "request-line-double-space": b"GET  /ds HTTP/1.1\r\nHost: x\r\n\r\n",
    "request-line-tab": b"GET\t/tab HTTP/1.1\r\nHost: x\r\n\r\n",
    "request-line-leading-crlf": b"\r\nGET /lead HTTP/1.1\r\nHost: x\r\n\r\n",
}

# The edge refuses these while nginx lets them through: each is a message another parser could read
# differently, or one the edge does not serve, refused on purpose (SECURITY.md).
STRICTER = {
    "chunk-lf-only": "RFC 9112 2.2 lets a recipient take a bare LF as a line end; a backend may not",
    "bare-lf-line-endings": "the same, in the head",
    "host-with-backslash": "not an authority (RFC 9110 7.2)",
    "absolute-form-other-host": "the edge is not a forward proxy: absolute-form is served for its own Host only",
    "request-line-double-space": "RFC 9112 3: exactly one SP between the three parts",
    "request-line-leading-crlf": "RFC 9112 2.2: a server SHOULD ignore one leading CRLF; the edge refuses it",
    "header-name-non-token": "RFC 9110 5.1: a field name is a token",
    "expect-unknown": "RFC 9110 10.1.1: an expectation the edge cannot meet is a 417",
    "version-missing": "HTTP/0.9 is not served",
}

# The edge forwards these while nginx refuses them. Both are framing RFC 9110 explicitly allows, and
# the backend never sees the ambiguity: the edge writes exactly one framing header of its own.
LAXER = {
    "cl-equal-twice": "RFC 9110 8.6: equal Content-Lengths are one length (forwarded as one header)",
    "cl-list-equal": "the same, as a list",
    "te-leading-tab": "HTAB is OWS (RFC 9110 5.6.3): the value is 'chunked'; re-framed by the edge",
}


# ----------------------------------------------------------------------------------------- harness

# bodies in memory: no temp files for the worker to write; the test half-closes after sending: not an abort
BODIES = "client_max_body_size 1m; client_body_buffer_size 2m;"


@pytest.fixture(scope="module")
def nginx():
    if not find_nginx():
        pytest.fail("nginx not installed (./run-tests installs nginx-light)")
    backend = RecordingBackend()
    with run_nginx(proxy_to=backend.port, http_extra=BODIES, location_extra="proxy_ignore_client_abort on;") as n:
        yield n.port, backend
    backend.close()


@pytest.fixture(scope="module")
def edge():
    backend = RecordingBackend()
    e = Edge("--backends", backend.url, "--health-interval", "30", "--max-body-size", "1048576",
             "--header-timeout", "3", "--body-timeout", "3")
    yield e.port, backend, e
    e.stop()
    backend.close()


def send_all(port: int, data: bytes) -> bytes:
    """Send, half-close (no more requests follow), read until the proxy closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=8) as s:
        s.sendall(data)
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return out


def statuses(raw: bytes) -> list[int]:
    out, i = [], 0
    while (j := raw.find(b"HTTP/1.1 ", i)) >= 0:
        code = raw[j + 9:j + 12]
        if code.isdigit() and (j == 0 or raw[j - 2:j] == b"\r\n" or raw[j - 1:j] == b"\n"):
            out.append(int(code))
        i = j + 9
    return out


def recorded(backend) -> list[tuple]:
    return [(m, t, b) for m, t, _, b in backend.take() if not t.startswith("/victim-") and t != "/health"]


def short(reqs: list[tuple]) -> list[tuple]:
    return [(m, t, b if len(b) < 40 else b[:20] + b"...(%d bytes)" % len(b)) for m, t, b in reqs]


def victim(port: int, backend, n: int) -> None:
    raw = send_all(port, b"GET /victim-%d HTTP/1.1\r\nHost: v\r\n\r\n" % n)
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b"target=/victim-%d len=0\n" % n), raw[-200:]


def test_corpus_is_big_enough_and_every_exception_is_in_it():
    assert len(CORPUS) >= 60
    assert set(STRICTER) <= set(CORPUS) and set(LAXER) <= set(CORPUS)


def test_the_edge_forwards_what_nginx_forwards_or_refuses_more(nginx, edge):
    nport, nbackend = nginx
    eport, ebackend, e = edge
    table, problems = [], []
    for n, (name, data) in enumerate(CORPUS.items()):
        nraw = send_all(nport, data)
        via_nginx = recorded(nbackend)
        eraw = send_all(eport, data)
        via_edge = recorded(ebackend)
        victim(eport, ebackend, n)
        ns, es = statuses(nraw), statuses(eraw)
        table.append(f"{name:45} nginx {ns!s:18} {len(via_nginx)} fwd | edge {es!s:18} {len(via_edge)} fwd")
        if any(m == "UNPARSEABLE" for m, _, _ in via_edge):
            problems.append(f"{name}: the edge sent its backend something it could not parse: {via_edge}")
        elif via_edge == via_nginx:
            if name in STRICTER or name in LAXER:
                problems.append(f"{name}: listed as a difference, but both forwarded {short(via_edge)}")
        elif len(via_edge) < len(via_nginx) and via_edge == via_nginx[:len(via_edge)] and es and es[-1] >= 400:
            if name not in STRICTER:
                problems.append(f"{name}: the edge refused ({es}) what nginx forwarded: {short(via_nginx)}")
        elif name in LAXER and not via_nginx and ns and ns[0] >= 400 and len(via_edge) == 1:
            pass
        else:
            problems.append(f"{name}: nginx forwarded {short(via_nginx)} ({ns}), the edge {short(via_edge)} ({es})")
    print("\n" + "\n".join(table))
    assert not problems, "\n".join(problems)
    assert "Traceback" not in e.log()


def test_the_reference_proxy_is_pinned_and_reuses_its_upstream_connections():
    """bench/tail_bench.py's reference (nginx in the edge's place) is a fair one only if it does what the
    edge does: one process on the edge's CPU, keep-alive connections to the backend. Ten requests on ten
    client connections reach the backend on one connection, and the worker runs on the CPU asked for."""
    if not find_nginx():
        pytest.fail("nginx not installed (./run-tests installs nginx-light)")
    backend = RecordingBackend()
    cpu = max(os.sched_getaffinity(0))
    try:
        with run_nginx(proxy_to=backend.port, cpu=cpu) as n:
            worker = wait_until(n.pid_of_worker, 10, what="nginx's worker")
            assert os.sched_getaffinity(worker) == {cpu}
            for i in range(10):
                with socket.create_connection(("127.0.0.1", n.port), timeout=5) as s:
                    s.sendall(b"GET /r%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % i)
                    got = b""
                    while chunk := s.recv(65536):
                        got += chunk
                assert got.startswith(b"HTTP/1.1 200") and b"target=/r%d " % i in got, got
            assert backend.connections == 1
    finally:
        backend.close()


# ------------------------------------------------------------------------------- the response side
#
# The same two proxies, each in front of its own scripted raw backend that misbehaves on the response
# (tests/rawserver.py): extra bytes after a complete response (at once, or 30 ms later on the idle
# connection), Content-Lengths that disagree with the body, Content-Length with Transfer-Encoding, a
# body on 204/304/HEAD, control bytes and obs-fold in a field. For each entry the client's view through
# each proxy is recorded (its statuses, whether a byte the backend sent beyond its response -- marked
# STRAY -- reached it), then a victim request on another client connection must get its own response:
# the next request on a reused upstream connection must not read what the entry left there.

STRAY = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Stray: yes\r\n\r\nSTRAY"
OK5 = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"

# name: (method, the backend's writes -- bytes, or a float: a pause in seconds --, close after?)
RESPONSES: dict[str, tuple[bytes, list, bool]] = {
    "plain": (b"GET", [OK5], False),
    "extra-after-cl-same-write": (b"GET", [OK5 + STRAY], False),
    "extra-after-cl-later": (b"GET", [OK5, 0.03, STRAY], False),
    "cl-counted-in-characters": (b"GET", [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\ncaf\xc3\xa9!" + STRAY], False),
    "extra-after-chunked": (b"GET", [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 0.03,
                                     STRAY], False),
    "cl-longer-than-body": (b"GET", [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello"], True),
    "two-cl-differ": (b"GET", [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 10\r\n\r\nhello" + STRAY], False),
    "two-cl-equal": (b"GET", [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello"], False),
    "cl-list-differ": (b"GET", [b"HTTP/1.1 200 OK\r\nContent-Length: 5, 10\r\n\r\nhello" + STRAY], False),
    "cl-te": (b"GET", [b"HTTP/1.1 200 OK\r\nContent-Length: 30\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"5\r\nhello\r\n0\r\n\r\n" + STRAY], False),
    "te-cl": (b"GET", [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"
                       b"5\r\nhello\r\n0\r\n\r\n" + STRAY], False),
    "body-on-204-same-write": (b"GET", [b"HTTP/1.1 204 No Content\r\n\r\n" + STRAY], False),
    "body-on-204-later": (b"GET", [b"HTTP/1.1 204 No Content\r\n\r\n", 0.03, STRAY], False),
    "body-on-204-with-cl": (b"GET", [b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello" + STRAY], False),
    "body-on-304-same-write": (b"GET", [b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n" + STRAY], False),
    "body-on-304-later": (b"GET", [b"HTTP/1.1 304 Not Modified\r\n\r\n", 0.03, STRAY], False),
    "body-on-head-same-write": (b"HEAD", [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello" + STRAY], False),
    "body-on-head-later": (b"HEAD", [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", 0.03, b"hello" + STRAY], False),
    "nul-in-field": (b"GET", [b"HTTP/1.1 200 OK\r\nX-Foo: a\x00b\r\nContent-Length: 5\r\n\r\nhello"], False),
    "soh-in-field": (b"GET", [b"HTTP/1.1 200 OK\r\nX-Foo: a\x01b\r\nContent-Length: 5\r\n\r\nhello"], False),
    "del-in-field": (b"GET", [b"HTTP/1.1 200 OK\r\nX-Foo: a\x7fb\r\nContent-Length: 5\r\n\r\nhello"], False),
    "htab-in-field": (b"GET", [b"HTTP/1.1 200 OK\r\nX-Foo: a\tb\r\nContent-Length: 5\r\n\r\nhello"], False),
    "obs-fold": (b"GET", [b"HTTP/1.1 200 OK\r\nX-Foo: a\r\n b\r\nContent-Length: 5\r\n\r\nhello"], False),
    "obs-fold-hiding-cl": (b"GET", [b"HTTP/1.1 200 OK\r\nX-Foo: a\r\n Content-Length: 99\r\nContent-Length: 5\r\n\r\n"
                                    b"hello" + STRAY], False),
    "bare-lf-head": (b"GET", [b"HTTP/1.1 200 OK\nContent-Length: 5\n\nhello"], False),
    "space-before-colon": (b"GET", [b"HTTP/1.1 200 OK\r\nContent-Length : 5\r\n\r\nhello" + STRAY], False),
}

# Where the client's view through the edge differs from nginx's 1.22, and why. Through the edge never a
# STRAY byte, and never a victim answered with another's response (nginx passes neither test of its own
# victims wrong; it relays stray bytes once, as the body of two-cl-differ).
RESPONSE_DIFFERS = {
    "cl-longer-than-body": "the edge reads a small body before it sends the head: a clean 502 instead of a "
                           "truncated 200 (nginx sends the head, then closes the client connection short)",
    "two-cl-differ": "RFC 9112 6.3: differing lengths are unrecoverable, a proxy MUST refuse (502); nginx 1.22 "
                     "takes the last one and relays bytes of the backend's next message as body",
    "cl-list-differ": "the same, as a list; nginx relays a 200 with no body",
    "cl-te": "RFC 9112 6.3: a response with both is one a client could frame otherwise: the edge refuses "
             "(502), nginx 1.22 lets Transfer-Encoding win",
    "te-cl": "the same",
    "soh-in-field": "controls but HTAB are not field content (RFC 9110 5.5); nginx refuses only NUL",
    "del-in-field": "the same",
    "bare-lf-head": "RFC 9112 2.2: a recipient MAY take a bare LF as a line end; the edge refuses it (502)",
}


class ScriptedBackend(RawServer):
    """Answers GET|HEAD /case/NAME with RESPONSES[NAME]'s writes; anything else with its own answer
    naming the target. `done` counts the scripts written to the end."""

    def __init__(self):
        self.done = 0
        super().__init__(self._serve)

    def _serve(self, s, _server):
        r = ConnReader(s)
        while True:
            try:
                req = read_request(r)
            except (EOFError, Unparseable):
                return
            if req is None:
                return
            target = req[1]
            if target.startswith("/case/"):
                _, writes, close = RESPONSES[target[6:]]
                for w in writes:
                    if isinstance(w, float):
                        time.sleep(w)
                    else:
                        s.sendall(w)
                with self.lock:
                    self.done += 1
                if close:
                    return
            else:
                body = f"target={target} len={len(req[3])}\n".encode()
                s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


def exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """One request on its own connection (Connection: close), what came back until the proxy closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return out


def view(raw: bytes) -> str:
    """What a client saw, for the table: its statuses, the body of the first, and any stray byte."""
    st = statuses(raw)
    head, _, body = raw.partition(b"\r\n\r\n")
    s = f"{st}"
    if st and st[0] < 300:
        s += f" {body[:12]!r}"
    if b"STRAY" in raw or b"X-Stray" in raw or b"HTTP/" in body:
        s += " STRAY"
    return s


@pytest.fixture(scope="module")
def nginx_responses():
    if not find_nginx():
        pytest.fail("nginx not installed (./run-tests installs nginx-light)")
    backend = ScriptedBackend()
    with run_nginx(proxy_to=backend.port, location_extra="proxy_read_timeout 3s;") as n:
        yield n.port, backend
    backend.close()


@pytest.fixture(scope="module")
def edge_responses():
    backend = ScriptedBackend()
    e = Edge("--backends", backend.url, "--health-interval", "30", "--read-timeout", "3", "--eject-after", "0")
    yield e.port, backend, e
    e.stop()
    backend.close()


def test_the_response_side_no_stray_byte_and_every_victim_gets_its_own(nginx_responses, edge_responses):
    nport, nbackend = nginx_responses
    eport, ebackend, e = edge_responses
    table, problems = [], []
    for n, (name, (method, _, _)) in enumerate(RESPONSES.items()):
        data = method + b" /case/" + name.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        views, victims = [], []
        for port, backend in ((nport, nbackend), (eport, ebackend)):
            before = backend.done
            got = exchange(port, data)
            wait_until(lambda: backend.done > before, 10, what=f"{name}: the backend's script")
            time.sleep(0.05)             # the gap: what the entry left is on the idle upstream connection
            v = exchange(port, b"GET /victim-%d HTTP/1.1\r\nHost: v\r\nConnection: close\r\n\r\n" % n)
            views.append(view(got))
            victims.append(v.startswith(b"HTTP/1.1 200") and v.endswith(b"target=/victim-%d len=0\n" % n))
            if not victims[-1]:
                who = "nginx" if port == nport else "the edge"
                problems.append(f"{name}: through {who} the victim got {v[-120:]!r}")
        table.append(f"{name:28} nginx {views[0]:32} victim {'ok' if victims[0] else 'WRONG'} | "
                     f"edge {views[1]:32} victim {'ok' if victims[1] else 'WRONG'}")
        if "STRAY" in views[1]:
            problems.append(f"{name}: a byte beyond the response reached the client through the edge: {views[1]}")
        same = views[0] == views[1]
        if same and name in RESPONSE_DIFFERS:
            problems.append(f"{name}: listed as a difference, but both gave {views[1]}")
        elif not same and name not in RESPONSE_DIFFERS:
            problems.append(f"{name}: nginx gave {views[0]}, the edge {views[1]}")
    print("\n" + "\n".join(table))
    assert not problems, "\n".join(problems) + "\n" + "\n".join(table)
    assert "Traceback" not in e.log()
