"""Defects found by the review of the issue 11-18 landings, each against the real edge: a bad
configuration file that crashed --check, a response cut short by a send timeout left over from the
request head's deadline, an exempt network missed when a trusted proxy writes IPv4-mapped addresses."""

import contextlib
import socket
import ssl
import subprocess
import time

import pytest

from tests.support import PY, ROOT, Backend, Edge, request, wait_until


@pytest.fixture(scope="module")
def backend():
    b = Backend("rv")
    yield b
    b.stop()


@pytest.mark.parametrize("content, why", [
    (b"listen = \"\xd0\x28\"\n", "not UTF-8"),                       # a binary or Latin-1 file
    (b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply"),  # tomllib recurses
], ids=["latin1", "deep"])
def test_check_of_an_unreadable_toml_file_is_one_line_not_a_traceback(tmp_path, content, why):
    path = tmp_path / "edge.toml"
    path.write_bytes(content)
    p = subprocess.run([PY, "edge.py", "--check", "--config", str(path), "--backends", "http://127.0.0.1:1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(lines) == 1, p.stderr[-2000:]
    assert f"--config {path}: not valid TOML: {why}" in lines[0]


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


def test_over_tls_too_a_response_is_not_cut_by_what_was_left_of_the_head_deadline(backend, tmp_path):
    """The same over TLS, where the socket has one timeout for both directions: after a read the edge
    puts send_timeout back before it writes."""
    trustme = pytest.importorskip("trustme", reason="trustme (requirements-dev.txt) makes the test certificates")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    cert, key, cafile = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(cafile))
    e = Edge("--backends", backend.url, "--header-timeout", str(HEADER_TIMEOUT), "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        ctx = ssl.create_default_context(cafile=str(cafile))
        n = _late_reader(ctx.wrap_socket(_small_window_socket(e.port), server_hostname="127.0.0.1"), SIZE)
        assert n > SIZE, f"{n} of {SIZE} body bytes"
    finally:
        e.stop()


def test_an_ipv4_mapped_address_from_a_trusted_proxy_is_that_ipv4_client(backend, tmp_path):
    """A dual-stack proxy writes an IPv4 client as ::ffff:a.b.c.d: it is exempt by its IPv4 network,
    and it is one client with its plain spelling (one budget, not one per spelling)."""
    conf = tmp_path / "edge.toml"
    conf.write_text('[limits]\nexempt = ["10.0.0.0/8"]\n')
    e = Edge("--config", str(conf), "--backends", backend.url, "--limit", "1/m",
             "--trusted-proxies", "127.0.0.1")
    try:
        got = [request(e.port, headers={"X-Forwarded-For": "::ffff:10.1.2.3"}).status for _ in range(3)]
        assert got == [200, 200, 200]
        first = request(e.port, headers={"X-Forwarded-For": "203.0.113.7"}).status
        again = request(e.port, headers={"X-Forwarded-For": "::FFFF:203.0.113.7"}).status
        assert (first, again) == (200, 429)
    finally:
        e.stop()


def test_an_open_tunnel_does_not_keep_the_retry_slot_its_handshake_used(tmp_path):
    """A WebSocket handshake retried past a dead backend held its retry-budget slot for the whole life
    of the tunnel (hours): with the floor's slots all held by tunnels, every later connect failure was a
    502 'retry budget exhausted' instead of a retry. The slot is the handshake's; the tunnel frees it."""
    websockets = pytest.importorskip("websockets", reason="websockets (requirements-dev.txt) is the real client")
    from websockets.sync.client import connect
    from tests.test_failover import dead_url
    from tests.test_websocket import WsBackend
    wsb = WsBackend()
    # The dead backend stays in rotation (no ejection, probes far apart), two retry slots in all: two
    # tunnels whose handshakes were retried held both; after the fix a sequential request finds one
    # free even while the previous request's thread, already answered, has yet to give its slot back.
    e = Edge("--backends", f"{dead_url()},{wsb.url}", "--strategy", "round-robin", "--eject-after", "0",
             "--health-interval", "60", "--unhealthy-threshold", "100",
             "--retry-budget-min", "2", "--retry-budget-percent", "0")
    tunnels = []
    stack = contextlib.ExitStack()     # each client a context manager, as websockets wants it used
    try:
        for _ in range(8):      # round robin: about one handshake in two meets the dead backend first
            tunnels.append(stack.enter_context(connect(f"ws://127.0.0.1:{e.port}/echo", proxy=None,
                                                       open_timeout=10, compression=None)))
            if e.log().count("GET /echo (NewConnectionError); retrying on") >= 2:
                break
        assert e.log().count("GET /echo (NewConnectionError); retrying on") >= 2, e.log()
        for t in tunnels:
            t.send("still open")
            assert t.recv(timeout=10) == "still open"
        got = [request(e.port).status for _ in range(4)]   # some meet the dead backend first
        assert got == [200] * 4, e.log()[-3000:]
        assert "retrying on" in e.log().split("GET /echo")[-1]      # ... and were retried
    finally:
        stack.close()
        e.stop()
        wsb.stop()


@pytest.mark.parametrize("secret", ["Sup3r/s3cret", "pa@s3cret", "pa ss3cret"], ids=["slash", "at", "space"])
def test_a_redis_password_with_a_slash_an_at_sign_or_a_space_is_redacted_everywhere(backend, secret):
    """The store URL's parser takes userinfo up to the last '@' (as urllib does), but the redaction of
    log lines, /status and the metrics label stopped at the first '/' or '@': the start-up line showed
    `redis://:Sup3r/s3cret@127.0.0.1:1` whole, and `pa@s3cret` as `:***@s3cret@`. A space stopped it
    too (the pattern's \\S): `redis://:pa ss3cret@127.0.0.1:1` was shown whole; now the parser's own
    redaction (limiter.redis_url.redact) writes the store, and the log hides the password's text."""
    e = Edge("--backends", backend.url, "--limit", "5/s", "--store", f"redis://:{secret}@127.0.0.1:1",
             "--on-store-error", "fail-open", "--admin", "127.0.0.1:0")
    try:
        assert request(e.port).status == 200          # fail-open: served, and a store error logged
        seen = e.log() + request(e.admin_port, "GET", "/status").body.decode() + \
            request(e.admin_port, "GET", "/metrics").body.decode()
        assert "redis://:***@127.0.0.1:1" in seen
        assert "s3cret" not in seen, [ln for ln in seen.splitlines() if "s3cret" in ln]
    finally:
        e.stop()
