"""Counts that return to zero: every backend's lb_backend_inflight is 0 once the edge is idle, whatever
path its requests took -- a connect failure retried on another backend, a read timeout, a client gone
mid-response, a WebSocket tunnel. (The drain procedure waits for inflight 0; least-request reads it.)"""

from __future__ import annotations

import re
import resource
import socket
import time

import pytest

from tests.rawserver import ConnReader, RawServer, read_request
from tests.support import PY, Backend, Edge, Proc, free_port, request, wait_until


def inflight(e: Edge) -> dict[str, int]:
    text = request(e.admin_port, "GET", "/metrics").body.decode()
    return {m.group(1): int(float(m.group(2)))
            for m in re.finditer(r'^lb_backend_inflight\{backend="([^"]+)"\} (\S+)$', text, re.M)}


def all_zero(e: Edge, urls: list[str], timeout: float = 10.0) -> None:
    """Every backend's in-flight count reaches 0 (the edge finishes a request's bookkeeping after the
    client has its answer: poll with a deadline) -- and stays there: a drift would not come back."""
    try:
        wait_until(lambda: all(inflight(e).get(u) == 0 for u in urls), timeout, what="inflight 0")
    except AssertionError:
        raise AssertionError(f"in flight: {inflight(e)}") from None
    got = inflight(e)
    assert set(urls) <= set(got) and all(got[u] == 0 for u in urls), got


def serve(handler):
    """A RawServer whose handler(sock, method, target) answers each request of a connection."""
    def run(s, _server):
        r = ConnReader(s)
        while (req := read_request(r)) is not None:
            if handler(s, req[0], req[1]) is False:
                return
    return RawServer(run)


def ok(s, method, target):
    body = f"{target}\n".encode()
    s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


def test_connect_failures_retried_elsewhere_leave_no_count_behind():
    # Round robin over a backend that refuses connections and one that answers: every other request
    # fails to connect and is retried on the live one. Before: +1 left on the dead one and -1 on the
    # live one per retry (the decrement went to whichever backend the variable named by then).
    live = serve(ok)
    dead = f"http://127.0.0.1:{free_port()}"
    e = Edge("--backends", f"{dead},{live.url}", "--strategy", "round-robin", "--retries", "1",
             "--health-interval", "30", "--eject-after", "0", "--admin", "127.0.0.1:0")
    try:
        for i in range(6):
            r = request(e.port, "GET", f"/r{i}")
            assert r.status == 200 and r.body == f"/r{i}\n".encode()
        assert "retrying on " + live.url in e.log()
        all_zero(e, [dead, live.url])
    finally:
        e.stop()
        live.close()


def test_a_read_timeout_and_a_client_gone_mid_response_leave_no_count_behind():
    def handler(s, method, target):
        if target == "/silent":
            time.sleep(3)                      # past the edge's read timeout: a 504
            return False
        if target == "/stream":
            # A body far larger than any buffer, in pieces: the client leaves in the middle of it.
            s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (200 << 20))
            try:
                for _ in range(200 << 4):
                    s.sendall(b"x" * 65536)
                    time.sleep(0.005)
            except OSError:
                pass
            return False
        ok(s, method, target)

    b = serve(handler)
    e = Edge("--backends", b.url, "--read-timeout", "0.5", "--health-interval", "30", "--eject-after", "0",
             "--admin", "127.0.0.1:0")
    try:
        assert request(e.port, "GET", "/silent").status == 504
        all_zero(e, [b.url])
        with socket.create_connection(("127.0.0.1", e.port), timeout=10) as c:
            c.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            got = 0
            while got < 1 << 20:
                got += len(c.recv(65536))
            assert inflight(e)[b.url] == 1         # the streaming response is in flight
        # The client is gone: the edge's next send to it fails and it lets go of the backend.
        all_zero(e, [b.url], timeout=20)
        assert request(e.port, "GET", "/after").status == 200
        all_zero(e, [b.url])
    finally:
        e.stop()
        b.close()


