"""No bytes of one exchange reach another: a backend that writes anything after a complete response
(a second response, a body after a HEAD head) must not answer the next user of its pooled connection.

The backends are tests/rawserver.py raw sockets, scripted byte for byte: each answers a request with a
body and an X-Path header naming the request's target, so a response that reaches the wrong client shows
it. /late is the issue's repro: `Content-Length: 5` `hello`, and ~30 ms later a second, unasked-for
response (`X-Poison: yes`, `PWNED!`) on the same connection.
"""

from __future__ import annotations

import http.client
import random
import select
import socket
import ssl
import threading
import time

import pytest

from tests.rawserver import ConnReader, RawServer, read_request
from tests.support import Edge, request, wait_until

POISON = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nX-Poison: yes\r\n\r\nPWNED!"
LATE = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Path: /late\r\n\r\nhello"


def own_answer(method: str, target: str) -> bytes:
    """The response of a well-behaved backend: the target in a header and in the body."""
    body = f"path={target}\n".encode()
    head = b"HTTP/1.1 200 OK\r\nX-Path: %s\r\nContent-Length: %d\r\n\r\n" % (target.encode(), len(body))
    return head if method == "HEAD" else head + body


class LateBackend(RawServer):
    """/late: hello, then POISON 30 ms later on the same connection (the issue's repro), unconditionally.
    Anything else: its own answer. `poisoned` counts the second responses written."""

    def __init__(self, wrap=None):
        self.poisoned = 0
        self.wrap = wrap
        super().__init__(self._serve)

    def _serve(self, s, _server):
        if self.wrap:
            s = self.wrap(s)
        r = ConnReader(s)
        while True:
            try:
                req = read_request(r)
            except EOFError:
                return
            if req is None:
                return
            method, target = req[0], req[1]
            if target == "/late":
                s.sendall(LATE)
                time.sleep(0.03)
                s.sendall(POISON)
                with self.lock:
                    self.poisoned += 1
            else:
                s.sendall(own_answer(method, target))


@pytest.fixture(scope="module")
def late():
    b = LateBackend()
    e = Edge("--backends", b.url, "--health-interval", "30")
    yield e, b
    e.stop()
    b.close()


def check_own(port: int, method: str, target: str, conn=None):
    r = request(port, method, target, conn=conn)
    assert r.status == 200 and r.header("X-Poison") is None and r.header("X-Path") == target, \
        (method, target, r.status, r.headers, r.body)
    assert r.body == (b"" if method == "HEAD" else f"path={target}\n".encode()), (method, target, r.body)


def poison_then_victim(port: int, backend: LateBackend, method: str, gap: float, n: int) -> None:
    """Client A gets /late; `gap` seconds later (and once the backend wrote its second response) client
    B, on another connection, asks with `method`: it gets its own response."""
    before = backend.poisoned
    t0 = time.monotonic()
    a = request(port, "GET", "/late")
    assert a.status == 200 and a.body == b"hello", (a.status, a.body)
    wait_until(lambda: backend.poisoned > before, 5, what="the backend's second response")
    time.sleep(max(0.0, t0 + gap - time.monotonic()))     # the gap is the scenario, not a wait for a state
    check_own(port, method, f"/victim-{n}")


@pytest.mark.parametrize("gap", [0.05, 0.1, 0.2])
@pytest.mark.parametrize("method", ["GET", "HEAD", "DELETE", "OPTIONS"])
def test_a_response_written_after_a_complete_one_never_reaches_the_next_client(late, method, gap):
    e, b = late
    poison_then_victim(e.port, b, method, gap, int(gap * 1000))
    check_own(e.port, "GET", "/after")        # and nothing is left behind for the one after


def test_the_stray_response_is_logged_once_as_the_backends(late):
    e, b = late
    poison_then_victim(e.port, b, "GET", 0.05, 1)
    e.wait_log(rf"backend {b.url} sent bytes on an idle connection \(after a complete response\): "
               r"closed, not reused")
    assert "Traceback" not in e.log()


def test_a_stray_write_held_back_by_the_backends_nagle_is_seen_too():
    # The backend writes its stray response 5 ms after its response, without TCP_NODELAY (the default):
    # its kernel holds that small write until the response is acknowledged. Acknowledged only with the
    # next request (a delayed ACK rides on it), the stray bytes arrived just after the pool's check and
    # answered that request: 8 victims in 20 here with the check alone. The edge acknowledges a
    # response at once (TCP_QUICKACK), so they arrive while the connection is idle, and are seen.
    written = []

    def serve(s, _server):
        r = ConnReader(s)
        while (req := read_request(r)) is not None:
            if req[1] == "/late":
                s.sendall(LATE)
                time.sleep(0.005)
                s.sendall(POISON)
                written.append(1)
            else:
                s.sendall(own_answer(req[0], req[1]))

    b = RawServer(serve)
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        for i in range(20):
            n = len(written)
            a = request(e.port, "GET", "/late")
            assert a.body == b"hello", a.body
            wait_until(lambda: len(written) > n, 5, what="the stray write")
            time.sleep(0.02)             # inside the 40 ms a delayed ACK may wait: the scenario, not a sync
            check_own(e.port, "GET", f"/victim-{i}")
    finally:
        e.stop()
        b.close()


