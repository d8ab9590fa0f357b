"""WebSocket through the edge with a real client and server (the `websockets` library): the handshake
through the pipeline, the tunnel both ways, closes from either side, idle timeout, drain, 100 at once,
and the backend's plain HTTP afterwards."""

import asyncio
import contextlib
import re
import signal
import ssl
import time

import pytest

from tests.support import PY, Edge, Proc, request, wait_until

websockets = pytest.importorskip("websockets", reason="websockets (requirements-dev.txt) is the real client")
from websockets.asyncio.client import connect  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402


class WsBackend(Proc):
    def __init__(self):
        super().__init__([PY, "-m", "tests.ws_backend", "--port", "0"], "ws-backend")
        self.port = int(self.wait_log(r"listening \S+:(\d+)").group(1))
        self.url = f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def wsb():
    b = WsBackend()
    yield b
    b.stop()


def ws(port, path="/echo", **kw):
    return connect(f"ws://127.0.0.1:{port}{path}", proxy=None, open_timeout=10, close_timeout=5,
                   ping_interval=None, compression=None, **kw)


def metric(e, name):
    text = request(e.admin_port, "GET", "/metrics").body.decode()
    m = re.search(rf"^{re.escape(name)} (\d+)", text, re.M)
    return int(m.group(1))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_echo_both_closes_and_plain_http_after(wsb, tmp_path):
    log = tmp_path / "access.log"
    e = Edge("--backends", wsb.url, "--health-interval", "30", "--admin", "127.0.0.1:0", "--limit", "100/m",
             "--access-log", str(log))
    try:
        async def session():
            # echo; the 101 carries Upgrade, Connection and our rate-limit headers
            async with ws(e.port) as c:
                h = c.response.headers
                assert c.response.status_code == 101
                assert h["Upgrade"].lower() == "websocket" and h["Connection"].lower() == "upgrade"
                assert h["X-RateLimit-Limit"] == "100" and h["X-RateLimit-Remaining"] == "99"
                for msg in ("one", "two" * 1000, b"\x00\xff" * 40000):
                    await c.send(msg)
                    assert await c.recv() == msg
                assert metric(e, "lb_tunnels_open") == 1
                await c.close()                          # client-initiated close
                assert c.close_code == 1000
            # the server speaks first, then closes with its own code
            async with ws(e.port, "/hello") as c:
                assert await c.recv() == "hello"
                await c.send("close:4001")
                with pytest.raises(ConnectionClosed) as info:
                    await c.recv()
                assert info.value.rcvd.code == 4001           # server-initiated close arrived intact

        run(session())
        wait_until(lambda: metric(e, "lb_tunnels_open") == 0, what="tunnels closed")
        assert metric(e, "lb_tunnels_total") == 2
        assert metric(e, 'lb_backend_inflight{backend="%s"}' % wsb.url) == 0
        # A plain request to the same backend afterwards, through the edge: its pool slot is free.
        r = request(e.port, "GET", "/plain")
        assert r.status == 200 and r.body.startswith(b"plain opened=")
        assert r.header("Upgrade") is None
        lines = wait_until(lambda: [ln for ln in log.read_text().splitlines() if " 101 " in ln] if log.exists()
                           and log.read_text().count(" 101 ") == 2 else None, what="two 101 access-log lines")
        for ln in lines:
            m = re.search(r'"GET /\S*" 101 .* (\d+\.\d+) rid=.* up=(\d+) down=(\d+) \((.+)\)$', ln)
            assert m, ln
            assert int(m.group(2)) > 0 and int(m.group(3)) > 0
        assert int(re.search(r"up=(\d+)", lines[0]).group(1)) > 80000      # the 80 kB binary message
    finally:
        e.stop()


def test_one_token_per_handshake_and_a_refused_upgrade_is_relayed(wsb):
    e = Edge("--backends", wsb.url, "--health-interval", "30", "--limit", "2/m")
    try:
        async def session():
            async with ws(e.port, additional_headers={"X-Request-Id": "ws-handshake-1"}) as c:
                # The 101 carries the limiter's headers, as every response does; the request id only with
                # --request-id-response (the backend got it).
                assert c.response.headers.get_all("X-Request-Id") == []
                assert c.response.headers["X-RateLimit-Limit"] == "2"
                await c.send("x")
                for _ in range(50):        # messages inside a tunnel spend no tokens
                    await c.send("y")
                    await c.recv()
            with pytest.raises(InvalidStatus) as info:     # the backend declines: its 403, relayed
                async with ws(e.port, "/refuse"):
                    pass
            assert info.value.response.status_code == 403
            with pytest.raises(InvalidStatus) as info:     # third handshake in the minute
                async with ws(e.port):
                    pass
            assert info.value.response.status_code == 429
            assert info.value.response.headers["Retry-After"]

        run(session())
    finally:
        e.stop()


