"""The connection threads EdgeServer keeps parked or starts with _thread (not threading.Thread, whose
start() waits for the new thread to run): what threading would otherwise keep of each, the cache's bound
and the count of connections. The
edge runs in this process (as bench/request_path.py runs it) so that threading's own table can be read;
its sockets and backend are real."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading

import pytest

from lb.config import load as config
from lb.process.app import App
from tests.h2client import H2Client
from tests.rawserver import RawServer
from tests.support import PY, ROOT, wait_until

pytestmark = pytest.mark.integration


def _ok(s, _server):
    while s.recv(65536):
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")


@pytest.fixture
def app():
    backend = RawServer(_ok)
    cfg = config.load(["--listen", "127.0.0.1:0", "--backends", backend.url, "--health-interval", "3600"])
    a = App(cfg)
    t = threading.Thread(target=a.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield a
    a.server.shutdown()
    a.server.server_close()
    backend.close()


def _bad_request(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: h\r\nBad Header: x\r\n\r\n")
        got = b""
        while data := s.recv(65536):
            got += data
        return got


def test_connections_that_log_leave_nothing_behind_in_threadings_table(app, caplog):
    # threading registers a record for good for any thread it did not start, the first time that thread
    # asks for its own Thread object; logging asks on every record unless logThreads is off. These
    # connections log their 400s on their own threads (some of them: client faults are logged at a rate).
    port = app.server.server_address[1]
    before = set(threading.enumerate())
    caplog.set_level(logging.INFO)
    for _ in range(30):
        assert _bad_request(port).startswith(b"HTTP/1.1 400 ")
    wait_until(lambda: app.server.active == 0, timeout=5, what="every connection's thread finished")
    logged = [r for r in caplog.records if r.name == "edge"]
    assert logged, "no connection logged: the scenario did not happen"
    kept = [t for t in threading.enumerate() if t not in before and t.name != "client-faults"]  # (its timer)
    assert not kept, kept


def test_many_connections_at_once_are_each_served_and_counted_off(app):
    port = app.server.server_address[1]
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(64)]
    try:
        # Every one accepted (and its thread waiting for its request) before any is answered: else a thread
        # whose connection ended parks and takes a later one, and fewer than 64 ran at once (27, once).
        wait_until(lambda: app.server.active == 64, timeout=5, what="the 64 connections accepted")
        for s in socks:
            s.sendall(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        for s in socks:
            got = b""
            while data := s.recv(65536):
                got += data
            assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"ok"), got
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: app.server.active == 0, timeout=5, what="the count back to 0")
    # 64 threads were running: as many as the cache keeps (--thread-cache, 32 by default) park, the rest end
    wait_until(lambda: len(app.server.threads.parked) == app.edge.cfg.thread_cache == 32, timeout=5,
               what="32 threads parked")


def test_http2_connections_that_grow_the_stream_pool_leave_nothing_behind(tmp_path):
    # Each HTTP/2 stream is served by a worker of lb/http2/server.py's ThreadPoolExecutor, which the
    # connection's thread grows when no worker is idle: ThreadPoolExecutor makes its Thread without
    # daemon=, which asks threading for the maker's own Thread, and threading registers one for good for
    # a connection thread it did not start. Here every stream waits at the backend until all have come,
    # so each needs a worker of its own.
    n = 6
    arrived = []
    lock = threading.Lock()
    everyone = threading.Event()

    def held(s, _server):
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = s.recv(65536)
            if not data:
                return
            buf += data
        with lock:
            arrived.append(1)
            if len(arrived) >= n:
                everyone.set()
        everyone.wait(10)
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    backend = RawServer(held)
    cfg = config.load(["--listen", "127.0.0.1:0", "--backends", backend.url, "--health-interval", "3600"])
    a = App(cfg)
    threading.Thread(target=a.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    port = a.server.server_address[1]
    before = set(threading.enumerate())
    clients = []
    try:
        clients = [H2Client(port) for _ in range(n)]
        sids = [c.request("/x") for c in clients]
        for c, sid in zip(clients, sids):
            r = c.response(sid)
            assert r["headers"][b":status"] == b"200" and r["data"] == b"ok", r
    finally:
        for c in clients:
            c.close()
    try:
        wait_until(lambda: a.server.active == 0, timeout=5, what="every connection's thread finished")
        new = [t for t in threading.enumerate() if t not in before]
        assert any(t.name.startswith("h2-stream") for t in new), "the pool did not grow: the scenario did not happen"
        kept = [t for t in new if not t.name.startswith("h2-stream") and t.name != "client-faults"]
        assert not kept, kept
    finally:
        a.server.shutdown()
        a.server.server_close()
        backend.close()


_TAKE_QUEUED_WITHOUT_THREADS = """
import re, resource, socket
from lb.config import load as config
from lb.process import handover
from lb.process.app import App

dead = socket.create_server(("127.0.0.1", 0))  # a backend that refuses: its probes start no thread here
backend_url = "http://127.0.0.1:%d" % dead.getsockname()[1]
dead.close()
# A stack size no thread had before: glibc hands a new thread the cached stack of one that ended (no mmap, no
# rlimit) when its size fits, and the default stacks (8 MiB) of the threads that ended at start-up would. (An
# in-process backend would start a thread for the health probe: one that ends after VmSize is read frees
# room for ours.)
a = App(config.load(["--listen", "127.0.0.1:0", "--backends", backend_url, "--health-interval", "3600",
                     "--thread-stack", str(64 << 20)]))
ls = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(ls.getsockname(), timeout=5)
ls.setblocking(False)
vm = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 20), resource.RLIM_INFINITY))  # no room for a 64 MiB stack
try:
    try:
        got = "taken %d" % handover.take_queued(a.server, ls)
    except Exception as e:
        got = "raised %r" % e
finally:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print("%s, active %d" % (got, a.server.active))
"""


def test_a_queued_connection_whose_thread_cannot_start_is_counted_off_once_and_the_take_goes_on():
    # take_queued (the drain's last accepts, and a handed-over listener's thread) calls process_request
    # itself, outside socketserver's accept loop and its except clause: a thread that could not start
    # raised out of it, the connection stayed counted for good (one --max-connections slot fewer), and
    # the drain ended there, before waiting for the requests in flight.
    p = subprocess.run([PY, "-c", _TAKE_QUEUED_WITHOUT_THREADS], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "taken 0, active 0", (p.stdout, p.stderr[-2000:])
    assert "can't start new thread" in p.stderr, p.stderr[-2000:]  # logged (handle_error)
