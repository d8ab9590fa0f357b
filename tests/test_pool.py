"""The backend connection pool's slots (lb/backends.py LifoSlots) and the hard cap they enforce, through
a real edge: --pool-maxsize concurrent requests at most per backend, the next waits --pool-timeout and
gets a 503; a slot that comes back is used again."""

from __future__ import annotations

import queue
import threading
import time

from lb.backends import LifoSlots
from tests.support import Edge, request, wait_until


def test_slots_are_last_in_first_out_and_bounded():
    s = LifoSlots(2)
    s.put("a")
    s.put("b")
    try:
        s.put("c", block=False)
        raise AssertionError("a third slot was accepted")
    except queue.Full:
        pass
    assert s.get() == "b" and s.get() == "a" and s.qsize() == 0
    try:
        s.get(block=False)
        raise AssertionError("an empty pool answered")
    except queue.Empty:
        pass


def test_a_waiting_get_takes_the_slot_put_back_and_times_out_otherwise():
    s = LifoSlots(1)
    got = []
    t = threading.Thread(target=lambda: got.append(s.get(timeout=30)))
    t.start()
    wait_until(lambda: s.waiting == 1, what="the getter to wait")
    s.put("conn")
    t.join(30)
    assert got == ["conn"] and s.waiting == 0
    t0 = time.monotonic()
    try:
        s.get(timeout=0.05)
        raise AssertionError("an empty pool answered")
    except queue.Empty:
        assert time.monotonic() - t0 >= 0.05


def test_the_pool_caps_connections_per_backend_and_answers_503_past_it(backends):
    b = backends[0]
    e = Edge("--backends", b.url, "--health-interval", "30", "--pool-maxsize", "2", "--pool-timeout", "0.2",
             name="edge-pool-cap")
    try:
        slow = []
        threads = [threading.Thread(target=lambda: slow.append(request(e.port, "GET", "/slow?ms=5000").status))
                   for _ in range(2)]
        for t in threads:
            t.start()
        # Both slots busy (the backend is inside both requests): the next one waits 0.2 s, then 503.
        wait_until(lambda: request(e.port, "GET", "/health-of-edge-pool").status == 503, timeout=10,
                   what="a request past the cap to be refused")
        for t in threads:
            t.join(30)
        assert slow == [200, 200]
        assert request(e.port, "GET", "/").status == 200      # the slots came back
    finally:
        e.stop()