@pytest.mark.parametrize("rid_response", [True, False])
def test_the_101_keeps_the_backends_fields_but_never_its_copies_of_ours(rid_response):
    """switching_head, in-process: a backend's own rate-limit fields (both dialects), its X-Request-Id when
    the edge writes its own (--request-id-response), and the fields its Connection names do not reach the
    client; its other fields and its Upgrade do (and its X-Request-Id, when the edge writes none)."""
    from types import SimpleNamespace

    from lb.http.framing import parse_response
    from lb.proxy.tunnel import switching_head

    rh = parse_response(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade, X-Hop\r\n"
                        b"X-Hop: 1\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\nX-Request-Id: backend-id\r\n"
                        b"X-RateLimit-Remaining: 999\r\nRateLimit: \"b\";r=9;t=1\r\nRateLimit-Policy: \"b\";q=10;w=1")
    x = SimpleNamespace(request_id=b"edge-id", set_cookie=b"",
                        rid_header=b"X-Request-Id: edge-id\r\n" if rid_response else b"",
                        rl=b"X-RateLimit-Limit: 2\r\nX-RateLimit-Remaining: 1\r\nX-RateLimit-Reset: 30\r\n"
                           b"RateLimit-Policy: \"default\";q=2;w=60\r\nRateLimit: \"default\";r=1;t=30\r\n")
    head = bytes(switching_head(x, rh)).decode()
    lines = head.split("\r\n")
    assert lines[0] == "HTTP/1.1 101 Switching Protocols"
    assert "Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in lines and "Upgrade: websocket" in lines
    assert [ln for ln in lines if ln.lower().startswith("x-request-id")] == \
        (["X-Request-Id: edge-id"] if rid_response else ["X-Request-Id: backend-id"])
    assert [ln for ln in lines if ln.lower().startswith(("x-ratelimit-remaining", "ratelimit:"))] == \
        ["X-RateLimit-Remaining: 1", 'RateLimit: "default";r=1;t=30']
    assert not any(ln.lower().startswith("x-hop") for ln in lines)


def test_upgrades_not_allowed_are_stripped(wsb):
    e = Edge("--backends", wsb.url, "--health-interval", "30", "--upgrades", "h2c-not-websocket")
    try:
        async def session():
            with pytest.raises(InvalidStatus) as info:
                async with ws(e.port):
                    pass
            # the backend never saw Upgrade: it answered as plain HTTP
            assert info.value.response.status_code == 200
            assert info.value.response.body.startswith(b"plain")

        run(session())
    finally:
        e.stop()


def test_a_hundred_concurrent_tunnels_over_a_pool_of_four(wsb):
    # 100 handshakes queue for 4 pool slots (a tunnel gives its slot back); on a loaded machine the
    # queue outlasts the default 1 s pool wait (58 of 100 opened once at load 7), which is the 503
    # the pool tests check, not what this test is about: a long wait here.
    e = Edge("--backends", wsb.url, "--health-interval", "30", "--admin", "127.0.0.1:0", "--pool-maxsize", "4",
             "--pool-timeout", "30")
    try:
        async def one(i, opened, go):
            async with ws(e.port) as c:
                opened.append(i)
                await go.wait()
                for j in range(3):
                    await c.send(f"{i}:{j}")
                    assert await c.recv() == f"{i}:{j}"
            return i

        async def session():
            opened, go = [], asyncio.Event()
            tasks = [asyncio.create_task(one(i, opened, go)) for i in range(100)]
            deadline = time.monotonic() + 40
            while len(opened) < 100 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert len(opened) == 100
            assert await asyncio.to_thread(metric, e, "lb_tunnels_open") == 100
            go.set()
            return sorted(await asyncio.gather(*tasks))

        assert run(session()) == list(range(100))
        wait_until(lambda: metric(e, "lb_tunnels_open") == 0, what="all tunnels closed")
        assert metric(e, "lb_tunnels_total") == 100
        assert request(e.port, "GET", "/after").status == 200
    finally:
        e.stop()


