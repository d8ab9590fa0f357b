"""allow() throughput per algorithm, ours vs the `limits` library, plus bytes per key.

    python3 bench/limiter_bench.py                 # default: best of 3 x 0.2 s per cell, about a minute in all
    python3 bench/limiter_bench.py --seconds 1.0   # steadier figures

Scenarios: one hot key and 100,000 keys (visited round-robin), single-threaded and with 8 threads.
Both sides read the wall clock per call (limits reads time.time() inside hit(); ours is passed
time.time()), both use limit 1000 per 1 s: the hot key is mostly rejections, the 100,000 keys are all
admissions.  Peers: limits' MemoryStorage with FixedWindowRateLimiter (fixed-window),
MovingWindowRateLimiter (sliding-log) and SlidingWindowCounterRateLimiter (sliding-counter), hit().
limits has no token bucket.  Run from the repository root.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import threading
import time
import tracemalloc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from limiter import build  # noqa: E402

ALGOS = ["token-bucket", "fixed-window", "sliding-log", "sliding-counter"]
LIMIT, WINDOW = 1000, 1.0
MANY = 100_000


def limits_peer(algorithm):
    """(hit, item) for the limits library's equivalent, or None."""
    try:
        from limits import RateLimitItemPerSecond
        from limits.storage import MemoryStorage
        from limits import strategies
    except ImportError:
        return None
    cls = {
        "fixed-window": "FixedWindowRateLimiter",
        "sliding-log": "MovingWindowRateLimiter",
        "sliding-counter": "SlidingWindowCounterRateLimiter",
    }.get(algorithm)
    if cls is None or not hasattr(strategies, cls):
        return None
    return getattr(strategies, cls)(MemoryStorage()).hit, RateLimitItemPerSecond(LIMIT, 1)


def _ours_loop(allow, keys, offset, deadline, out):
    clock = time.time
    n, i, nk = 0, offset % len(keys), len(keys)
    while clock() < deadline:
        for _ in range(500):
            allow(keys[i], clock())
            i += 1
            if i == nk:
                i = 0
        n += 500
    out.append(n)


def _limits_loop(hit, item, keys, offset, deadline, out):
    clock = time.time
    n, i, nk = 0, offset % len(keys), len(keys)
    while clock() < deadline:
        for _ in range(500):
            hit(item, keys[i])
            i += 1
            if i == nk:
                i = 0
        n += 500
    out.append(n)


def measure(loop, args, keys, threads, seconds, rounds=3):
    """Calls per second: the best of `rounds` runs of seconds/rounds each (the machine is shared)."""
    best = 0.0
    for _ in range(rounds):
        out = []
        started = time.perf_counter()
        deadline = time.time() + seconds / rounds
        if threads == 1:
            loop(*args, keys, 0, deadline, out)
        else:
            ts = [
                threading.Thread(target=loop, args=(*args, keys, t * (len(keys) // threads), deadline, out))
                for t in range(threads)
            ]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        best = max(best, sum(out) / (time.perf_counter() - started))
    return best


def stop_peer(peer):
    """limits' MemoryStorage sweeps expired keys on a threading.Timer: stop it so it cannot slow the
    next measurement (it is part of limits' cost while its own cells run)."""
    storage = peer[0].__self__.storage
    storage.timer.cancel()
    if storage.timer.is_alive():
        storage.timer.join()


def throughput(seconds):
    hot = ["hot-key"]
    many = [f"client-{i}" for i in range(MANY)]
    rows = []
    for algo in ALGOS:
        ours = build(algo, LIMIT, WINDOW, max_keys=2 * MANY)
        peer = limits_peer(algo)
        for scenario, keys in (("1 key", hot), ("100k keys", many)):
            cells = {}
            for side, loop, args in (("ours", _ours_loop, (ours.allow,)), ("limits", _limits_loop, peer)):
                if args is None:
                    continue
                if keys is many:  # populate first: the timed part is steady state, not first insertion
                    call = args[0]
                    for k in many:
                        call(k, time.time()) if side == "ours" else call(args[1], k)
                for threads in (1, 8):
                    gc.collect()
                    cells[side, threads] = measure(loop, args, keys, threads, seconds)
                if side == "limits":
                    stop_peer(peer)
            for threads in (1, 8):
                a, b = cells["ours", threads], cells.get(("limits", threads))
                rows.append((algo, scenario, threads, a, b))
                print(f"  {algo:16} {scenario:10} {threads} thr  ours {a:>10,.0f}/s  limits "
                      + (f"{b:>10,.0f}/s" if b else "         -"), file=sys.stderr, flush=True)
        ours.clear()
    return rows


def bytes_per_key(n=10_000):
    """tracemalloc: bytes held per key after each of n keys made `per_key` requests inside one window."""
    all_keys = [f"client-{i}" for i in range(n)]  # allocated before tracing: keys are the caller's memory
    out = []
    cases = [(a, 1) for a in ALGOS] + [("sliding-log", 10), ("sliding-log", 100)]
    for algo, per_key in cases:
        keys = all_keys[: max(1000, len(all_keys) // per_key)]
        n = len(keys)  # keys measured in this case
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        lim = build(algo, max(LIMIT, per_key), 60.0, max_keys=2 * n)
        for r in range(per_key):
            for k in keys:
                lim.allow(k, 1000.0 + r * 0.001)
        ours = (tracemalloc.get_traced_memory()[0] - before) / n
        tracemalloc.stop()
        del lim
        peer_bytes = None
        peer = limits_peer(algo)
        if peer and per_key <= 10:
            del peer
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            hit, item = limits_peer(algo)
            for r in range(per_key):
                for k in keys:
                    hit(item, k)
            peer_bytes = (tracemalloc.get_traced_memory()[0] - before) / n
            tracemalloc.stop()
            stop_peer((hit, item))
            del hit, item
        out.append((algo, per_key, ours, peer_bytes))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=0.6, help="timed seconds per cell, best of 3 thirds (default 0.6)")
    p.add_argument("--no-memory", action="store_true", help="skip the bytes-per-key measurement")
    args = p.parse_args(argv)
    try:
        import limits

        peer_version = limits.__version__
    except ImportError:
        peer_version = "not installed"
    started = time.time()
    print(f"# limiter benchmark: Python {platform.python_version()} on {platform.machine()}, "
          f"{os.cpu_count()} CPUs; limits {peer_version}; limit {LIMIT}/{WINDOW:g}s; {args.seconds:g} s per cell")
    rows = throughput(args.seconds)
    print()
    print("| algorithm | keys | threads | ours allow()/s | limits hit()/s | ours/limits |")
    print("|---|---|---:|---:|---:|---:|")
    for algo, scenario, threads, a, b in rows:
        ratio = f"{a / b:.2f}x" if b else "-"
        print(f"| {algo} | {scenario} | {threads} | {a:,.0f} | {f'{b:,.0f}' if b else '- (none)'} | {ratio} |")
    if not args.no_memory:
        print()
        print("| algorithm | requests per key in the window | ours bytes/key | limits bytes/key |")
        print("|---|---:|---:|---:|")
        for algo, per_key, ours, peer in bytes_per_key():
            print(f"| {algo} | {per_key} | {ours:,.0f} | {f'{peer:,.0f}' if peer else '-'} |")
    print(f"\n(total {time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
