"""Hostile input and slow clients, in raw bytes over a socket (a client library would sanitise them).

Each case checks the status, that the backend received nothing, and that the edge still serves a
clean request afterwards.
"""

import ctypes
import os
import signal
import socket
import ssl
import time

import pytest

from tests.support import Edge, raw, request, wait_until


@pytest.fixture(scope="module")
def edge(backend):
    e = Edge("--backends", backend.url, "--health-interval", "30", "--max-body-size", "1000",
             "--header-timeout", "1", "--body-timeout", "1", "--limit", "1000/s", "--key-limit", "spent=1/h")
    request(e.port, "GET", "/", {"X-Api-Key": "spent"})   # that key's only request this hour
    yield e
    e.stop()


def read_response(s: socket.socket) -> bytes:
    """One whole Content-Length response from a raw socket."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < n:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def status_of(resp: bytes) -> int:
    assert resp.startswith(b"HTTP/1.1 "), resp[:80]
    return int(resp[9:12])


H = b"Host: x\r\n"
BAD = {
    # request smuggling: framing a backend could read differently
    "cl-and-te": (b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    "two-cls": (b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 4\r\nContent-Length: 5\r\n\r\nabcde", 400),
    "cl-list": (b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 4, 5\r\n\r\nabcde", 400),
    "cl-signed": (b"POST / HTTP/1.1\r\n" + H + b"Content-Length: +4\r\n\r\nabcd", 400),
    "te-chunked-identity": (b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", 501),
    "te-xchunked": (b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", 400),
    "te-space-before-colon": (b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n", 400),
    "te-twice": (b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    "te-gzip": (b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: gzip\r\n\r\n", 501),
    "chunk-size-bad": (b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", 400),
    "chunk-size-negative": (b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n-1\r\nabc\r\n0\r\n\r\n", 400),
    "chunk-missing-crlf": (b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabcXY0\r\n\r\n", 400),
    "chunk-longer": (b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n", 400),
    # limits
    "uri-too-long": (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n" + H + b"\r\n", 414),
    "header-line-too-long": (b"GET / HTTP/1.1\r\n" + H + b"X-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
    "header-block-too-large": (b"GET / HTTP/1.1\r\n" + H + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 4000) for i in range(20)) + b"\r\n", 431),
    "too-many-headers": (b"GET / HTTP/1.1\r\n" + H + b"".join(b"X-%d: 1\r\n" % i for i in range(120)) + b"\r\n", 431),
    "body-too-large": (b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 5000\r\n\r\n" + b"a" * 5000, 413),
    "chunked-too-large": (b"POST / HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n" + b"3e8\r\n" + b"a" * 1000 + b"\r\n" + b"3e8\r\n" + b"a" * 1000 + b"\r\n0\r\n\r\n", 413),
    # malformed
    "bad-method": (b"G@T / HTTP/1.1\r\n" + H + b"\r\n", 400),
    "bad-version": (b"GET / HTTX/1.1\r\n" + H + b"\r\n", 400),
    "http2-version": (b"GET / HTTP/2.0\r\n" + H + b"\r\n", 505),
    "http09": (b"GET /\r\n\r\n", 400),
    "extra-spaces": (b"GET  / HTTP/1.1\r\n" + H + b"\r\n", 400),
    "ctl-in-value": (b"GET / HTTP/1.1\r\n" + H + b"X-A: a\x01b\r\n\r\n", 400),
    "nul-in-value": (b"GET / HTTP/1.1\r\n" + H + b"X-A: a\x00b\r\n\r\n", 400),
    "bare-lf-in-value": (b"GET / HTTP/1.1\r\n" + H + b"X-A: a\nX-B: b\r\n\r\n", 400),
    "bare-cr-in-value": (b"GET / HTTP/1.1\r\n" + H + b"X-A: a\rX-B: b\r\n\r\n", 400),
    "space-in-name": (b"GET / HTTP/1.1\r\n" + H + b"X A: b\r\n\r\n", 400),
    "obs-fold": (b"GET / HTTP/1.1\r\n" + H + b"X-A: a\r\n  folded\r\n\r\n", 400),
    "no-host": (b"GET / HTTP/1.1\r\n\r\n", 400),
    "two-hosts": (b"GET / HTTP/1.1\r\n" + H + b"Host: y\r\n\r\n", 400),
    "absolute-form-elsewhere": (b"GET http://evil.example/ HTTP/1.1\r\n" + H + b"\r\n", 400),
    "ctl-in-target": (b"GET /a\x7fb HTTP/1.1\r\n" + H + b"\r\n", 400),
    "bad-expect": (b"GET / HTTP/1.1\r\n" + H + b"Expect: 200-ok\r\n\r\n", 417),
    "oversized-api-key": (b"GET / HTTP/1.1\r\n" + H + b"X-Api-Key: " + b"k" * 300 + b"\r\n\r\n", 400),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_gets_its_status_and_nothing_reaches_the_backend(backend, edge, case):
    data, want = BAD[case]
    before = backend.stats()["count"]
    out = raw(edge.port, data)
    assert status_of(out) == want, out[:200]
    assert b"connection: close" in out.lower()        # framing is lost: the connection ends
    assert backend.stats()["count"] == before
    assert request(edge.port, "GET", "/").status == 200   # and the edge serves the next client
    assert edge.alive()


def test_the_same_length_twice_is_one_length(backend, edge):
    out = raw(edge.port, b"POST /echo HTTP/1.1\r\n" + H + b"Content-Length: 3\r\nContent-Length: 3\r\n"
              b"Connection: close\r\n\r\nabc")
    assert status_of(out) == 200 and b'"body_len": 3' in out


def test_absolute_form_for_our_own_host_is_served(edge):
    out = raw(edge.port, b"GET http://x/echo HTTP/1.1\r\n" + H + b"Connection: close\r\n\r\n")
    assert status_of(out) == 200 and b'"target": "/echo"' in out


def test_slowloris_head_is_cut_off_with_408_while_others_are_served(backend, edge):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as s:
        start = time.monotonic()
        got = b""
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            # a clean client is served meanwhile, promptly
            if byte == ord("X"):
                t = time.monotonic()
                assert request(edge.port, "GET", "/").status == 200
                assert time.monotonic() - t < 1.0
            r, _, _ = __import__("select").select([s], [], [], 0.05)
            if r:
                break
        got = s.recv(1000)
        assert status_of(got) == 408
        assert 0.9 < time.monotonic() - start < 4     # --header-timeout 1, whatever the trickle


def test_trickled_body_is_cut_off(backend, edge):
    before = backend.stats()["count"]
    with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\n" + H + b"Content-Length: 100\r\n\r\nabc")
        start = time.monotonic()
        got = b""
        while chunk := s.recv(1000):
            got += chunk
        assert status_of(got) == 408               # answered and closed after --body-timeout 1
        assert b"Connection: close" in got
        assert 0.9 < time.monotonic() - start < 4
    assert backend.stats()["count"] == before


def test_expect_100_continue_is_only_sent_for_a_request_that_will_be_served(edge):
    # served: 100 Continue, then the final response after the body
    with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\n" + H + b"Content-Length: 3\r\nExpect: 100-continue\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(b"abc")
        assert b'"body_len": 3' in read_response(s)
    # refused before the body: 413 (too large) and 429 (limited), never invited
    for head, want in ((b"Content-Length: 5000\r\n", 413), (b"Content-Length: 3\r\nX-Api-Key: spent\r\n", 429)):
        with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as s:
            s.sendall(b"POST /echo HTTP/1.1\r\n" + H + head + b"Expect: 100-continue\r\n\r\n")
            assert status_of(s.recv(1000)) == want


def test_idle_keepalive_connections_are_closed(backend):
    e = Edge("--backends", backend.url, "--keepalive-timeout", "0.5", "--health-interval", "30")
    try:
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\n" + H + b"\r\n")
            assert status_of(s.recv(1000)) == 200
            start = time.monotonic()
            assert s.recv(1000) == b""             # the edge closes the idle connection
            assert time.monotonic() - start < 3
    finally:
        e.stop()


def test_connections_past_the_cap_are_refused_fast_and_the_held_ones_still_served(backend):
    """Every connection busy (each inside a request head; an idle keep-alive one would give way:
    tests/test_client_pressure.py): the next one is refused at once."""
    e = Edge("--backends", backend.url, "--max-connections", "4", "--health-interval", "30")
    held = []
    try:
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", e.port), timeout=5)
            # The next head's first line comes with the first request (pipelined): the connection is
            # busy from its first answer on. Sent after the answer, it raced the edge's thread: under
            # load the connection could still be idle (between requests) when the 5th arrived, and an
            # idle one rightly gives way to it.
            s.sendall(b"GET / HTTP/1.1\r\n" + H + b"\r\n" + b"GET / HTTP/1.1\r\n")
            assert status_of(s.recv(1000)) == 200
            held.append(s)
        start = time.monotonic()
        out = raw(e.port, b"")       # the 503 comes on accept, before any request is read
        assert status_of(out) == 503 and time.monotonic() - start < 1
        held[0].sendall(H + b"\r\n")
        assert status_of(held[0].recv(1000)) == 200
        held.pop().close()
        wait_until(lambda: status_of(raw(e.port, b"GET / HTTP/1.1\r\n" + H + b"Connection: close\r\n\r\n")) == 200,
                   timeout=5, what="a freed slot")
    finally:
        for s in held:
            s.close()
        e.stop()


def test_many_slow_connections_hold_no_more_than_the_cap(backend):
    """A slowloris crowd: threads stay bounded by --max-connections, clean clients are refused or served
    but never hang, and the edge recovers when the crowd leaves."""
    e = Edge("--backends", backend.url, "--max-connections", "20", "--header-timeout", "2",
             "--health-interval", "30")
    crowd = []
    try:
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", e.port), timeout=5)
            s.sendall(b"GET / HTTP/1.1\r\n")
            crowd.append(s)
        threads = int(open(f"/proc/{e.popen.pid}/status").read().split("Threads:")[1].split()[0])
        assert threads <= 20 + 10, threads
        for s in crowd:
            s.close()
        wait_until(lambda: status_of(raw(e.port, b"GET / HTTP/1.1\r\n" + H + b"Connection: close\r\n\r\n")) == 200,
                   timeout=5, what="service after the crowd left")
    finally:
        e.stop()


# A response's send is bounded by send_timeout, not by what the request head's deadline left

def _late_reader(s, size: int) -> int:
    """The client's timing is the subject here (sleeps are its behaviour, not synchronisation): the
    head's last piece is awaited with ~1.5 s of the 4 s header_timeout left, then the client starts
    reading 8 s late. Before the fix the edge's send gave up well before (plain: after ~3 x 1.5 s, the
    kernel's zero-window probes; TLS: after 1.5 s). The body bytes the client got."""
    s.sendall(b"GET /big?bytes=%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" % size)
    time.sleep(HEADER_TIMEOUT - 1.5)
    s.sendall(b"X-A: 1\r\n")
    time.sleep(0.05)
    s.sendall(b"\r\n")
    time.sleep(8.0)
    n = 0
    while True:
        d = s.recv(1 << 20)
        if not d:
            break
        n += len(d)
    s.close()
    return n


