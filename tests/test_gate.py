"""lb/http/gate.py: at most n connection threads at work, the others served in arrival order, and a
holder blocked elsewhere loses its place. Real threads; every wait has a generous deadline."""

import threading
import time

from lb.http.gate import Gate
from tests.support import wait_until


def test_no_more_than_n_members_run_at_once_and_every_one_gets_through():
    g = Gate(3, stuck=5.0)
    running, peak, done = [0], [0], []
    lock = threading.Lock()

    def member(i):
        g.join()
        for _ in range(20):
            g.enter()
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(0.0005)
            with lock:
                running[0] -= 1
            g.leave()
        g.part()
        done.append(i)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(done) == list(range(12))
    # The bound, but for the few the lock-free entry may let through together (a soft bound, by design)
    assert 3 <= peak[0] <= 6 and g.running() == 0 and g.waiting() == 0 and g.stolen == 0
    assert g.handoffs > 0            # some had to wait: the bound was reached


def test_waiters_are_served_in_arrival_order():
    g = Gate(1, stuck=5.0)
    order = []
    g.join()
    g.enter()                        # this thread holds the only slot

    def member(i):
        g.join()
        g.enter()
        order.append(i)
        g.part()

    threads = []
    for i in range(6):
        t = threading.Thread(target=member, args=(i,))
        t.start()
        threads.append(t)
        wait_until(lambda: g.waiting() == i + 1, 10, what=f"waiter {i} queued")
    g.part()
    for t in threads:
        t.join(10)
    assert order == list(range(6))


def test_a_holder_blocked_elsewhere_gives_its_slot_up_after_stuck():
    g = Gate(1, stuck=0.05)
    g.join()
    g.enter()                        # held, then "blocked" (never leaves while the other waits)
    got = threading.Event()

    def member():
        g.join()
        g.enter()
        got.set()
        g.part()

    t = threading.Thread(target=member)
    t.start()
    assert got.wait(10)
    assert g.stolen == 1
    g.part()                         # its late leave: no slot to give back, the count stays right
    t.join(10)
    assert g.running() == 0


def test_threads_that_never_joined_are_not_gated():
    g = Gate(1, stuck=5.0)
    assert g.leave() is False        # (Reader.fill then does not enter again)
    g.join()
    assert g.leave() is True
    g.part()


# ------------------------------------------------------------------ through the edge, one slot only

def _backend(release: threading.Event):
    """/slow answers once `release` is set; /big is 256 MiB (more than any socket buffers hold); anything
    else answers at once."""
    from tests.rawserver import RawServer

    def handler(s, server):
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = s.recv(65536)
                if not data:
                    return
                buf += data
            head, buf = buf.split(b"\r\n\r\n", 1)
            path = head.split(b" ", 2)[1]
            if path == b"/slow":
                release.wait(30)
            if path == b"/big":
                s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (256 << 20))
                piece = b"x" * (1 << 20)
                for _ in range(256):
                    s.sendall(piece)
                    server.big_sent = getattr(server, "big_sent", 0) + 1
            else:
                s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    return RawServer(handler)


def test_with_one_slot_a_request_waiting_for_its_backend_does_not_hold_up_another():
    import socket

    from tests.support import Edge, request
    release = threading.Event()
    b = _backend(release)
    e = Edge("--backends", b.url, "--health-interval", "30", "--running-threads", "1")
    try:
        slow = socket.create_connection(("127.0.0.1", e.port), timeout=20)
        slow.sendall(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
        wait_until(lambda: b.connections >= 1, 10, what="the slow request at the backend")
        t0 = time.monotonic()
        assert request(e.port, path="/fast", timeout=10).status == 200    # the slot was free meanwhile
        assert time.monotonic() - t0 < 5
        release.set()
        assert slow.recv(65536).startswith(b"HTTP/1.1 200")
        slow.close()
    finally:
        release.set()
        e.stop()
        b.close()


def test_with_one_slot_a_client_that_stops_reading_gives_its_place_up():
    import socket

    from tests.support import Edge, request
    b = _backend(threading.Event())
    e = Edge("--backends", b.url, "--health-interval", "30", "--running-threads", "1", "--proxy-buffering", "off")
    try:
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(("127.0.0.1", e.port))
        stuck.sendall(b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n")          # and never reads: the edge's send blocks
        seen = []

        def stalled():      # the edge's send to the client blocks: the backend's sends stop moving
            seen.append(getattr(b, "big_sent", 0))
            return len(seen) > 5 and seen[-1] == seen[-5] > 0
        wait_until(stalled, 20, interval=0.2, what="the edge blocked sending to the client")
        t0 = time.monotonic()
        assert request(e.port, path="/fast", timeout=20).status == 200
        assert time.monotonic() - t0 < 10      # (not send_timeout, 60 s: the blocked sender's slot was taken)
        stuck.close()
    finally:
        e.stop()
        b.close()


def test_a_thread_waiting_in_a_backend_pools_line_gives_its_slot_to_the_thread_holding_the_connection():
    # One slot, one pooled connection. A holds the connection and waits at the gate (its backend
    # answered); B holds the slot and waits in the pool's line for A's connection. Holding its slot
    # there, B would stop A until the watchdog (an hour here) took it: a deadlock at -c512.
    from lb.http import gate as gates
    from lb.upstream.backends import LifoSlots

    g = Gate(1, stuck=3600.0)
    gates.install(g)
    pool = LifoSlots(1)
    pool.put("conn")
    got = {}
    a_has_conn, b_waits = threading.Event(), threading.Event()

    def a():
        g.join()
        g.enter()
        got["a"] = pool.get(timeout=30)
        a_has_conn.set()
        g.leave()                    # waits for its backend ...
        b_waits.wait(30)
        wait_until(lambda: pool.waiting == 1, 10, what="B in the pool's line")
        g.enter()                    # ... which answered: needs a slot to relay the answer
        pool.put(got["a"])
        g.part()

    def b():
        a_has_conn.wait(30)
        g.join()
        g.enter()
        b_waits.set()
        got["b"] = pool.get(timeout=30)
        g.part()

    try:
        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert got == {"a": "conn", "b": "conn"} and g.stolen == 0
    finally:
        gates.install(None)
