#!/usr/bin/env python3
"""The Redis store, measured in one run against one redis-server it starts itself:

  1. µs per decision, single-threaded: our RedisStore (each algorithm) vs the `limits` library's
     RedisStorage + strategies (moving-window, fixed-window, sliding-window-counter) -- `hit()` alone,
     and `hit()` + `get_window_stats()` (what it takes to fill X-RateLimit-Remaining/Reset, which our
     single call returns); plus PING and the memory store for scale.
  2. The edge's latency p50/p99 with the memory store vs the Redis store, at a fixed rate, against the
     backend directly (so the added latency is the difference).  A paced client on one keep-alive
     connection with http.client (wrk.loadgen, the constant-rate generator, is not on this branch).
  3. Accuracy: two edges, one client alternating at 2x the limit (the same measurement as
     tests/acceptance/test_m7_distributed_counters.py): admitted rate with local counters vs with Redis.

    python3 bench/redis_bench.py [--calls 5000] [--rate 200] [--seconds 10] [--no-edge]
    python3 bench/redis_bench.py --commandstats    # only: server-side µs per call (INFO commandstats)
    python3 bench/redis_bench.py --abuse           # only: script calls per admitted request at 10x the limit
    python3 bench/redis_bench.py --topologies      # only: µs per decision on one Redis, through Sentinel
                                                   # and on a 3-master Cluster, ours vs limits' storages

Prints markdown tables (docs/redis.md records one run).
"""

from __future__ import annotations

import argparse
import http.client
import math
import platform
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from limiter import build  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.support import Backend, Edge, request  # noqa: E402

ALGORITHMS = ["token-bucket", "fixed-window", "sliding-log", "sliding-counter"]


def measure(paths, calls: int, rounds: int = 5) -> list[tuple[str, float]]:
    """µs per call for each (name, fn(i)); the paths take turns, round after round, and the best round
    counts -- on a shared machine the minimum is the least disturbed, and taking turns keeps a burst of
    background load from landing on one path only."""
    for _, fn in paths:
        for i in range(200):  # warm up: connections, script cache
            fn(i)
    best = {name: math.inf for name, _ in paths}
    for _ in range(rounds):
        for name, fn in paths:
            t = time.perf_counter()
            for i in range(calls):
                fn(i)
            best[name] = min(best[name], (time.perf_counter() - t) / calls * 1e6)
    return [(name, best[name]) for name, _ in paths]


def decisions(url: str, calls: int, unix_url: str | None = None) -> list[tuple[str, float]]:
    import redis
    from limits import RateLimitItemPerSecond
    from limits.storage import RedisStorage
    from limits.strategies import (FixedWindowRateLimiter, MovingWindowRateLimiter,
                                   SlidingWindowCounterRateLimiter)

    paths = []
    r = redis.Redis.from_url(url)
    paths.append(("redis-py PING (one round trip, for scale)", lambda i: r.ping()))
    keys = [f"client-{i}" for i in range(100)]
    for a in ALGORITHMS:
        lim = build(a, 100, 1.0)
        paths.append((f"ours, memory store, {a}", lambda i, lim=lim: lim.allow(keys[i % 100], time.time())))
    ours = []
    for a in ALGORITHMS:
        # deny_cache=0: every call a round trip (at 100/s per key some would be denials answered locally)
        lim = build(a, 100, 1.0, store=url, prefix=f"bench:{uuid.uuid4().hex[:6]}:", timeout=1.0, deny_cache=0)
        ours.append(lim)
        paths.append((f"ours, RedisStore, {a} (full Decision)",
                      lambda i, lim=lim: lim.allow(keys[i % 100], time.time())))
    if unix_url:
        for a in ALGORITHMS:
            lim = build(a, 100, 1.0, store=unix_url, prefix=f"bench:{uuid.uuid4().hex[:6]}:", timeout=1.0,
                        deny_cache=0)
            paths.append((f"ours, RedisStore over the unix socket, {a}",
                          lambda i, lim=lim: lim.allow(keys[i % 100], time.time())))
    item = RateLimitItemPerSecond(100)
    st = RedisStorage(url)
    for name, cls in (("moving-window", MovingWindowRateLimiter), ("fixed-window", FixedWindowRateLimiter),
                      ("sliding-window-counter", SlidingWindowCounterRateLimiter)):
        s = cls(st)
        ns = uuid.uuid4().hex[:6]
        paths.append((f"limits {name}: hit()", lambda i, s=s, ns=ns: s.hit(item, ns, keys[i % 100])))
        paths.append((f"limits {name}: hit() + get_window_stats()",
                      lambda i, s=s, ns=ns + "s": (s.hit(item, ns, keys[i % 100]),
                                                   s.get_window_stats(item, ns, keys[i % 100]))))
    rows = measure(paths, calls)
    assert all(lim.degraded == 0 and lim.drift == 0 for lim in ours), "a Redis call failed or drifted"
    return rows


