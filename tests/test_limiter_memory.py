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
    """No cap in play: 50,000 keys rotating at 1,000/s with a 1 s window keep only about the live ones (25 times as many)."""
    lim = build(algorithm, 5, 1.0, max_keys=10_000_000)
    for i in range(50_000):
        lim.allow(i, 1000.0 + i / 1000.0)
    # live: keys touched within their expiry horizon (<= 2 windows for the counter) = at most ~2,000
    print(f"\n[memory] {algorithm}: 50,000 keys at 1,000/s, window 1 s -> {len(lim)} held")
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


# ------------------------------------------- the key table: reclaimable states go, limited ones never (issue 29)

def _reclaimable(lim, now):
    return sum(1 for s in list(lim._states.values()) if lim.algorithm.expires_at(s) <= now)


@pytest.mark.parametrize("algorithm", ALL)
def test_rotating_fresh_keys_evict_reclaimable_states_never_a_limited_one_nor_lock_out(algorithm):
    """The issue's rotation (fresh IPv6 addresses minting keys) at max_keys = 200, injected clock: 150
    steady clients inserted first and kept live (one request per 0.25 s at 5/s), one client at its limit,
    and 10 fresh keys every 50 ms, each used once.  A new key is never refused while any state in the
    table is reclaimable (before: 8 keys were looked at, and the steady ones in front of the reclaimable
    ones refused new clients), and the client at its limit gets decision for decision what it gets in a
    table of its own: its state is never dropped."""
    from limiter import build
    lim = build(algorithm, 5, 1.0, max_keys=200)
    alone = build(algorithm, 5, 1.0)            # the limited client's decisions in a table of its own
    t = 1000.0
    steady = [f"steady{i}" for i in range(150)]
    for k in steady:
        lim.allow(k, t)
    refused_with_room, fresh, admitted = 0, 0, 0
    for tick in range(400):                    # 20 s
        t = 1000.0 + tick * 0.05
        for k in steady[tick % 5::5]:          # each steady client every 0.25 s
            lim.allow(k, t)
        for _ in range(10):
            fresh += 1
            d = lim.allow(f"fresh{fresh}", t)
            if d.allowed:
                admitted += 1
            elif getattr(d, "unavailable", False) and _reclaimable(lim, t):
                refused_with_room += 1
        for _ in range(8):                     # the limited client asks for more than its rate, always
            assert lim.allow("limited", t) == alone.allow("limited", t), tick
    # (the windowed algorithms keep a key used once live until its window ends: then the table is full
    # of live states for a while, and those refusals are the rule)
    assert refused_with_room == 0, (refused_with_room, lim.full)
    assert len(lim) <= 200 and admitted > 0, (admitted, fresh, lim.full)


def test_when_every_state_is_live_the_new_key_is_refused_with_503_until_the_soonest_expiry(caplog):
    """Only states that would decide differently from a fresh key: the newcomer is refused (503), the
    limited client keeps its state, Retry-After is the wait until the soonest state expires, and one
    log line says so (not one per request)."""
    import logging
    from limiter import build
    caplog.set_level(logging.WARNING, logger="edge")
    lim = build("fixed-window", 3, 10.0, max_keys=50)
    for i in range(50):
        for _ in range(3):
            lim.allow(f"k{i}", 102.0)           # window [100, 110): every key limited until 110
    for j in range(500):
        d = lim.allow(f"new{j}", 105.0)
        assert not d.allowed and d.unavailable and d.retry_after == 5.0, d
    assert not lim.allow("k7", 105.0).allowed   # still limited: nothing was reset
    assert lim.full == 500
    lines = [r.getMessage() for r in caplog.records if "key table full" in r.getMessage()]
    assert len(lines) == 1 and "max_keys = 50" in lines[0], lines
    assert lim.allow("new-later", 110.0).allowed   # from the soonest expiry on, room again
