"""The backend connection pool's slots (lb/upstream/backends.py LifoSlots) and the hard cap they enforce, through
a real edge: --pool-maxsize concurrent requests at most per backend; a backend at its cap is passed over
for one with a free connection; when none has one, requests wait in line (first come, first served)
--pool-timeout and then get a 503; a slot that comes back goes to the longest waiter."""

from __future__ import annotations

import json
import queue
import signal
import threading
import time

import pytest

from lb.upstream.backends import LifoSlots
from tests.support import Edge, request, wait_until


def hold(*backends) -> None:
    """From now on these backends answer GET /hold only when the test releases them (the backends are the
    module's: a test arms them first)."""
    for b in backends:
        request(b.port, "POST", "/_ctl/hold")


def release(*backends) -> None:
    for b in backends:
        request(b.port, "POST", "/_ctl/release")


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


def one_slot_taken_and_a_waiter(timeout: float):
    """A pool of one slot, taken by the caller, and a thread waiting for it: (slots, the slot, what the
    waiter got, the waiter)."""
    s = LifoSlots(1)
    s.put("conn")
    mine = s.get()
    got = []
    w = threading.Thread(target=lambda: got.append(s.get(timeout=timeout)))
    w.start()
    wait_until(lambda: s.waiting == 1, what="the getter to wait")
    return s, mine, got, w


def test_a_slot_put_back_goes_to_the_longest_waiter_not_to_a_newcomer():
    s, mine, got, w = one_slot_taken_and_a_waiter(timeout=5)
    s.put(mine)
    # Asking again at once (a thread that releases and picks its next request): the slot is the waiter's.
    try:
        s.get(timeout=0.01)
        raise AssertionError("a newcomer took the slot a waiter had been waiting for")
    except queue.Empty:
        pass
    w.join(10)
    assert got == ["conn"] and s.waiting == 0 and not s.waiters


def test_waiters_are_served_first_come_first_served_and_none_is_lost():
    s = LifoSlots(2)
    for _ in range(2):
        s.put(None)
    held = [s.get(), s.get()]
    order, threads = [], []
    for i in range(6):
        t = threading.Thread(target=lambda i=i: order.append((i, s.get(timeout=10))))
        t.start()
        threads.append(t)
        wait_until(lambda: s.waiting == i + 1, what=f"getter {i} to wait")
    for n in range(6):                                   # each slot back goes to the next in line
        s.put(held.pop() if held else f"slot-{n}")
        wait_until(lambda: len(order) == n + 1, what=f"getter {n} to be served")
        assert order[-1][0] == n
    for t in threads:
        t.join(10)
    assert s.waiting == 0 and not s.waiters and s.qsize() == 0


def test_a_getter_that_times_out_leaves_the_line_and_later_slots_still_arrive():
    s = LifoSlots(1)
    s.put("a")
    x = s.get()
    try:
        s.get(timeout=0.01)
        raise AssertionError("an empty pool answered")
    except queue.Empty:
        pass
    assert not s.waiters and s.waiting == 0
    s.put(x)
    assert s.get(block=False) == "a"


class _Interleaved(list):
    """The slots' list with other threads' lock-free steps played at chosen moments: each pop() first
    runs the next scripted step (a getter on the fast path pops without the lock, so it may act between
    a locked caller's look at the list and its own pop)."""

    def __init__(self, *steps):
        super().__init__()
        self.steps = list(steps)

    def pop(self, *a):
        if self.steps:
            return self.steps.pop(0)(self)
        return list.pop(self, *a)


def test_a_put_whose_slot_a_fast_getter_took_first_hands_nothing_and_raises_nothing():
    s, mine, got, w = one_slot_taken_and_a_waiter(timeout=10)
    thief = []

    def fast_getter_first(items):      # it looked while nobody waited; its pop lands before the put's
        thief.append(list.pop(items))
        return list.pop(items)

    s.items = _Interleaved(fast_getter_first)
    s.put(mine)                         # (was: IndexError out of the put, i.e. out of release())
    assert thief == ["conn"] and s.waiting == 1 and len(s.waiters) == 1
    s.put(thief.pop())                  # the slot comes back: the waiter gets it
    w.join(10)
    assert got == ["conn"] and s.waiting == 0 and not s.waiters


def test_a_get_whose_slot_a_fast_getter_took_first_waits_in_line_instead_of_raising():
    s = LifoSlots(1)
    thief = []

    def empty_then_a_put_lands(items):   # the getter's fast pop finds none; a put lands before its lock
        try:
            return list.pop(items)
        finally:
            list.append(items, "conn")

    def fast_getter_first(items):
        thief.append(list.pop(items))
        return list.pop(items)

    s.items = _Interleaved(empty_then_a_put_lands, fast_getter_first)
    try:
        s.get(timeout=0.05)             # (was: IndexError out of the get, i.e. out of acquire())
        raise AssertionError("a slot another getter took was answered")
    except queue.Empty:
        pass
    assert thief == ["conn"] and s.waiting == 0 and not s.waiters