def commandstats(url: str, calls: int = 20000) -> list[tuple[str, float, str]]:
    """Server-side cost per call of each path, alone on the server: CONFIG RESETSTAT, `calls` calls, then
    INFO commandstats.  A script's EVALSHA time includes the commands it runs (which are also listed)."""
    import redis
    from limits import RateLimitItemPerSecond
    from limits.storage import RedisStorage
    from limits.strategies import (FixedWindowRateLimiter, MovingWindowRateLimiter,
                                   SlidingWindowCounterRateLimiter)

    r = redis.Redis.from_url(url)
    keys = [f"client-{i}" for i in range(100)]
    paths = []
    for a in ALGORITHMS:
        lim = build(a, 100, 1.0, store=url, prefix=f"cs:{uuid.uuid4().hex[:6]}:", timeout=1.0)
        paths.append((f"ours, {a}: allow()", lambda i, lim=lim: lim.allow(keys[i % 100], time.time())))
    item = RateLimitItemPerSecond(100)
    st = RedisStorage(url)
    for name, cls in (("moving-window", MovingWindowRateLimiter), ("fixed-window", FixedWindowRateLimiter),
                      ("sliding-window-counter", SlidingWindowCounterRateLimiter)):
        s, ns = cls(st), uuid.uuid4().hex[:6]
        paths.append((f"limits {name}: hit()", lambda i, s=s, ns=ns: s.hit(item, ns, keys[i % 100])))
        paths.append((f"limits {name}: get_window_stats()",
                      lambda i, s=s, ns=ns: s.get_window_stats(item, ns, keys[i % 100])))
    rows = []
    for name, fn in paths:
        for i in range(200):
            fn(i)
        r.config_resetstat()
        for i in range(calls):
            fn(i)
        stats = {k[len("cmdstat_"):]: v for k, v in r.info("commandstats").items()
                 if k not in ("cmdstat_config|resetstat", "cmdstat_info")}
        top = stats.get("evalsha", {}).get("usec", 0) or sum(v["usec"] for v in stats.values())
        rows.append((name, top / calls, ", ".join(f"{k} {v['calls'] / calls:g}x {v['usec_per_call']:.1f}"
                                                   for k, v in sorted(stats.items()))))
    return rows


