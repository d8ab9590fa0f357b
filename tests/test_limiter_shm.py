"""The shared-memory store (--workers N with the memory store): one limit per key across forked
processes, the same step() functions, bounded, and a worker killed while holding a lock wedges nobody."""

import json
import os
import signal
import threading
import time

import pytest

from limiter import ALGORITHMS, build
from limiter import shm
from limiter.algorithms import SlidingLog, TokenBucket
from limiter.memory import TableFullDecision
from tests.support import wait_until

ALL = sorted(ALGORITHMS)


def _arena(slots=4096, state_bytes=8 * 64 + 8, stripes=16):
    return shm.Arena(slots, state_bytes, stripes)


@pytest.mark.parametrize("algorithm", ALL)
def test_the_shared_store_decides_exactly_like_the_memory_store(algorithm):
    """The same step() on the same instants: identical Decisions, every float (the state's trip
    through bytes is exact: doubles and int64 as they are)."""
    import random
    rng = random.Random(algorithm)
    kw = {"burst": 5} if algorithm == "token-bucket" else {}
    arena = _arena()
    try:
        shared = build(algorithm, 4, 1.0, store="shm", shm_arena=arena, **kw)
        memory = build(algorithm, 4, 1.0, **kw)
        t = 500.0
        for _ in range(3000):
            t += rng.choice([0.0, 0.001, 0.01, 0.1, 0.4])
            key = f"k{rng.randrange(5)}"
            assert shared.allow(key, t) == memory.allow(key, t)
    finally:
        arena.close()


def _fork_hammer(lims, threads, attempts, start):
    """A forked child: `threads` threads x `attempts` on key "hot" for each limiter; writes the counts."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            counts = {}
            for name, lim in lims.items():
                got = []
                go = threading.Barrier(threads)

                def run():
                    go.wait()
                    n = 0
                    for _ in range(attempts):
                        n += lim.allow("hot", 7000.0).allowed
                    got.append(n)

                while time.time() < start:
                    time.sleep(0.001)
                ts = [threading.Thread(target=run) for _ in range(threads)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                counts[name] = sum(got)
            os.write(w, json.dumps(counts).encode())
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def test_three_processes_times_sixteen_threads_on_one_key_admit_exactly_n():
    """3 forked processes x 16 threads x 25 attempts = 1200 per algorithm at one instant: exactly 500."""
    arena = _arena(state_bytes=8 * 500 + 8)
    try:
        lims = {a: build(a, 500, 60.0, store="shm", shm_arena=arena) for a in ALL}
        start = time.time() + 0.5
        kids = [_fork_hammer(lims, 16, 25, start) for _ in range(3)]
        totals = {a: 0 for a in ALL}
        for pid, r in kids:
            data = b""
            while chunk := os.read(r, 65536):
                data += chunk
            os.close(r)
            os.waitpid(pid, 0)
            for a, n in json.loads(data).items():
                totals[a] += n
        assert totals == {a: 500 for a in ALL}
        for a in ALL:
            assert not lims[a].allow("hot", 7000.0).allowed
    finally:
        arena.close()


def test_a_process_killed_while_holding_a_stripe_lock_does_not_wedge_the_others():
    """A child takes the key's locks mid-decision (its clock never returns) and is SIGKILLed: the
    kernel drops its fcntl record lock, and the parent's decision on the same key goes through."""
    arena = _arena()
    try:
        lim = build("fixed-window", 5, 60.0, store="shm", shm_arena=arena)
        assert lim.allow("k", 100.0).allowed
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                def stuck():
                    os.write(w, b"in")  # we hold the key's locks now
                    time.sleep(600)
                    return 100.0
                stuck_lim = build("fixed-window", 5, 60.0, store="shm", shm_arena=arena, clock=stuck)
                stuck_lim.allow("k")
            finally:
                os._exit(0)
        os.close(w)
        assert os.read(r, 2) == b"in"
        done = []
        t = threading.Thread(target=lambda: done.append(lim.allow("k", 100.0)))
        t.start()
        time.sleep(0.2)
        assert not done, "the lock held by the child did not exclude the parent"
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        wait_until(lambda: done, timeout=5, what="the parent's decision after the holder died")
        t.join()
        assert done[0].allowed and done[0].remaining == 3  # the dead child's decision never counted
        os.close(r)
    finally:
        arena.close()