def _small_window_socket(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)   # no autotuning: a fixed window
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    return s


SIZE = 32 * 1024 * 1024          # far more than both sockets' buffers hold


HEADER_TIMEOUT = 4.0             # what matters is the ~1.5 s it leaves, and the client's 8 s late start


def test_a_response_is_not_cut_by_what_was_left_of_the_head_deadline(backend):
    """The client socket's send timeout was whatever its last read had set: a head completed near the
    header deadline left ~1.5 s to write a large response to a client that reads it a little late."""
    e = Edge("--backends", backend.url, "--header-timeout", str(HEADER_TIMEOUT))
    try:
        n = _late_reader(_small_window_socket(e.port), SIZE)
        assert n > SIZE, f"{n} of {SIZE} body bytes"
    finally:
        e.stop()


def test_over_tls_too_a_response_is_not_cut_by_what_was_left_of_the_head_deadline(backend, pki):
    """The same over TLS, where the socket has one timeout for both directions: after a read the edge
    puts send_timeout back before it writes."""
    e = Edge("--backends", backend.url, "--header-timeout", str(HEADER_TIMEOUT), "--tls-cert", pki["cert1"],
             "--tls-key", pki["key1"])
    try:
        ctx = ssl.create_default_context(cafile=pki["ca"])
        n = _late_reader(ctx.wrap_socket(_small_window_socket(e.port), server_hostname="127.0.0.1"), SIZE)
        assert n > SIZE, f"{n} of {SIZE} body bytes"
    finally:
        e.stop()


