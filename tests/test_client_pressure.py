"""Slow, chatty and idle clients (issue 23, items 3, 4 and part of 6): a chunked body meets its
deadlines from its first byte, many tiny chunks cost a few writes to the backend, idle keep-alive
connections give way at the connection cap, header names with '_' stay at the edge, and a flood of
bad requests writes a bounded number of log lines.

Real edges, real sockets; the backends are the raw ones of tests/rawserver.py.
"""

from __future__ import annotations

import re
import socket
import struct
import time

import pytest

from tests.rawserver import ConnReader, RecordingBackend, read_request
from tests.support import Edge, request, wait_until

H = b"Host: h\r\n"


def read_status(s: socket.socket, limit: float = 8.0, trickle: bytes | None = None, every: float = 0.2) -> tuple:
    """(status or None, seconds) of the first response on s, sending `trickle` every `every` s until it
    comes (a client that is never silent for long, yet never fast)."""
    start = time.monotonic()
    got = b""
    try:
        while time.monotonic() - start < limit:
            if trickle is not None:
                s.sendall(trickle)
            s.settimeout(every)
            try:
                data = s.recv(65536)
            except socket.timeout:
                continue
            if not data:
                break
            got += data
            if b"\r\n\r\n" in got:
                break
    except OSError:
        pass
    status = int(got[9:12]) if got.startswith(b"HTTP/1.1 ") else None
    return status, time.monotonic() - start


def served(port: int, n: int) -> None:
    """A plain request from another client is answered by the backend."""
    s, _, body = exchange(port, b"GET /after-%d HTTP/1.1\r\nHost: v\r\nConnection: close\r\n\r\n" % n)
    assert (s, body) == (200, b"target=/after-%d len=0\n" % n)


def exchange(port: int, data: bytes, timeout: float = 10.0):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        r = ConnReader(s)
        head = r.head()
        assert head is not None, "closed without a response"
        status = int(head[9:12])
        n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        return status, head, r.exact(n)


@pytest.fixture(scope="module")
def backend():
    b = RecordingBackend()
    yield b
    b.close()


# ------------------------------------------------------------------ chunked bodies, from the first byte

@pytest.fixture(scope="module")
def paced(backend):
    """body_timeout 1 s and 100 kB/s: a body's deadline is 1 s + its bytes so far / 100 kB/s."""
    # Streamed (--request-buffering off), the path where a slow body holds a backend connection; buffered
    # bodies are read by the same decoder under the same deadlines before any backend is chosen.
    e = Edge("--backends", backend.url, "--health-interval", "30", "--body-timeout", "1",
             "--body-min-rate", "100000", "--request-buffering", "off")
    yield e
    e.stop()


def test_a_trickled_first_chunk_is_cut_off_like_its_content_length_twin(paced):
    """The issue's repro (streamed: over 64 KiB): `900000` declared, 70,000 bytes sent, then a byte at a
    time. The deadline counts from the first byte: 1 s + 70 kB / 100 kB/s = 1.7 s, not never."""
    with socket.create_connection(("127.0.0.1", paced.port), timeout=10) as s:
        s.sendall(b"POST /trickle HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n900000\r\n"
                  + b"c" * 70000)
        status, took = read_status(s, trickle=b"c")
    assert status == 408 and took < 5, (status, took)
    served(paced.port, 1)


def test_a_trickled_chunk_size_line_is_cut_off(paced):
    """A size line sent a byte every 0.2 s is never silent for body_timeout; its deadline is 1 s."""
    with socket.create_connection(("127.0.0.1", paced.port), timeout=10) as s:
        s.sendall(b"POST /size-line HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n")
        status, took = read_status(s, trickle=b"0")
    assert status == 408 and took < 5, (status, took)
    served(paced.port, 2)


def test_a_trickled_trailer_section_is_cut_off(paced):
    with socket.create_connection(("127.0.0.1", paced.port), timeout=10) as s:
        s.sendall(b"POST /trailers HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: ")
        status, took = read_status(s, trickle=b"t")
    assert status == 408 and took < 5, (status, took)
    served(paced.port, 3)


