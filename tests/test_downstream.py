"""The pipeline over a Downstream without HTTP/1.1's raw path (lb/proxy/downstream.py): what the HTTP/2
codec plugs into. A recording Downstream is the second codec here; the edge (in this process, as
bench/request_path.py runs it), the backend and its bytes are real."""

from __future__ import annotations

import socket

import pytest

from lb.config import load as config
from lb.http.framing import parse_request
from lb.process.app import App
from lb.proxy import replies
from lb.proxy.conn import ClientConn
from lb.proxy.downstream import Downstream
from tests.rawserver import RawServer

BIG = b"b" * 200_000

RESPONSES = {
    b"/small": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Ratelimit-Limit: 999\r\nConnection: keep-alive\r\n\r\nhello",
    b"/big": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Backend: b\r\n\r\n%s" % (len(BIG), BIG),
    b"/chunked": b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nT: t\r\n\r\n",
    b"/eof": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the close",
    b"/cut": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BIG), BIG[:100_000]),
    b"/bad-chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"/short": b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
}


def _answer(s, _server):
    buf = b""
    while True:
        while b"\r\n\r\n" not in buf:
            data = s.recv(65536)
            if not data:
                return
            buf += data
        head, _, buf = buf.partition(b"\r\n\r\n")
        target = head.split(b" ", 2)[1]
        if target == b"/len":         # the body's length back
            if b"content-length: " in head.lower():
                n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(buf) < n:
                    buf += s.recv(65536)
                buf = buf[n:]
            else:                     # chunked (a streamed body), read by the book
                n = 0
                while True:
                    while b"\r\n" not in buf:
                        buf += s.recv(65536)
                    line, _, buf = buf.partition(b"\r\n")
                    size = int(line, 16)
                    while len(buf) < size + 2:
                        buf += s.recv(65536)
                    buf = buf[size + 2:]
                    n += size
                    if not size:
                        break
            s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%d" % (len(str(n)), n))
            continue
        s.sendall(RESPONSES.get(target, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
        if target in (b"/eof", b"/cut", b"/bad-chunk", b"/short"):
            return                # the close delimits (or cuts) the body


class Recording(Downstream):
    proto = b"HTTP/2"

    def __init__(self, edge):
        self.edge = edge
        self.calls: list = []

    def local_reply(self, x, status, reason, keep, linger=False):
        r = replies.build(x, status, reason, keep)
        x.bytes_sent = len(r.body)
        self.edge.record(x, status)
        self.calls.append(("reply", r.status, r.headers, r.body))
        return keep

    def start(self, x, status, reason, headers, length):
        self.calls.append(("start", status, reason, headers, length))

    def send(self, data):
        if self.calls[-1][0] == "data":
            self.calls[-1] = ("data", self.calls[-1][1] + data)
        else:
            self.calls.append(("data", data))

    def finish(self, trailers=None):
        self.calls.append(("finish", trailers))

    def abort(self):
        self.calls.append(("abort",))


@pytest.fixture(scope="module")
def edge():
    backend = RawServer(_answer)
    cfg = config.load(["--listen", "127.0.0.1:0", "--backends", backend.url, "--limit", "2/m",
                       "--health-interval", "3600"])
    app = App(cfg)
    yield app.edge
    app.server.server_close()
    backend.close()


def run(edge, target: bytes, key: bytes = b"k1", body=None):
    a, b = socket.socketpair()          # the client connection HTTP/2 would have (unused by the codec)
    try:
        down = Recording(edge)
        conn = ClientConn(a, "127.0.0.1")
        method, framing = (b"GET", b"") if body is None else (b"POST", b"\r\nTransfer-Encoding: chunked")
        req = parse_request(b"%s %s HTTP/1.1\r\nHost: h\r\nX-Api-Key: %s%s" % (method, target, key, framing))
        keep = edge.handle(req, conn, down, body)
        return down.calls, keep
    finally:
        a.close()
        b.close()


def test_a_small_response_is_one_start_one_send_one_finish_with_the_edges_headers(edge):
    calls, keep = run(edge, b"/small", b"small-1")
    (op, status, reason, headers, length), data, fin = calls
    assert (op, status, reason, length) == ("start", 200, b"OK", 5)
    names = [n.lower() for n, _ in headers]
    assert b"connection" not in names and b"content-length" not in names     # framing is the codec's
    assert (b"X-RateLimit-Limit", b"2") in headers and b"999" not in [v for _, v in headers]
    assert data == ("data", b"hello") and fin == ("finish", None) and keep


@pytest.mark.parametrize("target, status, length, body", [
    (b"/big", 200, len(BIG), BIG),
    (b"/chunked", 201, None, b"abcde"),
    (b"/eof", 200, None, b"until the close"),
])
def test_every_body_mode_arrives_whole_through_send(edge, target, status, length, body):
    calls, _ = run(edge, target, b"mode-" + target[1:])
    assert calls[0][:2] == ("start", status) and calls[0][4] == length
    assert calls[1] == ("data", body) and calls[-1] == ("finish", None)


def test_a_backend_failing_after_the_head_aborts_the_response(edge):
    calls, keep = run(edge, b"/cut", b"cut-1")
    assert calls[0][0] == "start" and calls[-1] == ("abort",) and not keep


def test_a_bad_chunk_after_the_head_aborts_too(edge):
    calls, _ = run(edge, b"/bad-chunk", b"bad-1")
    assert calls[0][0] == "start" and calls[-1] == ("abort",)


def test_a_small_body_cut_short_is_the_edges_own_502_not_a_started_response(edge):
    calls, _ = run(edge, b"/short", b"short-1")
    (op, status, _, body), = calls
    assert (op, status, body) == ("reply", 502, b"backend closed the connection\n")


def test_the_edges_own_replies_are_built_once_with_the_rate_limit_headers(edge):
    for _ in range(10):
        calls, keep = run(edge, b"/small", b"limited")
        if calls[0][0] == "reply":
            break
    (op, status, headers, body), = calls
    assert (op, status) == ("reply", 429) and body == b"rate limit exceeded\n"
    names = [n for n, _ in headers]
    assert b"X-RateLimit-Limit" in names and b"Retry-After" in names


@pytest.mark.parametrize("body, n", [(b"x" * 1000, 1000), (iter([b"a" * 70_000, b"b" * 5]), 70_005)])
def test_a_body_the_codec_has_is_forwarded_whole_or_streamed(edge, body, n):
    """HTTP/2 hands its body to the pipeline (bytes, or an iterator of pieces as it arrives)."""
    calls, _ = run(edge, b"/len", b"body-%d" % n, body)
    assert calls[1] == ("data", b"%d" % n)


def test_http11s_neutral_methods_write_its_framing(edge):
    """H1Downstream's start/send/finish (the raw path relays otherwise): a length, or chunks and trailers."""
    from lb.proxy.downstream import H1Downstream
    from lb.proxy.exchange import Exchange
    a, b = socket.socketpair()
    try:
        down = H1Downstream(ClientConn(a, "127.0.0.1"), edge)
        x = Exchange(parse_request(b"GET / HTTP/1.1\r\nHost: h"), 0.0)
        down.start(x, 200, b"OK", [(b"X-A", b"1")], 2)
        down.send(b"hi")
        down.finish()
        down.start(x, 201, b"Created", [], None)
        down.send(b"abc")
        down.send(b"")
        down.finish([(b"T", b"t")])
        a.shutdown(socket.SHUT_WR)
        got = b""
        while data := b.recv(65536):
            got += data
    finally:
        a.close()
        b.close()
    assert got == (b"HTTP/1.1 200 OK\r\nX-A: 1\r\nContent-Length: 2\r\n\r\nhi"
                   b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nT: t\r\n\r\n")