# Framing that must not wait for header_timeout, and deadlines that signals must not stretch

def _exchange(port: int, data: bytes) -> bytes:
    """One request in one send (one read for the edge, on loopback), Connection: close; all of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while d := s.recv(65536):
            out += d
        return out


def _chunk_line(n: int) -> bytes:
    """A chunk-size line of n bytes (before its CRLF): size 5 and an extension padding it out."""
    return b"5;ext=" + b"x" * (n - 6)


def test_a_chunk_line_over_1_kib_is_refused_even_when_it_arrives_in_one_read(backend):
    """The 1 KiB bound on a chunk-size line held only when the line was split across reads: a 5 kB
    extension arriving in one read was accepted (request side: forwarded; response side: relayed)."""
    from tests.rawserver import ConnReader, RawServer

    def answer(s, _server):           # a backend whose response's first chunk line is `line`, one write
        r = ConnReader(s)
        while (head := r.head()) is not None:
            n = int(head.split(b" ", 2)[1].rsplit(b"/", 1)[1])
            s.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%s\r\nhello\r\n0\r\n\r\n"
                      % _chunk_line(n))

    raw_backend = RawServer(answer)
    e = Edge("--backends", backend.url, "--health-interval", "30")
    r = Edge("--backends", raw_backend.url, "--health-interval", "30", "--health-path", "/health/1024")
    try:
        for n, want in ((1024, b"HTTP/1.1 200 "), (1025, b"HTTP/1.1 400 "), (5000, b"HTTP/1.1 400 ")):
            body = b"%s\r\nhello\r\n0\r\n\r\n" % _chunk_line(n)
            got = _exchange(e.port, b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                    b"Connection: close\r\n\r\n" + body)
            assert got.startswith(want), (n, got[:200])
        for n, want in ((1024, b"HTTP/1.1 200 "), (1025, b"HTTP/1.1 502 "), (5000, b"HTTP/1.1 502 ")):
            got = _exchange(r.port, b"GET /line/%d HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % n)
            assert got.startswith(want), (n, got[:200])
        assert request(e.port).status == 200          # and it still serves
    finally:
        e.stop()
        r.stop()
        raw_backend.close()


@pytest.mark.parametrize("head", [b"GET /lf HTTP/1.1\nHost: x\n\n", b"GET /lf HTTP/1.1\r\nHost: x\n\n",
                                  b"GET /cr HTTP/1.1\rHost: x\r\r"], ids=["lf", "lf-after-crlf", "cr"])
def test_a_head_with_bare_line_ends_is_answered_at_once_not_after_header_timeout(backend, head):
    """The edge refuses a bare LF (or CR) in a request head, as HAProxy does (SECURITY.md: a line end
    a backend may split differently). But a head with LF line ends never showed the CRLFCRLF the
    reader waited for: the 400 came after header_timeout (30 s here). Now it comes at once."""
    e = Edge("--backends", backend.url, "--health-interval", "30", "--header-timeout", "30")
    try:
        with socket.create_connection(("127.0.0.1", e.port), timeout=10) as s:   # << 30 s
            s.sendall(head)                  # and the connection stays open: no EOF to end the wait
            got = s.recv(65536)
        assert got.startswith(b"HTTP/1.1 400 ") and b"bare CR or LF" in got, got
        # A CRLF split across reads is no bare CR: the head still completes and is served.
        with socket.create_connection(("127.0.0.1", e.port), timeout=10) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for piece in (b"GET /split HTTP/1.1\r", b"\nHost: x\r", b"\n\r", b"\n"):
                s.sendall(piece)
                time.sleep(0.05)             # the client's pace (separate reads), not synchronisation
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        e.stop()


_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


def _tgkill_all_but_main(pid: int, sig: int) -> None:
    """sig to each thread of pid but its main one, as the kernel may pick any thread for a process's
    signal (os.kill would always offer it to the main thread first)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for tid in os.listdir(f"/proc/{pid}/task"):
        if int(tid) != pid:
            libc.syscall(_TGKILL, pid, int(tid), sig)