def tls_server_ctx():
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    return ca, ctx


def test_over_tls_too(tmp_path):
    # An https:// backend: the edge's check must see a record already decrypted (SSLSocket.pending())
    # and one still on the raw socket; here the second response arrives as a record of its own.
    ca, ctx = tls_server_ctx()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    b = LateBackend(wrap=lambda s: ctx.wrap_socket(s, server_side=True))
    url = f"https://127.0.0.1:{b.port}"
    e = Edge("--backends", url, "--ca-file", str(ca_file), "--health-interval", "30")
    try:
        for i, method in enumerate(["GET", "HEAD", "DELETE", "OPTIONS"]):
            poison_then_victim(e.port, b, method, 0.05, i)
        check_own(e.port, "GET", "/after")
        assert "Traceback" not in e.log()
    finally:
        e.stop()
        b.close()


def test_a_body_after_a_head_response_in_a_second_write_is_never_relayed():
    # HEAD's response has no body; a backend that sends one anyway (in a second write, so the edge has
    # already released the connection) must not have it read as the next request's response.
    strays = []

    def serve(s, _server):
        r = ConnReader(s)
        while (req := read_request(r)) is not None:
            method, target = req[0], req[1]
            if method == "HEAD":
                s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 41\r\nX-Path: %s\r\n\r\n" % target.encode())
                time.sleep(0.03)
                s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nPWNED")   # 41 bytes: "the body"
                strays.append(target)
            else:
                s.sendall(own_answer(method, target))

    b = RawServer(serve)
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        for i in range(3):
            r = request(e.port, "HEAD", f"/h{i}")
            assert r.status == 200 and r.header("X-Path") == f"/h{i}" and r.body == b""
            wait_until(lambda: len(strays) > i, 5, what="the backend's body after its HEAD response")
            time.sleep(0.05)            # the scenario's gap: the stray bytes are on the idle connection
            check_own(e.port, "GET", f"/victim-{i}")
    finally:
        e.stop()
        b.close()


@pytest.mark.parametrize("value, status", [
    (b"a\x00b", 502), (b"a\x01b", 502), (b"a\x1fb", 502), (b"a\x7fb", 502), (b"a\x0bb", 502),
    (b"a\tb", 200), (b"caf\xc3\xa9", 200)], ids=["nul", "soh", "us", "del", "vt", "htab", "obs-text"])
def test_control_bytes_in_a_response_field_are_a_502(value, status):
    # A NUL (or any control but HTAB) relayed in a field: a client may end the field there, or read it
    # otherwise than the edge did. The request side refuses them already (400); the response side: 502.
    def serve(s, _server):
        r = ConnReader(s)
        while (req := read_request(r)) is not None:
            if req[1] == "/field":
                s.sendall(b"HTTP/1.1 200 OK\r\nX-Field: " + value + b"\r\nContent-Length: 2\r\n\r\nok")
            else:
                s.sendall(own_answer(req[0], req[1]))

    b = RawServer(serve)
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        r = request(e.port, "GET", "/field")
        assert r.status == status, (r.status, r.headers, r.body)
        if status == 502:
            assert r.header("X-Field") is None
            e.wait_log(r"backend \S+ protocol: GET /field -> 502 \(control character in the response head\)")
        else:
            assert r.body == b"ok"
        check_own(e.port, "GET", "/next")
    finally:
        e.stop()
        b.close()


# ------------------------------------------------------------------------------- under concurrency