def test_too_many_trailer_lines_are_a_400(paced, backend):
    """Trailers are dropped, but each is read: their number is capped (400, as for any other bad
    framing of a body -- the head was fine, so not a 431)."""
    backend.take()
    body = b"3\r\nabc\r\n0\r\n" + b"X-T: t\r\n" * 40 + b"\r\n"
    status, _, _ = exchange(paced.port, b"POST /many-trailers HTTP/1.1\r\n" + H
                            + b"Transfer-Encoding: chunked\r\n\r\n" + body)
    assert status == 400
    ok = b"3\r\nabc\r\n0\r\n" + b"X-T: t\r\n" * 5 + b"\r\n"
    status, _, got = exchange(paced.port, b"POST /few-trailers HTTP/1.1\r\n" + H
                              + b"Transfer-Encoding: chunked\r\n\r\n" + ok)
    assert (status, got) == (200, b"target=/few-trailers len=3\n")
    assert [r[1] for r in backend.take() if r[1] != "/health"] == ["/few-trailers"]


def test_chunk_framing_counts_toward_max_body_size(backend):
    """1,000 one-byte chunks are 1,000 bytes of data but 6,000 on the wire: over a 4,000-byte cap."""
    e = Edge("--backends", backend.url, "--health-interval", "30", "--max-body-size", "4000")
    try:
        body = b"1\r\na\r\n" * 1000 + b"0\r\n\r\n"
        status, _, _ = exchange(e.port, b"POST /framing HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n" + body)
        assert status == 413
        served(e.port, 4)
    finally:
        e.stop()


class SegmentCountingBackend(RecordingBackend):
    """Records requests like its parent and keeps its last connection, to read the TCP segments that
    connection received (TCP_INFO tcpi_segs_in)."""

    def _serve(self, s, server):
        self.sock = s
        super()._serve(s, server)

    def segments_in(self) -> int:
        return struct.unpack_from("I", self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256), 140)[0]


def test_many_tiny_chunks_reach_the_backend_intact_in_few_writes():
    """Streamed (over 64 KiB): 100,000 one-byte chunks were 100,000 sendalls toward the backend (strace:
    100,003 sendto); what a read brings is now gathered and written once (9). The backend's segment
    count shows it: Linux's autocorking merges some small writes (113-202 segments for the 100,000 on
    the old code), never as far as one segment per 64 KiB read (11 now)."""
    b = SegmentCountingBackend()
    e = Edge("--backends", b.url, "--health-interval", "30", "--request-buffering", "off")   # streamed
    try:
        n = 100_000
        data = bytes(i % 251 for i in range(n))
        body = b"".join(b"1\r\n%s\r\n" % data[i:i + 1] for i in range(n)) + b"0\r\n\r\n"
        status, _, got = exchange(e.port, b"POST /tiny HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n"
                                  + body, timeout=60)
        assert (status, got) == (200, b"target=/tiny len=%d\n" % n)
        reqs = [r for r in b.take() if r[1] == "/tiny"]
        assert len(reqs) == 1 and reqs[0][3] == data
        assert b.segments_in() < 60, b.segments_in()
    finally:
        e.stop()
        b.close()


# ------------------------------------------------------------------ at the connection cap, idle gives way