def test_idle_tunnel_is_closed_and_drain_closes_tunnels(wsb):
    idle = Edge("--backends", wsb.url, "--health-interval", "30", "--tunnel-idle-timeout", "1")
    drain = Edge("--backends", wsb.url, "--health-interval", "30", "--drain-timeout", "1")
    try:
        async def idle_session():
            async with ws(idle.port) as c:
                await c.send("a")
                assert await c.recv() == "a"
                t0 = time.monotonic()
                with pytest.raises(ConnectionClosed):
                    await c.recv()                      # nothing moves: the edge closes it
                return time.monotonic() - t0

        took = run(idle_session())
        assert 0.9 <= took < 10, took

        async def drain_session():
            async with ws(drain.port) as c:
                await c.send("a")
                assert await c.recv() == "a"
                drain.signal(signal.SIGTERM)
                # Still a working tunnel during the drain...
                await c.send("b")
                assert await c.recv() == "b"
                with pytest.raises(ConnectionClosed):
                    await c.recv()                      # ...until the drain deadline closes it

        run(drain_session())
        drain.popen.wait(15)
        assert drain.popen.returncode == 0
        assert "closing 1 tunnels" in drain.log()
    finally:
        idle.stop()
        drain.stop()


def test_wss_through_tls_termination(wsb, tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    e = Edge("--backends", wsb.url, "--health-interval", "30", "--tls-cert", str(cert), "--tls-key", str(key))
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    try:
        async def session():
            async with connect(f"wss://127.0.0.1:{e.port}/hello", ssl=ctx, proxy=None, compression=None,
                               ping_interval=None, open_timeout=10) as c:
                assert await c.recv() == "hello"
                big = "z" * 300000                      # many TLS records each way
                await c.send(big)
                assert await c.recv() == big

        run(session())
    finally:
        e.stop()


def test_a_handshake_to_a_dead_backend_is_retried_on_another(wsb):
    from tests.support import free_port
    dead = f"http://127.0.0.1:{free_port()}"        # nothing listens there: connect refused
    e = Edge("--backends", f"{dead},{wsb.url}", "--strategy", "round-robin", "--health-interval", "30",
             "--retries", "1")
    try:
        async def session():
            for i in range(4):                        # every other pick is the dead one
                async with ws(e.port) as c:
                    await c.send(f"m{i}")
                    assert await c.recv() == f"m{i}"

        run(session())
        assert "retrying on " + wsb.url in e.log()
    finally:
        e.stop()


def _handshake(port, path="/echo", extra=b""):
    return (b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: Upgrade\r\n"
            b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"\r\n" % port) + extra


def test_bytes_the_client_sends_with_its_handshake_reach_the_backend(wsb):
    import socket
    e = Edge("--backends", wsb.url, "--health-interval", "30")
    try:
        # A masked text frame "early" sent in the same write as the handshake, before any 101.
        mask = b"\x01\x02\x03\x04"
        frame = b"\x81\x85" + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(b"early"))
        with socket.create_connection(("127.0.0.1", e.port), timeout=10) as s:
            s.sendall(_handshake(e.port, extra=frame))
            got = b""
            while b"early" not in got:
                chunk = s.recv(65536)
                assert chunk, got
                got += chunk
        head = got.split(b"\r\n\r\n", 1)[0]
        assert head.startswith(b"HTTP/1.1 101 ") and b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in head
        assert got.endswith(b"\x81\x05early")            # the server's unmasked echo, through the tunnel
    finally:
        e.stop()


def test_a_101_without_upgrade_is_a_502_and_nothing_is_tunnelled():
    """A backend that answers 101 but names no protocol: the client gets a 502, not a tunnel."""
    import socket
    import threading
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += c.recv(65536)
                c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    e = Edge("--backends", f"http://127.0.0.1:{port}", "--health-interval", "30")
    try:
        from tests.support import raw
        out = raw(e.port, _handshake(e.port), timeout=10)
        assert out.startswith(b"HTTP/1.1 502 "), out
        e.wait_log(r"101 without an Upgrade header")
    finally:
        e.stop()
        srv.close()


def _raw_101_backend(answer):
    """A backend that answers each handshake with answer(its request head) and then echoes raw bytes."""
    import socket
    import threading
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = c.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                c.sendall(answer(data))
                try:
                    while chunk := c.recv(65536):
                        c.sendall(chunk)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


