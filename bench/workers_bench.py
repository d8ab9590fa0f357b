"""Requests per second of the edge with 1 vs 2 worker processes at saturation, and p99 at a fixed
moderate rate, side by side in one run (A B A B, because this 2-core machine is shared and noisy).

    python -m bench.workers_bench [--store auto|redis://127.0.0.1:6379/0] [--seconds 6]

With --store the edge limits every request (a generous limit, so nothing is rejected) through that
Redis: the configuration --workers is for. Without it, the edge runs with no limiter. Saturation is
measured with wrk (closed loop, -t1 -c32) when installed, else wrk.loadgen -R0. The load generator and
nginx share the same two cores as the workers: the ratio shows what two cores give here, not what two
cores give an edge with the machine to itself.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.edge_bench import closed_loop, fmt, open_loop  # noqa: E402
from tests.support import Edge  # noqa: E402
from wrk.nginx_target import nginx_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", help="redis://HOST:PORT/DB, or auto (a redis-server of its own): limit "
                    "through Redis, the configuration --workers is for")
    ap.add_argument("--seconds", type=float, default=6.0)
    a = ap.parse_args()
    with contextlib.ExitStack() as stack:
        if a.store == "auto":
            from tests.redis_server import RedisServer
            server = RedisServer().start()
            stack.callback(server.stop)
            a.store = server.url
        port = stack.enter_context(nginx_target())
        url = f"http://127.0.0.1:{port}"
        extra = ["--limit", "10000000/s", "--store", a.store] if a.store else []
        edges = {n: Edge("--backends", url, "--health-interval", "30", "--workers", str(n), *extra,
                         name=f"bench-w{n}") for n in (1, 2)}
        for e in edges.values():
            stack.callback(e.stop)
        edges[2].wait_log(r"worker 1: listening")
        print(f"# 1 vs 2 workers ({'limiting through ' + a.store if a.store else 'no limiter'})\n")
        print("| workers | req/s run 1 | req/s run 2 | p50 / p99 ms at 800/s, run 1 | run 2 |")
        print("|---|---|---|---|---|")
        rps = {1: [], 2: []}
        lat = {1: [], 2: []}
        for _ in range(2):
            for n, e in edges.items():
                # CPU per request is not meaningful across processes here: count req/s only
                rps[n].append(closed_loop(f"http://127.0.0.1:{e.port}/", e.popen.pid, a.seconds, 32)[0])
            for n, e in edges.items():
                lat[n].append(open_loop(f"http://127.0.0.1:{e.port}/", 800, a.seconds, [("X-Api-Key", "b")]))
        for n in (1, 2):
            print(f"| {n} | {rps[n][0]:,.0f} | {rps[n][1]:,.0f} | {fmt(lat[n][0])} | {fmt(lat[n][1])} |")
        print(f"\n2 workers / 1 worker at saturation: **{sum(rps[2]) / sum(rps[1]):.2f}x**; "
              f"p99 at 800/s: {sum(x['p99'] for x in lat[1]) / 2:.2f} ms (1) vs "
              f"{sum(x['p99'] for x in lat[2]) / 2:.2f} ms (2).")


if __name__ == "__main__":
    main()