def test_the_table_is_bounded_idle_slots_are_reused_and_live_ones_never_overwritten():
    arena = shm.Arena(256, 24, 4)
    try:
        lim = build("fixed-window", 2, 10.0, store="shm", shm_arena=arena)
        while lim.allow("victim", 1000.0).allowed:
            pass
        refused = sum(type(lim.allow(f"junk{i}", 1000.0)) is TableFullDecision for i in range(2000))
        assert refused > 1000 and lim.full == refused
        assert not lim.allow("victim", 1001.0).allowed  # still limited: its slot was never taken
        # the next window: every junk state is idle, so new keys get slots again
        assert lim.allow("newcomer", 1010.0).allowed and lim.allow("victim", 1010.0).allowed
    finally:
        arena.close()


def test_a_state_bigger_than_the_slots_is_refused_with_a_clear_error():
    arena = shm.Arena(64, shm.state_size(TokenBucket(5, 1.0)), 4)
    try:
        with pytest.raises(ValueError, match="bytes of state per key"):
            shm.ShmStore(SlidingLog(100, 1.0), arena)
    finally:
        arena.close()


@pytest.mark.parametrize("algorithm", ALL)
def test_several_rules_on_the_shared_store_are_all_or_nothing(algorithm):
    """limiter.compose.allow_all on shared-memory stores (several [[rules]] with --workers N): a request
    one limit rejects spends nothing in the others; two new keys in one stripe get two slots."""
    from limiter.compose import allow_all
    arena = shm.Arena(64, 8 * 8 + 8, 1)  # one stripe: every key competes for the same slots
    try:
        a = build(algorithm, 1, 60.0, store="shm", shm_arena=arena, prefix="a")
        b = build(algorithm, 5, 60.0, store="shm", shm_arena=arena, prefix="b")
        t = 60.0 * 40000
        assert allow_all([(a, "k", True), (b, "k", True)], t)[0] is True
        for _ in range(3):
            ok, (da, db) = allow_all([(a, "k", True), (b, "k", True)], t)
            assert (ok, da.allowed, db.allowed) == (False, False, True)
        assert [b.allow("k", t).allowed for _ in range(5)] == [True] * 4 + [False]
        assert not a.allow("k", t).allowed  # a's state survived b's writes in the same stripe
        # dry run: a shadow limit that would reject never vetoes, and spends only when admitted
        ok, (dg, ds) = allow_all([(b, "new", True), (a, "new", False)], t)
        assert ok and dg.allowed and ds.allowed
        ok, (dg, ds) = allow_all([(b, "new", True), (a, "new", False)], t)
        assert ok and dg.allowed and not ds.allowed
    finally:
        arena.close()


def test_a_new_key_is_refused_only_near_a_full_table_and_it_is_logged_once(caplog):
    """Distinct live keys into a 10,000-slot table: the first refusal comes past 60% full (two homes of
    16 slots each; one home refused the first at 45%), the table then fills to over 99%, and the
    refusals make one log line, not one per request."""
    import logging
    from limiter.algorithms import FixedWindow
    from limiter.shm import Arena, ShmStore
    caplog.set_level(logging.WARNING, logger="edge")
    arena = Arena(10_000, 24)
    lim = ShmStore(FixedWindow(5, 60.0), arena)
    i = 0
    while lim.allow(f"k{i}", 100.0).allowed:
        i += 1
    assert i > 0.6 * arena.slots, i
    held = i + sum(lim.allow(f"j{j}", 100.0).allowed for j in range(10_000))
    assert held > 0.99 * arena.slots and lim.full > 1
    assert len([r for r in caplog.records if "key table full" in r.getMessage()]) == 1
    assert lim.allow("k0", 100.0).allowed  # a key already in the table is never refused
