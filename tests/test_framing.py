"""Framing you can trust (issue 11), in raw bytes against a real edge and raw-socket backends.

Each case asserts the status the client gets, what the backend received (nothing, for refusals), that
a victim request on another client connection right after gets its own response (a request smuggled
onto a pooled connection would answer it instead), and that the edge keeps serving.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.rawserver import ConnReader, RawServer, RecordingBackend, Unparseable, read_request
from tests.support import PY, Edge, Proc, request, wait_until

# ------------------------------------------------------------------------------------------- helpers


def read_response(s: socket.socket, head_only: bool = False):
    """(status, [(name, value)], body) of one response, framed as the client must read it."""
    r = ConnReader(s)
    head = r.head()
    assert head is not None, "connection closed without a response"
    lines = head.split(b"\r\n")
    status = int(lines[0][9:12])
    headers = [(k.decode().lower(), v.strip().decode("latin-1"))
               for k, _, v in (ln.partition(b":") for ln in lines[1:])]
    h = dict(headers)
    if head_only or status in (101, 204, 304) or status < 200:
        return status, headers, b""
    if "transfer-encoding" in h and h["transfer-encoding"].endswith("chunked"):
        body = b""
        while True:
            size = int(r.line().split(b";")[0], 16)
            if size == 0:
                while r.line():
                    pass
                break
            body += r.exact(size)
            assert r.exact(2) == b"\r\n"
    elif "content-length" in h:
        body = r.exact(int(h["content-length"]))
    else:
        while r.fill():
            pass
        body = r.buf
    return status, headers, body


def exchange(port: int, data: bytes, timeout: float = 10.0):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return read_response(s)


_victims = iter(range(1, 10 ** 6))


def victim_gets_its_own(port: int) -> None:
    """A plain request from another client, right after: its own response, from the backend."""
    n = next(_victims)
    status, _, body = exchange(port, b"GET /victim-%d HTTP/1.1\r\nHost: v\r\nCookie: session=s%d\r\n\r\n" % (n, n))
    assert (status, body) == (200, b"target=/victim-%d len=0\n" % n)


def header_values(headers, name: str) -> list[str]:
    return [v for k, v in headers if k == name.lower()]


def rss_kb(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))


def metric(admin_port: int, line_prefix: str) -> float:
    text = request(admin_port, "GET", "/metrics").body.decode()
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ------------------------------------------------------------------------------ the scripted backend

class Scripted(RecordingBackend):
    """The recording backend, with misbehaviours chosen by the request target (/r/NAME)."""

    def __init__(self):
        self.progress = 0            # body bytes seen by /r/count-body
        self.conn_of: dict[str, int] = {}   # target -> connection serial, to see what was pooled
        self.serial = 0
        super().__init__()

    def _serve(self, s, _server):
        with self.lock:
            self.serial += 1
            me = self.serial
        r = ConnReader(s)
        while True:
            try:
                head = r.head()
                if head is None:
                    return
                target = head.split(b" ", 2)[1].decode("latin-1")
                self.conn_of[target] = me
                if target.startswith("/r/"):
                    # scripts read only the head: each decides what to do with the body
                    with self.lock:
                        self.requests.append(("SCRIPT", target, [], b""))
                    if getattr(self, "script_" + target[3:].split("?")[0].replace("-", "_"))(s, r, head) == "close":
                        return
                    continue
                r.buf = head + b"\r\n\r\n" + r.buf   # a plain request: parse it whole by the book
                req = read_request(r)
            except Unparseable as e:
                with self.lock:
                    self.requests.append(("UNPARSEABLE", str(e), [], b""))
                return
            except EOFError:
                return
            with self.lock:
                self.requests.append(req)
            body = f"target={req[1]} len={len(req[3])}\n".encode()
            s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    # -- responses with bad or unusual framing
    def script_cl_te(self, s, r, head):
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        return "close"

    def script_cl_differ(self, s, r, head):
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!")
        return "close"

    def script_cl_equal(self, s, r, head):
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello")

    def script_conn_cl(self, s, r, head):
        s.sendall(b"HTTP/1.1 200 OK\r\nConnection: content-length, transfer-encoding\r\nContent-Length: 5\r\n\r\nhello")

    def script_te_gzip(self, s, r, head):
        s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n\x1f\x8b raw coded bytes")
        return "close"

    def script_te_gzip_chunked(self, s, r, head):
        s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n4\r\n\x1f\x8bab\r\n0\r\n\r\n")

    def script_bad_hex(self, s, r, head):
        size = head.split(b"size=")[1].split(b" ")[0]
        s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%s\r\nhello\r\n0\r\n\r\n" % size)
        return "close"

    def script_bare_lf(self, s, r, head):
        s.sendall(b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok")      # and holds the connection open
        time.sleep(3)
        return "close"

    def script_lf_inside(self, s, r, head):
        # CRLF-framed as we split it, but a client reading LF as a line end sees X-Injected too
        s.sendall(b"HTTP/1.1 200 OK\r\nX-A: a\nX-Injected: yes\r\nContent-Length: 2\r\n\r\nok")
        return "close"

    def script_die_in_head(self, s, r, head):
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Le")
        return "close"

    def script_switch(self, s, r, head):
        s.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: something\r\nConnection: Upgrade\r\n\r\n")
        time.sleep(0.5)    # then speak something else on it: it must never carry another request
        s.sendall(b"not http at all\r\n\r\n")

    def script_endless(self, s, r, head):
        piece = b"x" * 65536
        chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
        s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while not self.closed:
            s.sendall(chunk)

    def script_one_big_chunk(self, s, r, head):
        n = 100 << 20
        s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % n)
        piece = b"y" * 262144
        for _ in range(n // len(piece)):
            s.sendall(piece)
        s.sendall(b"\r\n0\r\n\r\n")

    def script_first_byte(self, s, r, head):
        s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n400\r\nfirst")
        time.sleep(3)          # the rest of the chunk comes much later
        s.sendall(b"x" * (0x400 - 5) + b"\r\n0\r\n\r\n")

    # -- backends and request bodies
    def script_early_413(self, s, r, head):
        s.sendall(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 9\r\nConnection: close\r\n\r\ntoo large")
        s.shutdown(socket.SHUT_WR)
        time.sleep(0.3)
        return "close"       # closes with the body unread: a reset for the edge's writes

    def script_no_read(self, s, r, head):
        while not self.closed:   # never reads the body, never answers
            time.sleep(0.1)
        return "close"

    def script_count_body(self, s, r, head):
        self.progress = len(r.buf)
        while self.progress < 200_000 and r.fill():
            self.progress = len(r.buf)
        return "close"

    def script_slow(self, s, r, head):
        time.sleep(1)
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")


@pytest.fixture(scope="module")
def backend():
    b = Scripted()
    yield b
    b.close()


@pytest.fixture(scope="module")
def edge(backend, tmp_path_factory):
    log = tmp_path_factory.mktemp("framing") / "access.log"
    # Request bodies stream here (--request-buffering off): these tests are about the streamed path's
    # framing and failures; the buffered one (the default) is tests/test_buffering.py's.
    e = Edge("--backends", backend.url, "--health-interval", "30", "--header-timeout", "2",
             "--request-buffering", "off",
             "--body-timeout", "2", "--read-timeout", "2", "--max-body-size", str(16 << 20),
             "--limit", "100000/s", "--key-limit", "spent=1/h", "--admin", "127.0.0.1:0",
             "--access-log", str(log), "--send-timeout", "2")
    e.access_log = log
    request(e.port, "GET", "/", {"X-Api-Key": "spent"})   # that key's only request this hour
    backend.take()
    yield e
    e.stop()


@pytest.fixture(autouse=True)
def fresh(backend):
    backend.take()       # each test sees only what its own requests did


def plain_requests(backend) -> list[tuple]:
    return [r for r in backend.take() if not r[1].startswith("/victim-") and r[1] != "/health"]


# -------------------------------------------------------------------- smuggling through Connection

def test_connection_naming_content_length_cannot_unframe_the_body(edge, backend):
    smuggled = b"GET /steal HTTP/1.1\r\nX-Ignore: "
    attack = (b"POST /a HTTP/1.1\r\nHost: a\r\nConnection: content-length\r\nContent-Length: %d\r\n\r\n%s"
              % (len(smuggled), smuggled))
    status, _, body = exchange(edge.port, attack)
    assert (status, body) == (200, b"target=/a len=%d\n" % len(smuggled))
    victim_gets_its_own(edge.port)
    got = plain_requests(backend)
    assert [(m, t, b) for m, t, _, b in got] == [("POST", "/a", smuggled)]
    assert header_values([(k.lower(), v) for k, v in got[0][2]], "content-length") == [str(len(smuggled))]


@pytest.mark.parametrize("token", ["host", "transfer-encoding", "Host, Content-Length, Transfer-Encoding"])
def test_connection_tokens_never_remove_host_or_framing(edge, backend, token):
    data = (b"POST /t HTTP/1.1\r\nHost: the-host\r\nConnection: %s\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\n\r\n" % token.encode())
    status, _, body = exchange(edge.port, data)
    assert (status, body) == (200, b"target=/t len=5\n")
    victim_gets_its_own(edge.port)
    (m, t, headers, b), = plain_requests(backend)
    h = [(k.lower(), v) for k, v in headers]
    assert header_values(h, "host") == ["the-host"] and b == b"hello"


def test_a_backend_response_naming_its_framing_in_connection_keeps_it(edge, backend):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as s:
        s.sendall(b"GET /r/conn-cl HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = read_response(s)
        assert (status, body) == (200, b"hello")
        assert header_values(headers, "content-length") == ["5"]
        s.sendall(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")      # the client connection is still in step
        assert read_response(s)[2] == b"target=/after len=0\n"
    victim_gets_its_own(edge.port)


# ---------------------------------------------------------------------- one Host, one framing header

def test_upstream_gets_exactly_one_host_and_one_framing_header(edge, backend):
    cases = [
        (b"POST /dup HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc", b"abc"),
        (b"POST /list HTTP/1.1\r\nHost: h\r\nContent-Length: 3, 3\r\n\r\nabc", b"abc"),
        (b"POST /chunked HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", b"abc"),
        (b"POST /old HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc", b"abc"),
    ]
    for data, want in cases:
        assert exchange(edge.port, data)[0] == 200
        (m, t, headers, b), = plain_requests(backend)
        h = [(k.lower(), v) for k, v in headers]
        assert b == want
        assert len(header_values(h, "host")) == 1, (t, h)
        framing = [k for k, _ in h if k in ("content-length", "transfer-encoding")]
        assert framing == ["content-length"] and header_values(h, "content-length") == ["3"], (t, h)
        victim_gets_its_own(edge.port)


def test_an_empty_host_is_refused_and_reaches_no_backend(edge, backend):
    status, headers, _ = exchange(edge.port, b"GET /e HTTP/1.1\r\nHost:\r\n\r\n")
    assert status == 400
    victim_gets_its_own(edge.port)
    assert plain_requests(backend) == []


# ------------------------------------------------------------------------- chunked request bodies

@pytest.mark.parametrize("size", [b"0x5", b"+5", b"-5", b"5_0", b" 5", b"5 ", b"", b"fffffffffffffffff"])
def test_a_malformed_small_chunked_body_reaches_no_backend(edge, backend, size):
    conns = backend.connections
    data = (b"POST /m HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n%s\r\nhello\r\n0\r\n\r\n"
            b"GET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n" % size)
    status, headers, _ = exchange(edge.port, data)
    assert status == 400 and ("connection", "close") in headers
    assert plain_requests(backend) == []              # not even the head
    assert backend.connections == conns               # not even a connection
    victim_gets_its_own(edge.port)


def test_a_chunk_longer_than_declared_reaches_no_backend(edge, backend):
    data = b"POST /m HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhello\r\n0\r\n\r\n"
    assert exchange(edge.port, data)[0] == 400
    assert plain_requests(backend) == []
    victim_gets_its_own(edge.port)


def test_a_large_chunked_body_streams_and_a_mid_stream_error_closes_upstream(edge, backend):
    big = b"z" * 100_000
    good = b"POST /big HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(big), big)
    assert exchange(edge.port, good)[2] == b"target=/big len=100000\n"
    (m, t, headers, b), = plain_requests(backend)
    assert b == big and ("transfer-encoding", "chunked") in [(k.lower(), v) for k, v in headers]

    bad = (b"POST /bad HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0x1\r\nA\r\n0\r\n\r\n"
           % (len(big), big))
    status, headers, _ = exchange(edge.port, bad)
    assert status == 400 and ("connection", "close") in headers
    # The backend got a head and part of a body, then the connection closed: no request was completed
    # on it, and nothing after it rides on that connection.
    assert [r for r in plain_requests(backend) if r[0] != "UNPARSEABLE"] == []
    victim_gets_its_own(edge.port)
    victim_gets_its_own(edge.port)


def test_a_large_chunked_body_reaches_the_backend_as_it_arrives(edge, backend):
    backend.progress = 0
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as s:
        s.sendall(b"POST /r/count-body HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"40000\r\n" + b"q" * 100_000)             # one 256 KiB chunk, 100 KB of it sent
        wait_until(lambda: backend.progress >= 90_000, 5, what="the first 100 KB at the backend")
    backend.take()


# ---------------------------------------------------------------------------------- response framing

@pytest.mark.parametrize("script", ["cl-te", "cl-differ", "die-in-head", "bare-lf", "lf-inside"])
def test_ambiguous_or_broken_response_framing_is_a_502(edge, backend, script):
    """bare-lf: a head with LF line ends, its connection held open, is a 502 when it arrives, not a 504
    after read_timeout; lf-inside: a bare LF inside a head that arrived whole is a 502, never relayed."""
    before = metric(edge.admin_port, 'lb_requests_total{backend="%s"}' % backend.url)
    status, headers, body = exchange(edge.port, b"GET /r/%s HTTP/1.1\r\nHost: h\r\n\r\n" % script.encode())
    assert status == 502 and not header_values(headers, "transfer-encoding")
    assert not header_values(headers, "x-injected")
    if script in ("bare-lf", "lf-inside"):
        edge.wait_log(r"GET /r/%s -> 502 \(bare CR or LF in the response head\)" % script)
    victim_gets_its_own(edge.port)
    # (the victim's request is counted just after its answer is relayed: it may not be yet)
    wait_until(lambda: metric(edge.admin_port, 'lb_requests_total{backend="%s"}' % backend.url) >= before + 2, 5,
               what="both requests counted")
    if script == "die-in-head":
        assert metric(edge.admin_port, 'lb_upstream_errors_total{backend="%s",kind="reset"}' % backend.url) >= 1
        assert "connection closed inside the request head" not in edge.log()
    backend.take()


def test_equal_duplicate_response_lengths_reach_the_client_once(edge, backend):
    status, headers, body = exchange(edge.port, b"GET /r/cl-equal HTTP/1.1\r\nHost: h\r\n\r\n")
    assert (status, body, header_values(headers, "content-length")) == (200, b"hello", ["5"])
    backend.take()


def test_a_coding_other_than_final_chunked_is_relayed_until_close(edge, backend):
    status, headers, body = exchange(edge.port, b"GET /r/te-gzip HTTP/1.1\r\nHost: h\r\n\r\n")
    assert status == 200 and header_values(headers, "transfer-encoding") == ["gzip"]
    assert ("connection", "close") in headers and body == b"\x1f\x8b raw coded bytes"
    status, headers, body = exchange(edge.port, b"GET /r/te-gzip-chunked HTTP/1.1\r\nHost: h\r\n\r\n")
    assert header_values(headers, "transfer-encoding") == ["gzip, chunked"] and body == b"\x1f\x8bab"
    victim_gets_its_own(edge.port)
    backend.take()


@pytest.mark.parametrize("size", [b"0x5", b"+5", b"-5", b"0_5", b" 5"])
def test_response_chunk_sizes_are_strict_hex(edge, backend, size):
    status, _, _ = exchange(edge.port, b"GET /r/bad-hex?size=%s HTTP/1.1\r\nHost: h\r\n\r\n" % size.replace(b" ", b"%20"))
    assert status == 502
    victim_gets_its_own(edge.port)
    backend.take()


def test_a_101_without_a_tunnel_is_never_pooled(edge, backend):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as s:
        s.sendall(b"GET /r/switch HTTP/1.1\r\nHost: h\r\n\r\n")
        status, headers, _ = read_response(s)
        assert status == 101 and ("connection", "close") in headers
    for _ in range(3):
        victim_gets_its_own(edge.port)
    assert exchange(edge.port, b"GET /after-101 HTTP/1.1\r\nHost: h\r\n\r\n")[2] == b"target=/after-101 len=0\n"
    assert backend.conn_of["/after-101"] != backend.conn_of["/r/switch"]
    backend.take()


# ------------------------------------------------------------------------------ bounded streaming

def test_the_first_byte_of_a_chunk_reaches_the_client_before_the_rest(edge, backend):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as s:
        s.sendall(b"GET /r/first-byte HTTP/1.1\r\nHost: h\r\n\r\n")
        start = time.monotonic()
        got = b""
        while b"first" not in got:
            got += s.recv(65536)
        assert time.monotonic() - start < 2.5        # the backend sends the rest after 3 s
    backend.take()


def _slow_reader(port: int, target: bytes, seconds: float, samples: list, pid: int, rate: int = 1 << 20):
    """Read a response at about `rate` bytes/s for `seconds`, sampling the edge's RSS."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: h\r\n\r\n")
        end = time.monotonic() + seconds
        got = 0
        while time.monotonic() < end:
            got += len(s.recv(65536))
            samples.append(rss_kb(pid))
            time.sleep(65536 / rate)
        return got