def test_a_websocket_tunnel_counts_while_open_and_not_after():
    pytest.importorskip("websockets", reason="websockets (requirements-dev.txt) is the real client")
    from websockets.sync.client import connect

    wsb = Proc([PY, "-m", "tests.ws_backend", "--port", "0"], "ws-backend")
    port = int(wsb.wait_log(r"listening \S+:(\d+)").group(1))
    url = f"http://127.0.0.1:{port}"
    dead = f"http://127.0.0.1:{free_port()}"
    # The dead one first in the rotation: the first handshake is a connect failure retried on the live one.
    e = Edge("--backends", f"{dead},{url}", "--strategy", "round-robin", "--retries", "1",
             "--health-interval", "30", "--eject-after", "0", "--admin", "127.0.0.1:0")
    try:
        for i in range(2):
            with connect(f"ws://127.0.0.1:{e.port}/echo", proxy=None, open_timeout=10, close_timeout=5) as c:
                c.send(f"m{i}")
                assert c.recv(timeout=10) == f"m{i}"
                assert inflight(e)[url] == 1        # the open tunnel is in flight to its backend
        all_zero(e, [dead, url])
    finally:
        e.stop()
        wsb.stop()


def test_a_buffered_response_stops_counting_when_the_backend_is_done_not_the_client():
    # With response buffering (the default) a slow reader holds memory or a temp file, not the backend:
    # once the backend has sent everything, the request no longer loads it (least-request, the drain's
    # "wait for inflight 0"), though the client has read almost nothing yet.
    body = b"x" * (32 << 20)       # far more than the sockets' kernel buffers hold between them

    def big(s, method, target):
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    b = serve(big)
    e = Edge("--backends", b.url, "--health-interval", "30", "--admin", "127.0.0.1:0")
    slow = socket.create_connection(("127.0.0.1", e.port), timeout=10)
    try:
        slow.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        assert slow.recv(64).startswith(b"HTTP/1.1 200 ")
        wait_until(lambda: b.connections >= 1, what="the request at the backend")
        all_zero(e, [b.url])                        # while the client still has megabytes to read
        got = 64
        while got < len(body):                      # and the client still gets every byte
            data = slow.recv(1 << 20)
            assert data, f"closed after {got} bytes"
            got += len(data)
    finally:
        slow.close()
        e.stop()
        b.close()


def _gauge(e: Edge) -> float:
    text = request(e.admin_port, "GET", "/metrics").body.decode()
    return float(re.search(r"^lb_client_connections (\S+)$", text, re.M).group(1))


def _thread_failures(e: Edge) -> int:
    return e.log().count("can't start new thread")


def wait_until_or_not(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_connection_whose_thread_cannot_start_is_counted_off_once():
    # socketserver already calls shutdown_request() when process_request() raises (a thread that cannot
    # start: RLIMIT_AS, RLIMIT_NPROC, systemd's TasksMax); the edge's and the admin's own except clause
    # took the connection off the count a second time, so each failure raised --max-connections (and
    # the admin cap) by one for good, and lb_client_connections went negative.
    b = Backend("threads")
    e = Edge("--backends", b.url, "--health-interval", "30", "--max-connections", "16", "--admin", "127.0.0.1:0")
    held = []
    try:
        wait_until(lambda: _gauge(e) == 0, what="no client connection yet")
        pid = e.popen.pid
        vm = int(re.search(r"VmSize:\s+(\d+)", open(f"/proc/{pid}/status").read()).group(1)) * 1024
        resource.prlimit(pid, resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))   # room for the heap, not for a thread stack (8 MiB)
        try:
            for _ in range(15):                # kept open: a thread that did start keeps its stack
                held.append(socket.create_connection(("127.0.0.1", e.port), timeout=5))
                if wait_until_or_not(lambda: _thread_failures(e) >= 1, 0.3):
                    break
            assert _thread_failures(e) >= 1, "every thread started: the scenario did not happen" + e.log()[-1500:]
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        for s in held:
            s.close()
        held = []
        wait_until(lambda: _gauge(e) == 0, timeout=10, what="the count back to 0 (not below)")
        # ... and the cap is still 16: a 17th idle connection is refused
        for _ in range(16):
            held.append(socket.create_connection(("127.0.0.1", e.port), timeout=5))
        wait_until(lambda: _gauge(e) == 16, timeout=10, what="sixteen connections counted")
        s = socket.create_connection(("127.0.0.1", e.port), timeout=5)
        held.append(s)
        assert s.recv(64).startswith(b"HTTP/1.1 503 "), "a 17th connection past --max-connections 16"
        assert e.alive()
    finally:
        for s in held:
            s.close()
        e.stop()
        b.stop()
