#!/usr/bin/env python3
"""What limit rules cost per request, measured in one run (the paths take turns; best of 5 rounds):

  1. The rate-limit stage (lb.ratelimit.LimitStage.check on a parsed request), memory store: the
     built-in rule alone, + 1 rule, + 3 rules (one with a path match).
  2. The Redis store (a redis-server this script starts): one request's 3 rules as ONE script call
     (limiter.redis.multi) against the same 3 decisions as 3 separate calls, and 1 rule alone.

    python3 bench/rules_bench.py [--calls 20000] [--redis-calls 3000]

Prints a markdown table (docs/rules.md records one run).
"""

from __future__ import annotations

import argparse
import platform
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.redis_bench import measure  # noqa: E402
from lb.http.framing import parse_request  # noqa: E402
from lb.limiting.stage import LimitStage  # noqa: E402
from lb.limiting.rules import parse_rules  # noqa: E402
from limiter import build  # noqa: E402
from limiter.compose import allow_all  # noqa: E402

HIGH = "100000000/s"      # never binding: every path does the full work of an admitted request
THREE = [{"name": "per-ip", "key": "ip", "limit": HIGH},
         {"name": "tenant", "key": "header:X-Tenant", "limit": HIGH, "algorithm": "sliding-counter"},
         {"name": "api", "key": "global", "limit": HIGH, "match": {"path_prefix": "/api/", "methods": ["GET"]}}]


def stage_paths(calls: int):
    req = parse_request(b"GET /api/v1/items?page=2 HTTP/1.1\r\nHost: api.example.com\r\n"
                        b"X-Api-Key: k-1234567890\r\nX-Tenant: acme")
    stages = {"built-in rule only": LimitStage(HIGH),
              "+ 1 rule (ip)": LimitStage(HIGH, rules=parse_rules(THREE[:1])),
              "+ 3 rules (ip, header, global on a path)": LimitStage(HIGH, rules=parse_rules(THREE))}
    return [(name, lambda i, st=st: st.check(req, "203.0.113.9", now=1000.0 + i * 1e-6))
            for name, st in stages.items()]


def redis_paths(url: str):
    tag = uuid.uuid4().hex[:8]
    lims = [build(a, 10 ** 8, 1.0, store=url, prefix=f"bench:{tag}:{a}:", timeout=1.0)
            for a in ("token-bucket", "sliding-counter", "fixed-window")]
    checks = [(lim, f"k{n}", True) for n, lim in enumerate(lims)]

    def one_script(i):
        ok, _ = allow_all(checks, 1000.0 + i * 1e-6)
        assert ok

    def three_calls(i):
        for lim, key, _ in checks:
            assert lim.allow(key, 1000.0 + i * 1e-6).allowed

    def one_rule(i):
        assert lims[0].allow("k0", 1000.0 + i * 1e-6).allowed

    return [("3 rules, one script call (redis_multi)", one_script), ("3 rules, 3 calls", three_calls),
            ("1 rule, 1 call", one_rule)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--redis-calls", type=int, default=3000)
    ap.add_argument("--no-redis", action="store_true")
    args = ap.parse_args()
    print(f"Python {platform.python_version()}, {platform.machine()}; shared 2-core VM (noisy: compare rows "
          f"of one run only)\n")
    print("| rate-limit stage, memory store | µs per request |\n|---|---:|")
    rows = measure(stage_paths(args.calls), args.calls)
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")
    if args.no_redis:
        return
    from tests.redis_server import RedisServer
    server = RedisServer().start()
    try:
        print("\n| Redis store (one redis-server on 127.0.0.1) | µs per request |\n|---|---:|")
        rows = measure(redis_paths(server.url), args.redis_calls)
        for name, us in rows:
            print(f"| {name} | {us:.1f} |")
        base = dict(rows)
        print(f"\n3 separate calls / one script: {base['3 rules, 3 calls'] / base['3 rules, one script call (redis_multi)']:.2f}x")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