def test_rss_stays_flat_with_an_endless_chunked_stream_to_a_slow_client(edge, backend):
    samples: list[int] = []
    got = _slow_reader(edge.port, b"/r/endless", 6, samples, edge.popen.pid)
    assert got > 1 << 20
    settled = samples[len(samples) // 4:]        # after the first buffers filled
    assert max(settled) - min(settled) < 10 * 1024, (min(settled), max(settled))
    victim_gets_its_own(edge.port)
    backend.take()


def test_rss_stays_flat_with_one_100_mib_chunk(edge, backend):
    before = rss_kb(edge.popen.pid)
    peak = [before]
    total = 0
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as s:
        s.sendall(b"GET /r/one-big-chunk HTTP/1.1\r\nHost: h\r\n\r\n")
        r = ConnReader(s)
        head = r.head()
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
        while True:
            size = int(r.line(), 16)
            if size == 0:
                break
            while size > 0:
                if not r.buf:
                    r.fill()
                    peak.append(rss_kb(edge.popen.pid))
                take = min(size, len(r.buf))
                r.buf = r.buf[take:]
                size -= take
                total += take
            assert r.exact(2) == b"\r\n"
    assert total == 100 << 20
    assert max(peak) - before < 10 * 1024, (before, max(peak))
    victim_gets_its_own(edge.port)
    backend.take()


# -------------------------------------------------------------------- each failure, its exact answer

def _send_in_thread(s: socket.socket, data: bytes):
    def run():
        try:
            s.sendall(data)
        except OSError:
            pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_backend_that_stops_reading_the_body_is_a_504(edge, backend):
    body = b"w" * (12 << 20)
    with socket.create_connection(("127.0.0.1", edge.port), timeout=20) as s:
        s.sendall(b"POST /r/no-read HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % len(body))
        t = _send_in_thread(s, body)
        status, headers, text = read_response(s)
        t.join(10)
    assert status == 504 and b"timed out" in text
    assert "stopped reading the request body" in edge.log()
    victim_gets_its_own(edge.port)
    backend.take()


def test_an_early_backend_answer_is_relayed(edge, backend):
    body = b"w" * (12 << 20)
    with socket.create_connection(("127.0.0.1", edge.port), timeout=20) as s:
        s.sendall(b"POST /r/early-413 HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % len(body))
        t = _send_in_thread(s, body)
        status, headers, text = read_response(s)
        t.join(10)
    assert (status, text) == (413, b"too large") and ("connection", "close") in headers
    victim_gets_its_own(edge.port)
    backend.take()


def test_a_client_that_aborts_its_upload_is_a_499_logged_and_counted(edge, backend):
    url = backend.url
    before_req = metric(edge.admin_port, 'lb_requests_total{backend="%s"}' % url)
    before_499 = metric(edge.admin_port, 'lb_edge_responses_total{code="499"}')
    with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as s:
        s.sendall(b"POST /aborted HTTP/1.1\r\nHost: h\r\nContent-Length: 200000\r\n\r\n" + b"a" * 100_000)
        # closed half way: the head went upstream with the first piece (a large body streams)
    wait_until(lambda: metric(edge.admin_port, 'lb_edge_responses_total{code="499"}') == before_499 + 1, 5,
               what="the 499 counted")
    assert metric(edge.admin_port, 'lb_requests_total{backend="%s"}' % url) == before_req + 1
    wait_until(lambda: re.search(r'"POST /aborted" 499 \S+ ' + re.escape(url), edge.access_log.read_text()), 5,
               what="the 499 in the access log")
    assert "Traceback" not in edge.log()
    victim_gets_its_own(edge.port)
    backend.take()


def test_a_client_that_stops_reading_meets_the_send_timeout(edge, backend):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET /r/endless?stalled HTTP/1.1\r\nHost: h\r\n\r\n")
        s.recv(100)
        start = time.monotonic()
        wait_until(lambda: re.search(r'"GET /r/endless\?stalled" 499 ', edge.access_log.read_text()), 10,
                   what="the stalled client given up on (send timeout 2 s)")
        assert time.monotonic() - start < 8
    victim_gets_its_own(edge.port)
    backend.take()


def test_a_new_silent_connection_is_closed_after_header_timeout(edge):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as s:
        start = time.monotonic()
        assert s.recv(100) == b""
        assert time.monotonic() - start < 5          # header timeout 2 s, keep-alive timeout 75 s
    victim_gets_its_own(edge.port)


@pytest.mark.parametrize("head,want", [
    (b"POST /big HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % (32 << 20), 413),
    (b"POST /limited HTTP/1.1\r\nHost: h\r\nX-Api-Key: spent\r\nContent-Length: %d\r\n\r\n" % (4 << 20), 429),
])
def test_an_early_refusal_with_a_body_arriving_is_a_lingering_close(edge, backend, head, want):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as s:
        s.sendall(head)
        t = _send_in_thread(s, b"b" * (4 << 20))
        status, headers, _ = read_response(s)          # a reset would lose this
        t.join(10)
    assert status == want and ("connection", "close") in headers
    assert plain_requests(backend) == []
    victim_gets_its_own(edge.port)


# --------------------------------------------------------------------- accept loop out of descriptors

def _cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def test_out_of_descriptors_the_accept_loop_backs_off_and_recovers(backend):
    launcher = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48)); "
                "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
    p = Proc([PY, "-c", launcher, "edge.py", "--listen", "127.0.0.1:0", "--backends", backend.url,
              "--health-interval", "30", "--header-timeout", "30", "--cpu-affinity", "off"], "edge-emfile")
    try:
        port = int(p.wait_log(r"listening on 127\.0\.0\.1:(\d+)").group(1))
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(60)]
        p.wait_log(r"accept: Too many open files; pausing accepts")
        c0 = _cpu_seconds(p.popen.pid)
        t0 = time.monotonic()
        time.sleep(2)      # measuring CPU over a fixed interval: this sleep is the measurement window
        busy = (_cpu_seconds(p.popen.pid) - c0) / (time.monotonic() - t0)
        assert busy < 0.3, f"accept loop spinning: {busy:.0%} CPU"
        for c in clients:
            c.close()
        wait_until(lambda: _try_get(port), 15, what="the edge serving again")
        assert p.alive()
    finally:
        p.stop()
        backend.take()


def _try_get(port: int) -> bool:
    try:
        return exchange(port, b"GET /again HTTP/1.1\r\nHost: h\r\n\r\n", timeout=2)[0] == 200
    except (OSError, AssertionError):
        return False


# ------------------------------------------------------------------------------ reload while serving

def _toml(path: Path, url: str, trusted: bool) -> None:
    path.write_text(f'[[backends]]\nurl = "{url}"\n[health]\ninterval = 30\n[limits]\n'
                    f'trusted_proxies = {["127.0.0.1"] if trusted else []}\n'.replace("'", '"'))


def test_reload_never_hands_an_in_flight_request_a_closed_pool_and_re_evaluates_trust(tmp_path):
    a, b = RecordingBackend(), RecordingBackend()
    conf = tmp_path / "edge.toml"
    log = tmp_path / "access.log"
    _toml(conf, a.url, trusted=True)
    e = Edge("--config", str(conf), "--access-log", str(log))
    try:
        with socket.create_connection(("127.0.0.1", e.port), timeout=10) as keep, \
                socket.create_connection(("127.0.0.1", e.port), timeout=10) as inflight:
            keep.sendall(b"GET /trust-1 HTTP/1.1\r\nHost: h\r\nX-Forwarded-For: 203.0.113.7\r\n\r\n")
            assert read_response(keep)[0] == 200
            # in flight: backend a picked (the edge sends 100 Continue after the pick), the body still
            # arriving when the reload removes a and closes its pool
            inflight.sendall(b"POST /inflight HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n"
                             b"Expect: 100-continue\r\n\r\n")
            assert inflight.recv(100).startswith(b"HTTP/1.1 100 Continue")
            inflight.sendall(b"hello")
            _toml(conf, b.url, trusted=False)
            e.signal(signal.SIGHUP)
            e.wait_log(r"backend http://127\.0\.0\.1:%d removed \(drained\)" % a.port)
            inflight.sendall(b"world")
            status, _, body = read_response(inflight)
            assert (status, body) == (200, b"target=/inflight len=10\n")
            keep.sendall(b"GET /trust-2 HTTP/1.1\r\nHost: h\r\nX-Forwarded-For: 203.0.113.7\r\n\r\n")
            assert read_response(keep)[0] == 200
        assert [r[1] for r in b.take() if r[1] != "/health"] == ["/inflight", "/trust-2"]
        assert [r[1] for r in a.take() if r[1] != "/health"] == ["/trust-1"]
        wait_until(lambda: "/trust-2" in log.read_text(), 5, what="access log")
        text = log.read_text()
        assert re.search(r'203\.0\.113\.7 "GET /trust-1" ', text)      # trusted then
        assert re.search(r'127\.0\.0\.1 "GET /trust-2" ', text)        # not after the reload
        assert "Traceback" not in e.log()
    finally:
        e.stop()
        a.close()
        b.close()


# ------------------------------------------------------------------------------------ health probes

def test_health_probes_have_a_total_deadline_and_do_not_read_an_endless_body():
    def trickle(s, server):
        ConnReader(s).head()
        s.sendall(b"HTTP/1.1 200 OK\r\n")
        while not server.closed:          # one byte of head every 0.1 s: each read is quick, the whole is not
            s.sendall(b"X")
            time.sleep(0.1)

    def endless(s, server):
        ConnReader(s).head()
        s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while not server.closed:
            s.sendall(b"1000\r\n" + b"e" * 4096 + b"\r\n")

    slow, streaming = RawServer(trickle), RawServer(endless)
    e = Edge("--backends", f"{slow.url},{streaming.url}", "--health-interval", "0.5", "--health-timeout", "0.4",
             "--unhealthy-threshold", "1", "--healthy-threshold", "1", "--admin", "127.0.0.1:0")
    try:
        e.wait_log(r"backend %s DOWN: .*timeout after 0\.4s" % re.escape(slow.url), timeout=10)
        status = wait_until(lambda: _probed(e.admin_port, streaming.url), 10, what="a probe of the endless body")
        assert status["state"] == "UP" and status["last_probe"] == "HTTP 200"
        assert f"backend {streaming.url} DOWN" not in e.log()
    finally:
        e.stop()
        slow.close()
        streaming.close()


def _probed(admin_port: int, url: str):
    import json
    for b in json.loads(request(admin_port, "GET", "/status").body)["backends"]:
        if b["url"] == url and b["last_probe"]:
            return b
    return None


# ------------------------------------------------------------------------------- slow uploads

def test_a_slow_small_upload_holds_no_backend_connection(backend):
    # One backend connection in all: if the trickling upload held it, the other request would wait
    # pool_timeout and get a 503.
    e = Edge("--backends", backend.url, "--health-interval", "30", "--pool-maxsize", "1", "--pool-timeout", "0.5",
             "--body-timeout", "5")
    try:
        with socket.create_connection(("127.0.0.1", e.port), timeout=10) as slow:
            slow.sendall(b"POST /slow-upload HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab")
            for n in range(3):
                status, _, body = exchange(e.port, b"GET /other-%d HTTP/1.1\r\nHost: h\r\n\r\n" % n)
                assert (status, body) == (200, b"target=/other-%d len=0\n" % n)
            assert [r[1] for r in plain_requests(backend)] == ["/other-0", "/other-1", "/other-2"]
            slow.sendall(b"cde\r\n0\r\n\r\n")
            assert read_response(slow)[2] == b"target=/slow-upload len=5\n"
    finally:
        e.stop()


def test_a_large_upload_below_the_minimum_rate_is_cut_off_with_408(backend):
    e = Edge("--backends", backend.url, "--health-interval", "30", "--body-timeout", "1", "--body-min-rate", "100000")
    try:
        with socket.create_connection(("127.0.0.1", e.port), timeout=10) as s:
            s.sendall(b"POST /crawl HTTP/1.1\r\nHost: h\r\nContent-Length: 10000000\r\n\r\n" + b"c" * 70000)
            start = time.monotonic()
            got = b""
            try:
                while time.monotonic() - start < 8:   # 1 byte every 0.2 s: never silent for body_timeout
                    s.sendall(b"c")
                    s.settimeout(0.2)
                    try:
                        got += s.recv(65536)
                        if b"\r\n\r\n" in got:
                            break
                    except socket.timeout:
                        pass
            except OSError:
                pass
            assert got.startswith(b"HTTP/1.1 408"), got[:100]
            assert time.monotonic() - start < 5      # 1 s + 70 KB at 100 KB/s, plus margin
        victim_gets_its_own(e.port)
    finally:
        e.stop()