@pytest.mark.parametrize("accept, why", [
    (b"Sec-WebSocket-Accept: dGhpcyBpcyBub3QgaXQ=\r\n", "101 with a wrong Sec-WebSocket-Accept"),
    (b"", "101 without Sec-WebSocket-Accept"),
    (b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n",
     "101 with two Sec-WebSocket-Accept headers"),
], ids=["wrong", "missing", "twice"])
def test_a_101_whose_accept_does_not_answer_the_clients_key_is_a_502(accept, why):
    """The 101 must prove it answers this handshake (RFC 6455 4.1); a wrong or missing
    Sec-WebSocket-Accept is a 502 with one log line, no tunnel, and the backend connection closed."""
    from tests.support import raw
    srv, port = _raw_101_backend(
        lambda _req: b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" + accept + b"\r\n")
    e = Edge("--backends", f"http://127.0.0.1:{port}", "--health-interval", "30")
    try:
        out = raw(e.port, _handshake(e.port) + b"\x81\x85\x01\x02\x03\x04dgohn", timeout=10)
        assert out.startswith(b"HTTP/1.1 502 ") and out.count(b"HTTP/1.1") == 1, out
        assert b"dgohn" not in out                  # nothing came back through a tunnel
        e.wait_log("backend .* protocol: GET /echo -> 502 \\(" + re.escape(why) + "\\)")
        assert e.log().count(why) == 1
    finally:
        e.stop()
        srv.close()


def test_a_101_to_a_protocol_the_client_did_not_ask_for_is_a_502():
    """RFC 9110 7.8: a server MUST NOT switch to a protocol the client did not indicate. A 101 naming
    another protocol than the (allowed) one forwarded is not the switch this client asked for: without
    the check it opened a tunnel to a protocol the edge's upgrade allowlist never let through."""
    from tests.support import raw
    srv, port = _raw_101_backend(
        lambda _req: b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n")
    e = Edge("--backends", f"http://127.0.0.1:{port}", "--health-interval", "30")
    try:
        out = raw(e.port, _handshake(e.port) + b"\x81\x85\x01\x02\x03\x04dgohn", timeout=10)
        assert out.startswith(b"HTTP/1.1 502 ") and out.count(b"HTTP/1.1") == 1, out
        assert b"dgohn" not in out
        e.wait_log("101 to a protocol the client did not ask for")
    finally:
        e.stop()
        srv.close()


def test_a_101_whose_accept_answers_the_key_is_tunnelled():
    """The accept computed from the client's key (here the RFC's own example, and one of ours)."""
    import base64
    import hashlib
    import socket
    from tests.support import raw

    def answer(req):
        m = re.search(rb"Sec-WebSocket-Key: (\S+)", req)
        if m is None:           # the health check
            return b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        key = m.group(1)
        acc = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        return b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: WebSocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: " + acc + b"\r\n\r\n"

    srv, port = _raw_101_backend(answer)
    e = Edge("--backends", f"http://127.0.0.1:{port}", "--health-interval", "30")
    try:
        with socket.create_connection(("127.0.0.1", e.port), timeout=10) as s:
            s.sendall(_handshake(e.port) + b"ping")
            got = b""
            while not got.endswith(b"ping"):
                chunk = s.recv(65536)
                assert chunk, got
                got += chunk
        assert got.startswith(b"HTTP/1.1 101 ") and b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in got
        other = _handshake(e.port).replace(b"dGhlIHNhbXBsZSBub25jZQ==", b"AQIDBAUGBwgJCgsMDQ4PEA==")
        out = raw(e.port, other, timeout=2)
        assert out.startswith(b"HTTP/1.1 101 "), out
    finally:
        e.stop()
        srv.close()
def test_a_tunnel_holds_its_in_flight_slot_until_it_closes(wsb):
    """--max-in-flight counts an open WebSocket as the request in flight it is (nginx's limit_conn), and
    the slot comes back when the tunnel closes."""
    e = Edge("--backends", wsb.url, "--health-interval", "30", "--max-in-flight", "1")
    try:
        async def session():
            async with ws(e.port) as c:
                await c.send("hi")
                assert await c.recv() == "hi"
                with pytest.raises(InvalidStatus) as refused:        # a second one from the same client
                    async with ws(e.port):
                        pass
                assert refused.value.response.status_code == 429
                assert refused.value.response.headers["Retry-After"] == "1"
            # closed: the slot is given back (the edge's thread ends the tunnel a moment after the close)
            for _ in range(100):
                try:
                    async with ws(e.port) as c:
                        await c.send("again")
                        return await c.recv()
                except InvalidStatus:
                    await asyncio.sleep(0.05)
            return None

        assert run(session()) == "again"
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
