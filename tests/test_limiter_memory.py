"""The memory store: bounded memory under key rotation, eviction that never changes a decision, striping."""

import bisect
import itertools
import random
import threading
import time

import pytest

from limiter import ALGORITHMS, build
from limiter.algorithms import SlidingLog
from limiter.memory import MemoryStore, TableFullDecision

ALL = sorted(ALGORITHMS)


def test_a_flood_of_live_keys_fills_the_table_and_is_refused_never_past_max_keys():
    """The hard cap is global: 100,000 distinct keys, all live (window 60 s), cap 10,000: exactly the
    cap is held, every key past it is refused with a TableFullDecision (503 at the edge), counted."""
    cap = 10_000
    lim = build("fixed-window", 100, 60.0, max_keys=cap)
    started = time.perf_counter()
    allow = lim.allow
    refused = 0
    for i in range(100_000):
        d = allow(i, 1000.0 + i * 2e-5)  # int keys: strings would be the test's memory
        if not d.allowed:
            assert type(d) is TableFullDecision and d.unavailable and d.limit == 100 and d.retry_after > 0
            refused += 1
    elapsed = time.perf_counter() - started
    print(f"\n[memory] 100,000 live keys with max_keys={cap}: {len(lim)} held, {refused} refused, {elapsed:.2f} s")
    assert len(lim) == cap and refused == 100_000 - cap == lim.full


def test_the_cap_is_global_two_clients_in_a_small_table_never_evict_each_other():
    """max_keys=100 holds 100 keys (not 64 = one per stripe), and two active clients that share a
    stripe keep their states: each gets exactly its 5 of 100 attempts."""
    lim = build("sliding-log", 5, 60.0, max_keys=100)
    for i in range(98):
        assert lim.allow(f"other{i}", 10.0).allowed
    a = "alpha"
    b = next(k for k in (f"beta{i}" for i in range(10_000)) if hash(k) & 63 == hash(a) & 63)
    got = {a: 0, b: 0}
    for i in range(100):
        for k in (a, b):
            got[k] += lim.allow(k, 10.0 + i * 0.01).allowed
    assert got == {a: 5, b: 5} and len(lim) == 100


@pytest.mark.parametrize("algorithm", ALL)
def test_a_key_rotating_flood_never_resets_a_limited_keys_quota(algorithm):
    """A limited key, then a flood of junk keys far past max_keys: idle junk is evicted first, live
    junk past the cap is refused, and the limited key stays limited until its own state says so."""
    kw = {"burst": 5} if algorithm == "token-bucket" else {}
    lim = build(algorithm, 5, 60.0, max_keys=1000, **kw)
    t = 1000.0
    while lim.allow("victim", t).allowed:
        pass
    for i in range(20_000):
        lim.allow(f"junk{i}", t + 0.001 * (i % 10))
    assert len(lim) == 1000 and lim.full >= 19_000
    d = lim.allow("victim", t + 1.0)
    assert not d.allowed and type(d).__name__ == "Decision"  # a 429 from its own state, not a fresh quota
    # Junk that has gone idle is evicted first: the table takes new keys again, the victim keeps its state.
    later = t + 200.0
    assert lim.allow("newcomer", later).allowed and lim.full < 20_000 + 1
    assert len(lim) <= 1000


def test_the_clock_is_read_under_the_keys_lock_so_instants_reach_the_rule_in_order():
    """allow(key) without `now`: 16 threads on one key, a clock that ticks on every read.  The instants
    reach the algorithm's step strictly increasing, and the sliding log never admits more than N in any
    window (read before the lock, a later instant could be decided first: N=2, W=10, instants decided
    in the order 11, 7, 21, 7 admitted all four)."""
    ticks = itertools.count()
    seen, admitted = [], []

    class Recording(SlidingLog):
        def step(self, state, now):  # runs under the key's lock
            seen.append(now)
            new, d = super().step(state, now)
            if d.allowed:
                admitted.append(now)
            return new, d

    n, w = 20, 50.0
    store = MemoryStore(Recording(n, w), clock=lambda: float(next(ticks)))

    def run():
        for _ in range(300):
            store.allow("hot")

    ts = [threading.Thread(target=run) for _ in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert seen == sorted(seen) and len(set(seen)) == len(seen) == 16 * 300
    admitted.sort()
    worst = max(bisect.bisect_left(admitted, a + w) - i for i, a in enumerate(admitted))
    assert worst == n, worst


@pytest.mark.parametrize("algorithm", ALL)
def test_idle_keys_are_swept_without_a_cap(algorithm):
    """No cap in play: 200,000 keys rotating at 1,000/s with a 1 s window keep only about the live ones."""
    lim = build(algorithm, 5, 1.0, max_keys=10_000_000)
    for i in range(200_000):
        lim.allow(i, 1000.0 + i / 1000.0)
    # live: keys touched within their expiry horizon (<= 2 windows for the counter) = at most ~2,000
    print(f"\n[memory] {algorithm}: 200,000 keys at 1,000/s, window 1 s -> {len(lim)} held")
    assert len(lim) <= 5_000


@pytest.mark.parametrize("algorithm", ALL)
def test_eviction_never_changes_a_decision(algorithm):
    """The idle sweep drops only states that behave exactly like a fresh key: same decisions as a store
    that keeps everything forever."""
    rng = random.Random(algorithm)
    n, w = 3, 1.0
    kw = {"burst": 4} if algorithm == "token-bucket" else {}
    algo = ALGORITHMS[algorithm](n, w, **kw)
    store = MemoryStore(algo, max_keys=1_000_000, stripes=1)  # one stripe: every insertion sweeps the same queue
    forever = {}
    t = 100.0
    smallest = None
    for _ in range(20_000):
        t += rng.choice([0.0, 0.001, 0.01, 0.1, 0.5])
        key = rng.randrange(60)
        got = store.allow(key, t)
        state, want = algo.step(forever.get(key), t)
        forever[key] = state
        assert got == want
        smallest = len(store) if smallest is None else min(smallest, len(store))
    assert smallest < 60  # the sweep did evict


def test_stripes_do_not_serialise_different_keys():
    lim = build("sliding-log", 10, 1.0)
    stripes = lim._locks
    assert len(stripes) == 64
    a = "alpha"
    b = next(k for k in (f"key{i}" for i in range(1000)) if hash(k) & 63 != hash(a) & 63)
    lock_a = stripes[hash(a) & 63]
    done = threading.Event()
    with lock_a:  # a decision for `a` in progress
        th = threading.Thread(target=lambda: (lim.allow(b, 1.0), done.set()))
        th.start()
        assert done.wait(5.0), "a key in another stripe waited for a's lock"
    th.join()


def test_max_keys_smaller_than_the_stripe_count_still_bounds():
    lim = build("token-bucket", 5, 1.0, max_keys=3)
    for i in range(1000):
        lim.allow(i, 10.0)
        assert len(lim) <= 3