@pytest.mark.skipif(_TGKILL is None, reason="tgkill's number is known here for x86_64 and aarch64 only")
def test_a_signal_storm_does_not_stretch_a_read_deadline(backend):
    """EINTR restarted a read with the socket's whole timeout again: a client that stopped inside its
    head while the edge was sent a SIGUSR1 (log reopen) every 0.1 s was never given its 408
    (header_timeout 2 s). Now every thread blocks the handled signals and one thread sigwait()s them."""
    e = Edge("--backends", backend.url, "--health-interval", "0.5", "--header-timeout", "2")
    try:
        with socket.create_connection(("127.0.0.1", e.port), timeout=15) as s:
            s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n")          # ... and nothing more
            s.setblocking(False)
            start = time.monotonic()
            got = b""
            while time.monotonic() - start < 12:        # the storm: 6x header_timeout at most
                _tgkill_all_but_main(e.popen.pid, signal.SIGUSR1)
                try:
                    got = s.recv(65536)
                    break
                except BlockingIOError:
                    time.sleep(0.1)                     # the storm's period
            took = time.monotonic() - start
        assert got.startswith(b"HTTP/1.1 408 "), (round(took, 1), got, e.log()[-2000:])
        assert took < 2 + 5, took                       # the deadline, plus scheduling on a busy machine
        assert e.alive() and request(e.port).status == 200
    finally:
        e.stop()