class IdlePoisonBackend(RawServer):
    """/late: hello, and if the connection then stays idle for 30 ms (no request on it), a stray
    response on it; then it goes on serving that connection as if nothing happened.

    Under load a stray response 30 ms late would land in the middle of the next exchange on that
    connection, which no proxy can tell from that exchange's answer (nginx neither). Written onto an
    idle connection, it is something a proxy can and must see before it reuses the connection -- but
    for one instant: a request the edge sends just as the stray is written (its check passed a moment
    before) reads it as its answer. Every response therefore carries an id (X-Id), and the backend
    notes when each write had returned (`written`, time.monotonic(), taken after the write: a stall
    only makes it later). A client that gets a response not its own, written before the client even
    sent its request, was given a connection that held it when the edge checked."""

    def __init__(self):
        self.poisoned = 0
        self.written: dict[int, float] = {}
        self.ids = iter(range(1, 1 << 62))
        super().__init__(self._serve)

    def _send(self, s, head: bytes, body: bytes, head_only: bool = False) -> None:
        with self.lock:
            rid = next(self.ids)
        s.sendall(head + b"X-Id: %d\r\nContent-Length: %d\r\n\r\n%s" % (rid, len(body), b"" if head_only else body))
        self.written[rid] = time.monotonic()

    def _serve(self, s, _server):
        r = ConnReader(s)
        while True:
            try:
                req = read_request(r)
            except EOFError:
                return
            if req is None:
                return
            method, target = req[0], req[1]
            if target == "/late":
                self._send(s, b"HTTP/1.1 200 OK\r\nX-Path: /late\r\n", b"hello")
                if not r.buf and not select.select([s], [], [], 0.03)[0]:
                    self._send(s, b"HTTP/1.1 200 OK\r\nX-Poison: yes\r\n", b"PWNED!")
                    with self.lock:
                        self.poisoned += 1
            else:
                self._send(s, b"HTTP/1.1 200 OK\r\nX-Path: %s\r\n" % target.encode(), f"path={target}\n".encode(),
                           head_only=method == "HEAD")


def test_under_32_concurrent_clients_no_one_reads_a_response_left_on_a_connection():
    """32 clients for 8 s, each a keep-alive connection asking /late or a victim (GET, HEAD, DELETE,
    OPTIONS) with a pause of 0-60 ms between requests: the edge's pool has connections idle from
    microseconds to a few hundred ms, reused at every age. No client gets a response that is not its
    own and was written before it sent its request (more than 20 ms before: slack for a loopback write
    delivered late under load). The ones written after -- the instant described in IdlePoisonBackend --
    are counted and printed, not failed: no proxy can avoid them."""
    b = IdlePoisonBackend()
    e = Edge("--backends", b.url, "--health-interval", "30")
    wrong, errors = [], []
    served = [0]
    lock = threading.Lock()
    end = time.monotonic() + 8

    def client(k: int) -> None:
        rnd = random.Random(k)
        c = http.client.HTTPConnection("127.0.0.1", e.port, timeout=20)
        i = 0
        try:
            while time.monotonic() < end:
                i += 1
                if rnd.random() < 0.3:
                    method, target = "GET", "/late"
                else:
                    method, target = rnd.choice(["GET", "HEAD", "DELETE", "OPTIONS"]), f"/v-{k}-{i}"
                sent = time.monotonic()
                r = request(e.port, method, target, conn=c)
                want = b"hello" if target == "/late" else (b"" if method == "HEAD" else f"path={target}\n".encode())
                with lock:
                    served[0] += 1
                    if r.status != 200 or r.header("X-Id") is None:
                        errors.append((method, target, r.status, r.body[:80]))
                    elif r.header("X-Path") != target or r.body != want:
                        wrong.append((method, target, r.header("X-Path") or "poison", int(r.header("X-Id")), sent))
                time.sleep(rnd.random() * 0.06)
        except Exception as ex:     # noqa: BLE001 -- reported below with the rest
            errors.append(repr(ex))
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(32)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stale, instant = [], []
        for method, target, got, rid, sent in wrong:
            ago = sent - b.written[rid]          # how long before the client asked it was written
            (stale if ago > 0.02 else instant).append((method, target, got, f"{ago * 1000:+.1f} ms"))
        summary = (f"served {served[0]}, stray responses written {b.poisoned}; not the client's own: "
                   f"{len(stale)} written before it asked {stale[:6]}, {len(instant)} in the same instant "
                   f"{instant[:4]}")
        print(summary)
        assert not errors, errors[:5]
        assert b.poisoned >= 10, summary            # the test exercised something
        assert not stale, summary
        assert "Traceback" not in e.log()
    finally:
        e.stop()
        b.close()


def test_a_204_reaches_the_client_without_the_content_length_the_backend_put_on_it():
    # RFC 9110 8.6: no Content-Length in a 204 (nginx drops it). The edge writes the framing from what it
    # parsed, and a 204 has no body whatever it says: a client that believed the length would wait for
    # it, or read the next response's first bytes as this one's body.
    def serve(s, _server):
        r = ConnReader(s)
        while (req := read_request(r)) is not None:
            if req[1] == "/nc":
                s.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\nX-Path: /nc\r\n\r\n")
            else:
                s.sendall(own_answer(req[0], req[1]))

    b = RawServer(serve)
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        s = socket.create_connection(("127.0.0.1", e.port), timeout=5)
        s.sendall(b"GET /nc HTTP/1.1\r\nHost: h\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(4096)
        head = data.partition(b"\r\n\r\n")[0]
        s.close()
        assert head.startswith(b"HTTP/1.1 204 ") and b"X-Path: /nc" in head, head
        assert b"content-length" not in head.lower(), head
        check_own(e.port, "GET", "/after")
    finally:
        e.stop()
        b.close()