def topologies(calls: int) -> list[tuple[str, float]]:
    """µs per decision on one Redis, a Sentinel-watched master and a 3-master cluster (all started here),
    ours vs `limits`' RedisStorage / RedisSentinelStorage / RedisClusterStorage, interleaved rounds."""
    from limits import RateLimitItemPerSecond
    from limits.storage import storage_from_string
    from limits.strategies import FixedWindowRateLimiter, MovingWindowRateLimiter

    from tests.redis_topologies import Cluster, SentinelSet
    single = RedisServer().start()
    sentinels = SentinelSet()
    cluster = Cluster(masters=3, replicas=0)
    try:
        host_list = lambda url: url.split("://", 1)[1]  # noqa: E731
        targets = [
            ("one Redis", single.url, single.url),
            ("Sentinel", sentinels.url, "redis+sentinel://" + host_list(sentinels.url)),
            ("Cluster (3 masters)", cluster.url, "redis+cluster://" + host_list(cluster.url)),
        ]
        keys = [f"client-{i}" for i in range(100)]  # spread over the cluster's three masters
        item = RateLimitItemPerSecond(100)
        paths, ours = [], []
        for where, url, limits_url in targets:
            for a in ("token-bucket", "fixed-window", "sliding-log"):
                lim = build(a, 100, 1.0, store=url, prefix=f"topo:{uuid.uuid4().hex[:6]}:", timeout=1.0)
                ours.append(lim)
                paths.append((f"{where}: ours, {a} (full Decision)",
                              lambda i, lim=lim: lim.allow(keys[i % 100], time.time())))
            st = storage_from_string(limits_url)
            for name, cls in (("fixed-window", FixedWindowRateLimiter), ("moving-window", MovingWindowRateLimiter)):
                s, ns = cls(st), uuid.uuid4().hex[:6]
                paths.append((f"{where}: limits {name}: hit()", lambda i, s=s, ns=ns: s.hit(item, ns, keys[i % 100])))
                paths.append((f"{where}: limits {name}: hit() + get_window_stats()",
                              lambda i, s=s, ns=ns + "s": (s.hit(item, ns, keys[i % 100]),
                                                           s.get_window_stats(item, ns, keys[i % 100]))))
        rows = measure(paths, calls)
        assert all(lim.degraded == 0 and lim.drift == 0 for lim in ours), "a Redis call failed or drifted"
        return rows
    finally:
        cluster.stop()
        sentinels.stop()
        single.stop()


def paced(port: int, rate: float, seconds: float, key: str) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    lat = []
    start = time.monotonic()
    n = int(rate * seconds)
    for i in range(n):
        pause = start + i / rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        t = time.perf_counter()
        r = request(port, "GET", "/", {"X-Api-Key": key}, conn=conn)
        lat.append(time.perf_counter() - t)
        assert r.status == 200, r
    conn.close()
    return lat


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def edge_latency(url: str, backend: Backend, rate: float, seconds: float):
    common = ["--backends", backend.url, "--limit", "100000/s"]
    mem = Edge(*common, name="bench-edge-memory")
    red = Edge(*common, "--store", url, name="bench-edge-redis")
    try:
        out = {}
        for name, port in (("backend directly", backend.port), ("edge, memory store", mem.port),
                           ("edge, Redis store", red.port)):
            paced(port, rate, 1.0, "warm")
            out[name] = paced(port, rate, seconds, f"bench-{uuid.uuid4().hex[:6]}")
        return out
    finally:
        mem.stop()
        red.stop()


