"""The memory store: bounded memory under key rotation, eviction that never changes a decision, striping."""

import random
import threading
import time

import pytest

from limiter import ALGORITHMS, build
from limiter.memory import MemoryStore

ALL = sorted(ALGORITHMS)


def test_a_million_rotating_keys_never_hold_more_than_max_keys():
    """The hard cap: 1,000,000 distinct keys, all live (50 per simulated ms, window 60 s), cap 10,000."""
    cap = 10_000
    lim = build("fixed-window", 100, 60.0, max_keys=cap)
    started = time.perf_counter()
    allow = lim.allow
    peak = 0
    for i in range(1_000_000):
        assert allow(i, 1000.0 + i * 2e-5).allowed  # int keys: the 1e6 strings would be the test's memory
        if i % 50_000 == 0:
            peak = max(peak, len(lim))
    elapsed = time.perf_counter() - started
    print(f"\n[memory] 1,000,000 keys with max_keys={cap}: {len(lim)} held at the end, peak sampled {peak}, {elapsed:.2f} s")
    assert len(lim) <= cap and peak <= cap
    assert len(lim) > cap * 0.9  # the cap is used, not undershot by a wide margin


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
    stripes = lim._stripes
    assert len(stripes) == 64
    a = "alpha"
    b = next(k for k in (f"key{i}" for i in range(1000)) if hash(k) & 63 != hash(a) & 63)
    lock_a = stripes[hash(a) & 63][0]
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
