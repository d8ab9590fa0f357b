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
"""

from __future__ import annotations

import os
import socket

import pytest

from tests.rawserver import RecordingBackend
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