def accuracy(url: str, backend: Backend):
    from tests.test_edge_redis import admitted_per_second, paced_alternating
    limit = 50
    common = ["--backends", backend.url, "--limit", f"{limit}/s", "--algorithm", "fixed-window"]
    mem = [Edge(*common, name=f"bench-mem-{i}") for i in "ab"]
    red = [Edge(*common, "--store", url, "--redis-timeout", "1.0", name=f"bench-redis-{i}") for i in "ab"]
    res = {}
    try:
        key = f"acc-{uuid.uuid4().hex[:6]}"
        ts = [threading.Thread(target=lambda n=n, es=es: res.__setitem__(
            n, paced_alternating([e.port for e in es], key, 2 * limit, 12.5))) for n, es in (("memory", mem),
                                                                                          ("redis", red))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        for e in mem + red:
            e.stop()
    t0 = math.ceil(min(s[0][0] for s in res.values())) + 1.0
    return limit, {n: admitted_per_second(s, t0, t0 + 10.0) for n, s in res.items()}


def abuse(url: str, factor: float = 10.0, limit: int = 100, window: float = 1.0, seconds: float = 20.0,
          edges: int = 1):
    """Script calls per admitted request for one client at `factor` x its limit, with and without the
    denial cache: `seconds` of simulated time (injected instants, evenly spaced), EVALSHA calls counted by
    the server (INFO commandstats), so the figure is what Redis actually executed.  edges > 1: that many
    stores on one prefix (edges, each with its own cache), the client's requests taking turns."""
    import redis
    r = redis.Redis.from_url(url)
    rows = []
    for a in ALGORITHMS:
        for cache in (10_000, 0):
            prefix = f"abuse:{uuid.uuid4().hex[:6]}:"
            lims = [build(a, limit, window, store=url, prefix=prefix, timeout=1.0, deny_cache=cache)
                    for _ in range(edges)]
            rate = factor * limit / window
            n = int(seconds * rate)
            t0 = 1_000_000.0
            lims[0].allow("warm-up", t0)
            r.config_resetstat()
            admitted = sum(lims[i % edges].allow("abuser", t0 + i / rate).allowed for i in range(n))
            calls = int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
            rows.append((a, "on" if cache else "off", n, admitted, calls, sum(x.answered_locally for x in lims)))
    return rows


def concurrency(url: str, callers=(1, 8, 32, 128), flights=(0, 1, 2, 4), seconds: float = 2.0, rounds: int = 2):
    """Decisions/s and per-call p99 with N threads calling allow() at once (distinct keys, all admitted,
    no denial cache), batching off (flights 0: every call its own round trip on a pooled connection,
    as before) vs on; configurations interleaved, `rounds` times, the best round counts."""
    from limiter.redis.batch import Batcher
    lim = build("token-bucket", 10**9, 1.0, store=url, prefix=f"conc:{uuid.uuid4().hex[:6]}:", timeout=1.0,
                deny_cache=0)
    link = lim.link
    best: dict = {}
    for _ in range(rounds):
        for n in callers:
            for f in flights:
                link.batcher = Batcher(link._flight, f) if f else None
                stop = time.perf_counter() + seconds
                lat: list[list[float]] = [[] for _ in range(n)]
                go = threading.Barrier(n)

                def run(mine, i):
                    key = f"c{i}"
                    go.wait()
                    pc = time.perf_counter
                    while True:
                        t = pc()
                        if t >= stop:
                            return
                        lim.allow(key, time.time())
                        mine.append(pc() - t)

                ts = [threading.Thread(target=run, args=(lat[i], i)) for i in range(n)]
                t0 = time.perf_counter()
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                took = time.perf_counter() - t0
                xs = sorted(x for m in lat for x in m)
                b = link.batcher
                row = (len(xs) / took, pct(xs, 50) * 1e3, pct(xs, 99) * 1e3, b.calls / b.trips if b and b.trips else 1.0)
                if (n, f) not in best or row[0] > best[(n, f)][0]:
                    best[(n, f)] = row
    link.batcher = Batcher(link._flight, 2)
    return [(n, f, *best[(n, f)]) for n in callers for f in flights]


def saturation(url: str, seconds: float = 5.0, rounds: int = 3, flights=(0, 2), before: str | None = None):
    """The edge's own saturation throughput (closed loop, bench.edge_bench.closed_loop: wrk -t1 -c32 when
    installed, else wrk.loadgen -R0) with the memory store vs the Redis store with and without batching,
    one edge each, rounds interleaved; nginx as the backend; every request admitted (limit 10M/s)."""
    import contextlib
    import os
    from bench.edge_bench import closed_loop
    from wrk.nginx_target import nginx_target
    rows: dict = {}
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(nginx_target())
        backend = f"http://127.0.0.1:{port}"
        common = ["--backends", backend, "--health-interval", "30", "--limit", "10000000/s"]
        edges = {"memory store": Edge(*common, name="sat-mem")}
        for f in flights:
            edges[f"Redis store, batching {f'on ({f} flights)' if f else 'off'}"] = Edge(
                *common, "--store", url, "--redis-timeout", "1", name=f"sat-{f}",
                env={**os.environ, "EDGE_REDIS_FLIGHTS": str(f)})
        if before:   # the same Redis edge from another checkout (git archive REV | tar -x -C DIR)
            edges[f"Redis store, batching on, {before}"] = Edge(
                *common, "--store", url, "--redis-timeout", "1", name="sat-before", cwd=before)
        for e in edges.values():
            stack.callback(e.stop)
        for _ in range(rounds):
            for name, e in edges.items():
                rows.setdefault(name, []).append(closed_loop(f"http://127.0.0.1:{e.port}/", e.popen.pid, seconds, 32))
    return rows


def skew(url: str, skews=(0.0, 0.001, 0.01, 0.1, 0.5), limit: int = 100, window: float = 1.0,
         seconds: float = 20.0):
    """What clock skew between two edges on one Redis costs: one client alternating between edge A and
    edge B (B's clock `skew` ahead) at 2x the limit, instants injected (true time t; A passes t, B t+skew).
    Reported per algorithm: the most requests admitted in any window of true time (the limit is the
    promise) and the admitted rate over the run."""
    import bisect
    rows = []
    rate = 2 * limit / window
    n = int(seconds * rate)
    for a in ALGORITHMS:
        for d in skews:
            prefix = f"skew:{uuid.uuid4().hex[:6]}:"
            edges = [build(a, limit, window, store=url, prefix=prefix, timeout=1.0) for _ in range(2)]
            t0 = 2_000_000.0
            admitted = []
            for i in range(n):
                t = t0 + i / rate
                if edges[i % 2].allow("client", t + (d if i % 2 else 0.0)).allowed:
                    admitted.append(t)
            worst = max(bisect.bisect_left(admitted, x + window) - j for j, x in enumerate(admitted))
            rows.append((a, d, worst, len(admitted) / seconds))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--no-edge", action="store_true", help="only the per-decision table")
    ap.add_argument("--commandstats", action="store_true", help="only the server-side µs per call")
    ap.add_argument("--abuse", action="store_true", help="only: script calls per admitted request at 10x")
    ap.add_argument("--edges", type=int, default=1, help="--abuse: edges (stores) the client alternates between")
    ap.add_argument("--topologies", action="store_true", help="only: one Redis vs Sentinel vs Cluster")
    ap.add_argument("--saturation", action="store_true", help="only: the edge at saturation, memory vs Redis")
    ap.add_argument("--rounds", type=int, default=3, help="--saturation: interleaved rounds")
    ap.add_argument("--before", help="--saturation: also an edge from this checkout (the code before a change)")
    ap.add_argument("--skew", action="store_true", help="only: what clock skew between two edges costs")
    ap.add_argument("--concurrency", action="store_true", help="only: decisions/s and p99 at 1-128 callers, "
                    "batching off vs on (TCP and unix socket)")
    args = ap.parse_args()
    if args.topologies:
        import redis
        print(f"# {platform.python_implementation()} {platform.python_version()}, redis-py {redis.__version__}, "
              f"{platform.machine()}, {__import__('os').cpu_count()} CPUs\n")
        print(f"## µs per decision by topology, single thread, {args.calls} calls per round, best of 5 "
              f"interleaved rounds, 100 keys\n")
        print("| path | µs/decision |\n|---|---:|")
        for name, us in topologies(args.calls):
            print(f"| {name} | {us:.1f} |")
        return
    server = RedisServer().start()
    try:
        import redis
        if args.skew:
            print("## Clock skew between two edges on one Redis: one client alternating at 2x the limit "
                  "(100 per 1 s), 20 s, instants injected\n")
            print("| algorithm | edge B's clock ahead by | most admitted in any 1 s of true time | admitted/s |"
                  "\n|---|---:|---:|---:|")
            for a, d, worst, per in skew(server.url):
                print(f"| {a} | {d * 1000:g} ms | {worst} | {per:.1f} |")
            return
        if args.saturation:
            rows = saturation(server.url, seconds=args.seconds, rounds=args.rounds, before=args.before)
            mem = sum(r for r, _ in rows["memory store"]) / len(rows["memory store"])
            print("## The edge at saturation (closed loop, 32 connections, one key, every request admitted)\n")
            print("| store | req/s, each round | mean | vs memory | edge CPU µs/request |\n|---|---|---:|---:|---:|")
            for name, xs in rows.items():
                m = sum(r for r, _ in xs) / len(xs)
                cpu = sum(c for _, c in xs) / len(xs) * 1000
                print(f"| {name} | {' / '.join(f'{r:,.0f}' for r, _ in xs)} | {m:,.0f} | {m / mem:.2f}x | {cpu:.0f} |")
            return
        if args.concurrency:
            for label, url in (("TCP", server.url), ("unix socket", server.unix_url)):
                print(f"\n## {label}: N threads calling allow() at once, 2 s per row, best of 2 interleaved rounds"
                      f"\n")
                print("| callers | batching (flights) | decisions/s | p50 ms | p99 ms | calls per round trip |"
                      "\n|---:|---|---:|---:|---:|---:|")
                for n, f, rate, p50, p99, per in concurrency(url):
                    print(f"| {n} | {'off' if not f else f'on ({f})'} | {rate:,.0f} | {p50:.3f} | {p99:.3f} | "
                          f"{per:.1f} |")
            return
        if args.abuse:
            print(f"## One client at 10x its limit (100/s), 20 s of injected instants, {args.edges} edge(s) taking "
                  "turns: script calls that reached Redis (INFO commandstats)\n")
            print("| algorithm | denial cache | requests | admitted | EVALSHA calls | calls per admitted | "
                  "answered locally |\n|---|---|---:|---:|---:|---:|---:|")
            for a, cache, n, admitted, calls, local in abuse(server.url, edges=args.edges):
                print(f"| {a} | {cache} | {n} | {admitted} | {calls} | {calls / admitted:.2f} | {local} |")
            return
        if args.commandstats:
            print("| path | server µs per call | commands per call, µs each |\n|---|---:|---|")
            for name, us, detail in commandstats(server.url):
                print(f"| {name} | {us:.1f} | {detail} |")
            return
        print(f"# {platform.python_implementation()} {platform.python_version()}, redis-py {redis.__version__}, "
              f"redis-server {redis.Redis.from_url(server.url).info()['redis_version']}, "
              f"{platform.machine()}, {__import__('os').cpu_count()} CPUs\n")
        print(f"## µs per decision, single thread, {args.calls} calls per round, best of 5 interleaved rounds, "
              f"100 keys\n")
        print("| path | µs/decision |\n|---|---:|")
        for name, us in decisions(server.url, args.calls, server.unix_url):
            print(f"| {name} | {us:.1f} |")
        if args.no_edge:
            return
        backend = Backend("bench")
        try:
            lat = edge_latency(server.url, backend, args.rate, args.seconds)
            print(f"\n## Latency at {args.rate:g} req/s for {args.seconds:g} s, one keep-alive connection "
                  f"(paced http.client loop), every request admitted\n")
            print("| target | p50 ms | p99 ms | added p50 ms | added p99 ms |\n|---|---:|---:|---:|---:|")
            base = lat["backend directly"]
            for name, xs in lat.items():
                print(f"| {name} | {pct(xs, 50) * 1e3:.3f} | {pct(xs, 99) * 1e3:.3f} | "
                      f"{(pct(xs, 50) - pct(base, 50)) * 1e3:.3f} | {(pct(xs, 99) - pct(base, 99)) * 1e3:.3f} |")
            limit, rates = accuracy(server.url, backend)
            print(f"\n## Accuracy: two edges, one client alternating at {2 * limit} req/s, limit {limit}/s "
                  f"(fixed-window), 10 whole 1-s windows after the first\n")
            print("| store | admitted/s | vs limit |\n|---|---:|---:|")
            for n in ("memory", "redis"):
                print(f"| {n} | {rates[n]:.1f} | {rates[n] / limit:.3f}x |")
        finally:
            backend.stop()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
