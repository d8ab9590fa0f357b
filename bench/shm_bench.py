#!/usr/bin/env python3
"""The shared-memory store (limiter.shm, what --workers N uses with the memory store) against the
per-process memory store: µs per decision in one process, the paths taking turns, best of 5 rounds.

    python3 bench/shm_bench.py [--calls 50000]
    python3 bench/shm_bench.py --fill      # only: how full the table is when it first refuses a new key

Also: 2 forked processes deciding at once on one arena (the workers' case), decisions/s in total.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from limiter import build, shm  # noqa: E402

ALGORITHMS = ["token-bucket", "fixed-window", "sliding-log", "sliding-counter"]


def per_decision(calls: int):
    arena = shm.Arena(100_000, shm.state_size(build("sliding-log", 100, 1.0).algorithm), 64)
    paths = []
    keys = [f"client-{i}" for i in range(1000)]
    for a in ALGORITHMS:
        for store in ("memory", "shm"):
            lim = build(a, 100, 1.0, store=store, **({"shm_arena": arena} if store == "shm" else {}))
            paths.append(((a, store), lambda i, lim=lim: lim.allow(keys[i % 1000], 1000.0 + i * 1e-5)))
    best = {name: math.inf for name, _ in paths}
    for _ in range(5):
        for name, fn in paths:
            t = time.perf_counter()
            for i in range(calls):
                fn(i)
            best[name] = min(best[name], (time.perf_counter() - t) / calls * 1e6)
    return best, arena


def two_processes(arena, calls: int) -> float:
    lim = build("token-bucket", 10**9, 1.0, store="shm", shm_arena=arena)
    start = time.time() + 0.3
    pids = []
    for p in range(2):
        pid = os.fork()
        if pid == 0:
            while time.time() < start:
                time.sleep(0.001)
            for i in range(calls):
                lim.allow(f"p{p}-{i % 1000}", 2000.0 + i * 1e-5)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    return 2 * calls / (time.time() - start)


def fill(slots: int) -> tuple[float, float]:
    """Distinct live keys into an arena of `slots`: (% full at the first refusal, % full after `slots`
    more attempts)."""
    import logging
    logging.getLogger("edge").disabled = True   # the "table full" line, once per table
    arena = shm.Arena(slots, 24)
    lim = build("fixed-window", 5, 60.0, store="shm", shm_arena=arena)
    i = 0
    while lim.allow(f"k{i}", 100.0).allowed:
        i += 1
    held = i + sum(lim.allow(f"j{j}", 100.0).allowed for j in range(slots))
    return 100 * i / arena.slots, 100 * held / arena.slots


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=50_000)
    ap.add_argument("--fill", action="store_true", help="only: how full a table is at its first refusal")
    args = ap.parse_args()
    if args.fill:
        print("| slots | full at the first refusal of a new key | full after as many attempts again |\n|---:|---:|---:|")
        for slots in (10_000, 100_000):
            first, last = fill(slots)
            print(f"| {slots:,} | {first:.1f}% | {last:.1f}% |")
        return
    best, arena = per_decision(args.calls)
    print(f"## µs per decision, one thread, 1,000 keys, {args.calls} calls per round, best of 5\n")
    print("| algorithm | memory store | shared-memory store | ratio |\n|---|---:|---:|---:|")
    for a in ALGORITHMS:
        m, s = best[(a, "memory")], best[(a, "shm")]
        print(f"| {a} | {m:.2f} | {s:.2f} | {s / m:.2f}x |")
    rate = two_processes(arena, args.calls)
    print(f"\n2 forked processes on one arena (token-bucket, 1,000 keys each): {rate:,.0f} decisions/s in total "
          f"({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
