"""Defects a reviewer found by trying to break the edge, each against the real edge over real sockets:
IPv4-mapped networks in the configuration, secrets with odd characters, chunk lines and heads that
arrive in one read, absurd timeouts, reflected admin input, and deadlines stretched by signals."""

import ctypes
import os
import signal
import socket
import time

import pytest

from tests.support import ADMIN_AUTH, ADMIN_ENV, ADMIN_TOKEN, Backend, Edge, raw, request


@pytest.fixture(scope="module")
def backend():
    b = Backend("rb")
    yield b
    b.stop()


def _edge_over(host: str, *args: str) -> Edge:
    """An edge on 127.0.0.1, or on the dual-stack [::] (a later --listen wins): IPv4 clients of the
    latter are ::ffff:127.0.0.1 to the socket."""
    return Edge(*args, *(("--listen", f"[{host}]:0") if ":" in host else ()))


_DUAL = pytest.param("::", marks=pytest.mark.skipif(not socket.has_dualstack_ipv6(),
                                                     reason="the OS has no dual-stack IPv6 sockets"))


@pytest.mark.parametrize("listen", ["127.0.0.1", _DUAL], ids=["ipv4", "dual-stack"])
def test_ipv4_mapped_networks_in_the_configuration_match_ipv4_clients(backend, tmp_path, listen):
    """`::ffff:127.0.0.0/104` is 127.0.0.0/8 written the IPv6 way (what an operator copies from a
    dual-stack proxy's log): it never matched, neither as a trusted proxy, nor as an exempt network,
    nor as an ip: override, whether the client was seen as 127.0.0.1 or as ::ffff:127.0.0.1."""
    conf = tmp_path / "edge.toml"
    conf.write_text('[limits]\ntrusted_proxies = ["::ffff:127.0.0.0/104"]\n'
                    '[limits.keys]\n"ip:::ffff:203.0.113.9" = "5/m"\n')
    e = _edge_over(listen, "--config", str(conf), "--backends", backend.url, "--limit", "1/m",
                   "--health-interval", "30")
    exempt = tmp_path / "exempt.toml"
    exempt.write_text('[limits]\nexempt = ["::ffff:127.0.0.1/128"]\n')
    x = _edge_over(listen, "--config", str(exempt), "--backends", backend.url, "--limit", "1/m",
                   "--health-interval", "30")
    try:
        # Trusted: each X-Forwarded-For client has a budget of its own (untrusted, all are the peer's).
        got = [request(e.port, headers={"X-Forwarded-For": f"198.51.100.{i}"}).status for i in (1, 2, 3)]
        assert got == [200, 200, 200], e.log()[-2000:]
        # The override named by its mapped spelling is the IPv4 client's.
        r = request(e.port, headers={"X-Forwarded-For": "203.0.113.9"})
        assert (r.status, r.header("X-RateLimit-Limit")) == (200, "5")
        # Exempt by its mapped spelling: never limited (1/m would refuse the second).
        assert [request(x.port).status for _ in range(3)] == [200, 200, 200], x.log()[-2000:]
    finally:
        e.stop()
        x.stop()


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


@pytest.mark.parametrize("where, value", [
    ("server.header_timeout", "1e-300"), ("server.send_timeout", "0.0005"), ("upstream.read_timeout", "1e-9"),
    ("limits.redis_timeout", "5e-324"), ("server.drain_timeout", "1e-300"), ("server.body_min_rate", "1e-300"),
])
def test_an_absurdly_small_timeout_is_refused_with_its_key_named(tmp_path, where, value):
    """`header_timeout = 1e-300` passed validation (> 0): no timeout anyone means, and every head a 408.
    Durations start at 1 ms (0 stays "none" where it was), a body rate at 1 byte/s."""
    from tests.support import config_error
    section, key = where.split(".")
    conf = tmp_path / "edge.toml"
    conf.write_text(f'[[backends]]\nurl = "http://127.0.0.1:9"\n[{section}]\n{key} = {value}\n')
    line = config_error("--check", "--config", str(conf))
    assert f"{where}: must be " in line and float(line.rsplit("got ", 1)[1].strip("'")) == float(value), line
    flag = "--" + key.replace("_", "-")
    line = config_error("--check", "--backends", "http://127.0.0.1:9", flag, value)
    assert f"{flag}: must be " in line and ">= " in line, line


def test_the_admin_404_echoes_a_bounded_escaped_route(backend):
    """POST /backends/<route>/drain for an unknown route echoed the whole route back (up to the 64 KiB
    request line, attacker-chosen). Now at most 64 bytes of it, escaped as the access log escapes."""
    e = Edge("--backends", backend.url, "--health-interval", "30", "--admin", "127.0.0.1:0", env=ADMIN_ENV)
    try:
        r = request(e.admin_port, "POST", "/backends/" + "A" * 5000 + "/drain", headers=ADMIN_AUTH)   # (8 KiB line max)
        assert r.status == 404 and r.body.count(b"A") == 64 and b"..." in r.body and len(r.body) < 200, r
        # A quote and a byte above 0x7f (http.client refuses to send them: raw bytes) come back escaped;
        # a terminal escape does not even parse (the admin port uses the proxy's strict parser: 400).
        auth = b"Authorization: Bearer " + ADMIN_TOKEN.encode() + b"\r\n"
        got = raw(e.admin_port, b'POST /backends/X"\xff/drain HTTP/1.1\r\nHost: 127.0.0.1\r\n' + auth +
                  b'Content-Length: 0\r\nConnection: close\r\n\r\n')
        assert got.startswith(b"HTTP/1.") and b" 404 " in got.split(b"\r\n")[0], got
        assert b"no backend 'X\\x22\\xff'" in got and b"\xff" not in got, got
        got = raw(e.admin_port, b'POST /backends/\x1b[31mX/drain HTTP/1.1\r\nHost: 127.0.0.1\r\n' + auth +
                  b'Content-Length: 0\r\nConnection: close\r\n\r\n')
        assert b" 400 " in got.split(b"\r\n")[0] and b"\x1b" not in got, got
        assert request(e.admin_port, "GET", "/healthz").status == 200
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
