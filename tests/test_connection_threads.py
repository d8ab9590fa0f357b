"""The connection threads EdgeServer keeps parked or starts with _thread (not threading.Thread, whose
start() waits for the new thread to run): what threading would otherwise keep of each, the cache's bound
and the count of connections. The
edge runs in this process (as bench/request_path.py runs it) so that threading's own table can be read;
its sockets and backend are real."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from lb.config import load as config
from lb.process.app import App
from tests.rawserver import RawServer
from tests.support import wait_until

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