def test_a_backend_with_every_connection_busy_is_passed_over_for_a_free_one(backends):
    """nginx's max_conns: round robin would give every other request to the backend whose one connection
    a slow request holds; they wait --pool-timeout there and get 503 while the other backend idles."""
    a, b = backends[0], backends[1]
    hold(a, b)
    e = Edge("--backends", f"{a.url},{b.url}", "--health-interval", "30", "--pool-maxsize", "1",
             "--pool-timeout", "0.3", name="edge-pool-pass-over")
    try:
        slow = []
        t = threading.Thread(target=lambda: slow.append(request(e.port, "GET", "/hold").status))
        t.start()
        at = wait_until(lambda: next((x for x in (a, b) if "/hold" in x.stats()["last"]), None),
                        what="the held request to reach its backend")
        other = b if at is a else a
        got = [request(e.port, "GET", "/") for _ in range(6)]
        assert [r.status for r in got] == [200] * 6
        assert {r.body.decode().strip() for r in got} == {other.name.removeprefix("backend-")}
        release(a, b)
        t.join(30)
        assert slow == [200]
    finally:
        release(a, b)
        e.stop()


def test_the_pool_caps_connections_per_backend_and_answers_503_past_it(backends):
    b = backends[0]
    hold(b)
    e = Edge("--backends", b.url, "--health-interval", "30", "--pool-maxsize", "2", "--pool-timeout", "0.2",
             name="edge-pool-cap")
    try:
        slow = []
        threads = [threading.Thread(target=lambda: slow.append(request(e.port, "GET", "/hold").status))
                   for _ in range(2)]
        for t in threads:
            t.start()
        # Both slots busy (the backend holds both requests): the next one waits 0.2 s, then 503.
        wait_until(lambda: request(e.port, "GET", "/health-of-edge-pool").status == 503, timeout=10,
                   what="a request past the cap to be refused")
        release(b)
        for t in threads:
            t.join(30)
        assert slow == [200, 200]
        assert request(e.port, "GET", "/").status == 200      # the slots came back
    finally:
        release(b)
        e.stop()


@pytest.mark.parametrize("strategy,n", [("round-robin", 2), ("weighted", 3)])
def test_when_every_backend_is_full_requests_still_take_turns(backends, strategy, n):
    """The pass-over must not move the rotation when there is nowhere to pass to: each backend busy
    with one held request, the next n requests wait one in each backend's line, as without the
    pass-over. (Picking "another" one at a time took that one's turn too: round robin over two sent
    every such request to the first, the weighted one over three never to the second -- a 503 after
    --pool-timeout in the line of a backend busy for long, while the one that came free had nobody.)
    The backends answer when the test releases them, not after a fixed time (a loaded machine once took
    longer to queue the waiters than the busy backend stayed busy), and the line each waiter stood in is
    read from who answered it: backend i's connection, once free, goes to the one waiting for it."""
    bs = backends[:n]
    hold(*bs)
    e = Edge("--backends", ",".join(b.url for b in bs), "--strategy", strategy, "--health-interval", "30",
             "--pool-maxsize", "1", "--pool-timeout", "60", "--admin", "127.0.0.1:0", name=f"edge-pool-turns-{n}")
    in_flight = lambda: sum(x["inflight"] for x in
                            json.loads(request(e.admin_port, "GET", "/status").body)["backends"])
    out: dict = {}

    def send(i, path):
        r = request(e.port, "GET", path, timeout=90)
        out[i] = (r.status, r.body.decode().strip())

    threads = []
    try:
        for i, b in enumerate(bs):             # one held request per backend, in pick order
            threads.append(threading.Thread(target=send, args=(f"held{i}", "/hold")))
            threads[-1].start()
            wait_until(lambda: "/hold" in b.stats()["last"], what=f"held request {i} at {b.name}")
        for i in range(n):                     # every backend full: one at a time, into the lines
            threads.append(threading.Thread(target=send, args=(i, "/")))
            threads[-1].start()
            wait_until(lambda: in_flight() == n + i + 1, what=f"request {i} to wait in a line")
        release(*bs)
        for t in threads:
            t.join(60)
        got = [out.get(i) for i in range(n)]
        # Waiter i stood in backend i's line: one in each, none twice in one.
        assert got == [(200, b.name.removeprefix("backend-")) for b in bs], got
        assert [out[f"held{i}"][0] for i in range(n)] == [200] * n
    finally:
        release(*bs)
        e.stop()


def test_a_request_in_flight_across_a_reload_that_makes_new_pools_gives_its_slot_back_to_the_old_pool(
        backends, tmp_path):
    """Its connection came from the pool the reload replaced: released into the backend's new pool it
    overfilled it (urllib3's FullPoolError out of release(): an error logged, and the request missing
    from the access log and the metrics), or, with requests waiting there, one more connection than the
    new cap. The old pool closes it; the new pool keeps its own slots."""
    cfg = tmp_path / "edge.toml"
    log = tmp_path / "access.log"
    base = f'access_log = "{log}"\n[[backends]]\nurl = "{backends[0].url}"\n[health]\ninterval = 30\n'
    cfg.write_text(base + "[upstream]\npool_maxsize = 2\n")
    hold(backends[0])
    e = Edge("--config", str(cfg), name="edge-pool-reload")
    try:
        out = []
        t = threading.Thread(target=lambda: out.append(request(e.port, "GET", "/hold", timeout=20).status))
        t.start()
        wait_until(lambda: "/hold" in backends[0].stats()["last"], what="the held request at its backend")
        cfg.write_text(base + "[upstream]\npool_maxsize = 2\npool_timeout = 7\n")
        e.signal(signal.SIGHUP)
        e.wait_log(r"reloaded: 1 backends .*new connection pools")
        release(backends[0])                   # it finishes on the old pool's connection
        t.join(20)
        assert out == [200]
        wait_until(lambda: "/hold" in log.read_text(), what="the held request's access-log line")
        assert "unexpected error" not in e.log()
        assert [request(e.port, "GET", "/").status for _ in range(3)] == [200] * 3
    finally:
        release(backends[0])
        e.stop()
