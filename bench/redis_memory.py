#!/usr/bin/env python3
"""Bytes of Redis memory per limiter key, per algorithm: how to size maxmemory (docs/redis.md, "Memory").

    python3 bench/redis_memory.py [--keys 2000]

Starts its own redis-server (tests/redis_server.py), makes `--keys` keys per row with a real RedisStore
(limit 100 per 60 s, so nothing expires during the run; each key receiving the given number of
admitted decisions), and reports per key: `MEMORY USAGE key SAMPLES 0` (the value, the key name and
Redis' per-key overhead, as Redis accounts them) and the growth of INFO used_memory divided by the keys
(adds the main dictionary's and the expires dictionary's slots: what maxmemory actually counts).
The key names are the edge's: `edge:rule:<rule>:<algorithm>:100/60.0:{<client>}` with a 15-byte
client key (an IPv4 address); longer client keys (API keys) cost their extra bytes.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from limiter import build  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

ROWS = [("token-bucket", 1), ("token-bucket", 50), ("fixed-window", 1), ("sliding-counter", 1),
        ("sliding-counter", 50), ("sliding-log", 1), ("sliding-log", 10), ("sliding-log", 100)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=2000)
    args = ap.parse_args()
    server = RedisServer().start()
    try:
        r = server.client()
        print(f"redis-server {r.info()['redis_version']}, {args.keys} keys per row, limit 100 per 60 s\n")
        print("| algorithm | admitted per key | MEMORY USAGE bytes/key | used_memory growth bytes/key |\n"
              "|---|---:|---:|---:|")
        for algorithm, decisions in ROWS:
            prefix = f"edge:rule:r{uuid.uuid4().hex[:4]}:{algorithm}:100/60.0:"
            lim = build(algorithm, 100, 60.0, store=server.url, prefix=prefix, timeout=2.0, deny_cache=0)
            r.flushall()
            before = r.info("memory")["used_memory"]
            t = 1_000_000.0
            for i in range(args.keys):
                key = f"198.51.{i // 250 % 250:03d}.{i % 250:03d}"[:15].ljust(15, "0")
                for j in range(decisions):
                    assert lim.allow(key, t + j * 0.001).allowed
            after = r.info("memory")["used_memory"]
            names = r.keys(f"{prefix}*")
            assert len(names) == args.keys, len(names)
            usage = sum(r.memory_usage(k, samples=0) for k in names) / len(names)
            print(f"| {algorithm} | {decisions} | {usage:.0f} | {(after - before) / args.keys:.0f} |")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