def idle_connection(port: int, n: int, key: bytes = b"k") -> socket.socket:
    """A keep-alive connection that sent one GET, read its answer, and went quiet."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /idle-%d HTTP/1.1\r\nHost: h\r\nX-Api-Key: %s\r\n\r\n" % (n, key))
    r = ConnReader(s)
    head = r.head()
    assert head is not None and head[9:12] in (b"200", b"429"), head
    r.exact(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
    assert not r.buf
    return s


def closed_cleanly(s: socket.socket) -> bool:
    """True when the edge closed s without a byte (False while it is open)."""
    s.setblocking(False)
    try:
        data = s.recv(1)
    except BlockingIOError:
        return False
    except ConnectionResetError:
        raise AssertionError("reset, not a clean close")
    finally:
        s.setblocking(True)
    assert data == b"", f"bytes on an idle connection: {data!r}"
    return True


def test_idle_keep_alive_connections_give_way_to_new_clients(backend):
    """230 idle keep-alive connections at a cap of 200 (the issue's test): each new one past the cap
    closes the longest-idle one, so 5 more clients are served (were: 503 too many connections, for
    keepalive_timeout), and the ones closed saw a clean close, oldest first: 30 for the last 30 idle
    ones, at least one for the new clients (each closes its connection: later ones may find room)."""
    e = Edge("--backends", backend.url, "--health-interval", "30", "--max-connections", "200")
    conns = []
    try:
        for n in range(230):
            conns.append(idle_connection(e.port, n))
        for n in range(5):
            served(e.port, 100 + n)
        wait_until(lambda: all(closed_cleanly(s) for s in conns[:31]), timeout=10,
                   what="the 31 longest idle closed")
        still = [closed_cleanly(s) for s in conns[35:]]
        assert not any(still), f"{sum(still)} of the later connections closed too"
        s = conns[-1]                       # a kept one still serves
        s.sendall(b"GET /again HTTP/1.1\r\nHost: h\r\n\r\n")
        assert ConnReader(s).head()[9:12] == b"200"
    finally:
        for s in conns:
            s.close()
        e.stop()


def _waiting(e) -> int:
    text = request(e.admin_port, "GET", "/metrics").body.decode()
    return int(float(re.search(r"^lb_idle_client_connections (\S+)$", text, re.M).group(1)))


def test_a_connection_idle_after_a_429_gives_way_too(backend):
    e = Edge("--backends", backend.url, "--health-interval", "30", "--max-connections", "3",
             "--limit", "1/m", "--admin", "127.0.0.1:0")
    conns = []
    try:
        for n in range(3):                  # 200, then 429 twice
            conns.append(idle_connection(e.port, n, b"spent"))
            # Idle from when its thread has the GIL again after the response: the next one's exchange can
            # be over first (on a loaded machine it was, half the time), and then it is the longest idle.
            wait_until(lambda: _waiting(e) == len(conns), timeout=5, what=f"{len(conns)} connections idle")
        served(e.port, 200)                 # another key, on a new connection: room was made
        wait_until(lambda: closed_cleanly(conns[0]), timeout=10, what="the longest idle closed")
    finally:
        for s in conns:
            s.close()
        e.stop()



def test_an_idle_tls_connection_gives_way_with_a_clean_close(backends, pki):
    """Over TLS too: the client of the closed connection reads a clean end (our close_notify), not the
    decode_error alert OpenSSL 3 sent for the EOF the edge's own shutdown caused."""
    from tests.test_tls import https, tls_edge
    e = tls_edge(pki, backends, "--max-connections", "3", "--admin", "127.0.0.1:0")
    try:
        held = [https(e.port, pki) for _ in range(3)]
        for c in held:
            assert request(e.port, "GET", "/", conn=c).status == 200
        new = https(e.port, pki)
        assert request(e.port, "GET", "/", conn=new).status == 200
        new.close()
        held[0].sock.settimeout(5)
        assert held[0].sock.recv(1) == b""
        assert request(e.port, "GET", "/", conn=held[2]).status == 200
        text = request(e.admin_port, "GET", "/metrics").body.decode()
        assert "lb_idle_connections_closed_total 1" in text
    finally:
        e.stop()


# ------------------------------------------------------------------ header names with '_'

def sent_headers(backend, target: str) -> list[tuple[str, str]]:
    return [r[2] for r in backend.take() if r[1] == target][0]


UNDERSCORED = (b"X_Forwarded_For: 6.6.6.6\r\nX_Api_Key: other\r\nFoo_Bar: x\r\nX-Plain: kept\r\n")


def test_header_names_with_underscores_stay_at_the_edge(backend):
    e = Edge("--backends", backend.url, "--health-interval", "30", "--limit", "1/m")
    try:
        backend.take()
        s, _, _ = exchange(e.port, b"GET /u1 HTTP/1.1\r\nHost: h\r\n" + UNDERSCORED + b"Connection: close\r\n\r\n")
        assert s == 200
        names = [k for k, _ in sent_headers(backend, "/u1")]
        assert not [k for k in names if "_" in k], names
        assert "X-Plain" in names and names.count("X-Forwarded-For") == 1
        # nor does the edge read X_Api_Key as X-Api-Key: another value is still the same client (its IP)
        s, _, _ = exchange(e.port, b"GET /u2 HTTP/1.1\r\nHost: h\r\nX_Api_Key: third\r\nConnection: close\r\n\r\n")
        assert s == 429
    finally:
        e.stop()


def test_allow_underscores_forwards_them(backend, tmp_path):
    conf = tmp_path / "edge.toml"
    conf.write_text(f'[[backends]]\nurl = "{backend.url}"\n\n[server]\nallow_underscores = true\n')
    for args in (("--backends", backend.url, "--allow-underscores"), ("--config", str(conf))):
        e = Edge("--health-interval", "30", *args)
        try:
            backend.take()
            s, _, _ = exchange(e.port, b"GET /u3 HTTP/1.1\r\nHost: h\r\n" + UNDERSCORED + b"Connection: close\r\n\r\n")
            assert s == 200
            got = sent_headers(backend, "/u3")
            assert ("X_Forwarded_For", "6.6.6.6") in got and ("Foo_Bar", "x") in got, got
        finally:
            e.stop()


# ------------------------------------------------------------------ a flood of bad requests, a few log lines

def test_client_faults_warn_once_per_window_and_count_the_rest():
    import logging
    from lb.logs import ClientFaults

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append((record.levelname, record.getMessage()))

    logger = logging.getLogger("test-client-faults")
    logger.propagate = False
    h = Lines()
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    timers = []
    f = ClientFaults(logger, every=10.0, burst=2, schedule=lambda delay, fn: timers.append((delay, fn)))
    for i in range(100):
        f("client %s: %d %s", "10.0.0.%d" % i, 400, "malformed request line")
    assert h.lines[0] == ("WARNING", "client 10.0.0.0: 400 malformed request line")
    assert [lv for lv, _ in h.lines] == ["WARNING", "INFO", "INFO"] and len(timers) == 1
    timers.pop()[1]()                       # the window ends: one summary, and a new window
    assert h.lines[-1] == ("WARNING", "99 more client errors in the last 10 s (97 not logged; "
                                      "last: client 10.0.0.99: 400 malformed request line)")
    assert len(timers) == 1
    f("client %s: %d %s", "10.0.0.1", 408, "late")   # inside the new window: INFO, no WARNING
    assert h.lines[-1] == ("INFO", "client 10.0.0.1: 408 late")
    timers.pop()[1]()
    assert h.lines[-1][0] == "WARNING" and h.lines[-1][1].startswith("1 more client errors")
    timers.pop()[1]()                       # a quiet window: no line, and the next fault warns at once
    n = len(h.lines)
    assert not timers
    f("client %s: %d %s", "10.0.0.2", 400, "again")
    assert h.lines[n:] == [("WARNING", "client 10.0.0.2: 400 again")] and len(timers) == 1


def test_a_flood_of_bad_requests_writes_a_few_log_lines_and_every_access_line(backend, tmp_path):
    access = tmp_path / "access.log"
    e = Edge("--backends", backend.url, "--health-interval", "30", "--access-log", str(access))
    try:
        for _ in range(60):
            s, _, _ = exchange(e.port, b"GET / HTTP/1.1\r\nHost: h\r\nBad Header: x\r\n\r\n")
            assert s == 400
        served(e.port, 300)
        wait_until(lambda: access.exists() and access.read_text().count(" 400 ") == 60, timeout=10,
                   what="60 refusals in the access log")
        lines = [ln for ln in e.log().splitlines() if "malformed header line" in ln]
        assert [ln.split()[1] for ln in lines] == ["WARNING"] + ["INFO"] * 5, lines
    finally:
        e.stop()
