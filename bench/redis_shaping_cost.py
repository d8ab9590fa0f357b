#!/usr/bin/env python3
"""Cost and delay mode on Redis, per decision: the shaped scripts (limiter/redis/shaping.py) against the
base ones, one key at 2x its limit (100/s) so admissions, held requests and denials alternate; client
µs per call and the server's µs per EVALSHA (INFO commandstats).  Starts its own redis-server.

    python3 bench/redis_shaping_cost.py [--calls 20000]
"""

import argparse
import os
import socket
import subprocess
import sys
import time

import redis

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from limiter import build  # noqa: E402

CASES = [("sliding-counter", 1, 0.0), ("sliding-counter", 2, 0.0), ("sliding-counter", 2, 0.5),
         ("sliding-log", 1, 0.0), ("sliding-log", 2, 0.0), ("sliding-log", 2, 0.5),
         ("token-bucket", 2, 0.5), ("fixed-window", 2, 0.5)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        print("| algorithm | cost | max_delay | client µs/call | server µs/EVALSHA |\n|---|---|---|---|---|")
        for alg, cost, d in CASES:
            lim = build(alg, limit=100, window=1.0, cost=cost, max_delay=d, store=f"redis://127.0.0.1:{port}/0",
                        prefix=f"bench:{alg}:{cost}:{d}:", timeout=2.0, deny_cache=0)
            lim.allow("warm-up", 1.0)
            r.config_resetstat()
            t = 5000.0
            t0 = time.perf_counter()
            for _ in range(args.calls):
                t += 1.0 / 200
                lim.allow("k", t)
            el = time.perf_counter() - t0
            st = r.info("commandstats").get("cmdstat_evalsha", {})
            print(f"| {alg} | {cost} | {d} | {el / args.calls * 1e6:.1f} | {st.get('usec_per_call')} |")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
