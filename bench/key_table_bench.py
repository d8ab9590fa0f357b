#!/usr/bin/env python3
"""The memory store's key table: µs per new key, per known key, and per refusal at a full table.

    python3 bench/key_table_bench.py [--checkout DIR ...]    # DIR: another checkout to compare (A/B)

token-bucket 5/s, injected instant: 100,000 new keys into a table with room, then the same 100,000
again (known keys), then 50,000 new keys at a full 10,000-key table of live states (each refused);
best of 5.  And the sliding log's decision on one key (limit 100 per 1 s), at 10x the limit and with
every request admitted, 100,000 decisions.  Each checkout runs in its own process, the checkouts
alternating twice.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ONE = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from limiter import build
best = [1e9, 1e9, 1e9]
for _ in range(5):
    lim = build("token-bucket", 5, 1.0, max_keys=1_000_000)
    t = time.perf_counter()
    for i in range(100_000): lim.allow(i, 1000.0)
    best[0] = min(best[0], (time.perf_counter() - t) / 100_000)
    t = time.perf_counter()
    for i in range(100_000): lim.allow(i, 1000.0)
    best[1] = min(best[1], (time.perf_counter() - t) / 100_000)
    full = build("token-bucket", 5, 1.0, max_keys=10_000)
    for i in range(10_000): full.allow(i, 1000.0)
    t = time.perf_counter()
    for i in range(10_000, 60_000): full.allow(i, 1000.0)
    best[2] = min(best[2], (time.perf_counter() - t) / 50_000)
log = {}
for _ in range(5):
    for name, rate in (("10x", 1000.0), ("admitted", 50.0)):   # limit 100 per 1 s, one key
        lim = build("sliding-log", 100, 1.0)
        t = time.perf_counter()
        for i in range(100_000): lim.allow("k", 1000.0 + i / rate)
        log[name] = min(log.get(name, 1e9), (time.perf_counter() - t) / 100_000)
best += [log["10x"], log["admitted"]]
print(" | ".join(f"{x * 1e6:.2f}" for x in best))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", action="append", default=[], help="another checkout to measure too")
    args = ap.parse_args()
    dirs = [str(ROOT), *args.checkout]
    print("| checkout | new key µs | known key µs | refused at a full table µs | sliding log, one key at 10x µs "
          "| sliding log, all admitted µs |\n|---|---:|---:|---:|---:|---:|")
    for _ in range(2):
        for d in dirs:
            out = subprocess.run([sys.executable, "-c", ONE, d], capture_output=True, text=True).stdout.strip()
            print(f"| {d} | {out} |")


if __name__ == "__main__":
    main()
