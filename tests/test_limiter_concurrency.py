"""In-flight limits (limiter.concurrency): the memory table, and the Redis one shared by edges.

The Redis safety net is tested with an injected clock: slots never given back (an edge killed with
requests in flight) stop counting ttl seconds after they were taken, even while the key stays busy.
"""

import threading

import pytest

from limiter.concurrency import InFlight, RedisInFlight


def test_the_memory_table_admits_n_and_forgets_a_key_at_zero():
    t = InFlight(2)
    a, b = t.acquire("k"), t.acquire("k")
    assert a is not None and b is not None
    assert t.acquire("k") is None
    assert t.acquire("other") is not None          # keys are apart
    t.release(a)
    c = t.acquire("k")
    assert c is not None and t.count("k") == 2
    t.release(b)
    t.release(c)
    assert t.count("k") == 0 and len(t) == 1        # only "other" is left: bounded by what is in flight
    with pytest.raises(ValueError):
        InFlight(0)


def test_the_memory_table_is_exact_under_threads():
    t = InFlight(5)
    peak, now, lock = [0], [0], threading.Lock()
    go = threading.Barrier(16)

    def worker():
        go.wait()
        for _ in range(300):
            s = t.acquire("k")
            if s is None:
                continue
            with lock:
                now[0] += 1
                peak[0] = max(peak[0], now[0])
            with lock:
                now[0] -= 1
            t.release(s)

    ts = [threading.Thread(target=worker) for _ in range(16)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    assert peak[0] <= 5 and t.count("k") == 0


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_redis_slots_are_shared_by_edges_released_and_expire_when_an_edge_dies(redis_server):
    clock = Clock()
    prefix = f"test:inflight:{id(clock)}:"
    one = RedisInFlight(2, redis_server.url, prefix=prefix, ttl=5.0, clock=clock)
    two = RedisInFlight(2, redis_server.url, prefix=prefix, ttl=5.0, clock=clock)   # another edge
    r = redis_server.client()
    a = one.acquire("k")
    b = two.acquire("k")
    assert a is not None and b is not None
    assert one.acquire("k") is None and two.acquire("k") is None      # N across both edges
    assert r.zcard(f"{prefix}{{k}}") == 2 and r.pttl(f"{prefix}{{k}}") > 0
    one.release(a)
    assert r.zcard(f"{prefix}{{k}}") == 1
    c = one.acquire("k")
    assert c is not None
    # `two` dies holding b, and c is never released either: the key stays busy with new requests...
    clock.t += 3.0
    assert one.acquire("k") is None
    clock.t += 2.5                                   # ...yet 5 s after each was taken, they stop counting
    d, e = one.acquire("k"), one.acquire("k")
    assert d is not None and e is not None
    one.release(d)
    one.release(e)
    assert r.zcard(f"{prefix}{{k}}") == 0


def test_redis_down_applies_the_failure_policy():
    opened = RedisInFlight(1, "redis://127.0.0.1:1/0", timeout=0.05, on_error="fail-open")
    slot = opened.acquire("k")
    assert slot is not None and opened.degraded == 1
    opened.release(slot)                             # nothing held, nothing to give back
    closed = RedisInFlight(1, "redis://127.0.0.1:1/0", timeout=0.05, on_error="fail-closed", prefix="x:")
    assert closed.acquire("k") is None


def test_the_shared_table_counts_across_processes_and_reclaims_a_dead_workers_slots():
    import os

    from limiter.concurrency import SharedTable, ShmInFlight
    table = SharedTable(1024)
    try:
        lim = ShmInFlight(3, table, name="t")
        mine = [lim.acquire("k"), lim.acquire("k")]
        assert None not in mine
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                                 # a worker: takes the third slot, is refused the fourth,
            got = (lim.acquire("k") is not None, lim.acquire("k") is None)
            os.write(w, b"%d%d" % got)
            os._exit(0)                              # ... and dies without giving its slot back
        assert os.read(r, 2) == b"11"
        os.waitpid(pid, 0)                           # reaped, as the supervisor reaps a dead worker
        assert lim.count("k") == 3
        again = lim.acquire("k")                     # would refuse: the dead worker's row is reclaimed
        assert again is not None and lim.count("k") == 3
        assert lim.acquire("k") is None
        for s in mine + [again]:
            lim.release(s)
        assert lim.count("k") == 0
        assert ShmInFlight(3, table, name="other").acquire("k") is not None   # names are apart
    finally:
        table.close()
