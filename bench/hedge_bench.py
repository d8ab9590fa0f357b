"""Hedged requests (--hedge-after) on a pool where 1 request in 20 is slow: the tail with and without.

    python -m bench.hedge_bench [--seconds 10] [--rates 100,200] [--slow-ms 250] [--slow-every 20] \\
        [--hedge-after 0.02] [--repeats 2] [--out docs/bench-hedge.md]

Four keep-alive backends (one child process, a thread per connection) answer each request after
--fast-ms, or -- one request in --slow-every, at random (seeded), whichever backend gets it -- after
--slow-ms: the slowness belongs to the request on that backend, as a GC pause or a cold cache would, so
a second copy elsewhere is very likely fast. Two edges over the same pool, --hedge-after 0 (off) and
--hedge-after S, are driven in turn (A B A B: this machine is shared and noisy) by wrk.loadgen at a
constant rate (open loop: latency from each request's intended send time) and once in a closed loop of
8 connections (rate 0). Per row: p50, p90, p99, p99.9 and max, the hedges sent and won (the edge's
/metrics), and what the pool received per client request (the extra load hedging costs).
"""

from __future__ import annotations

import argparse
import json
import random
import select
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import Edge, wait_until  # noqa: E402
from wrk import loadgen  # noqa: E402

POOL = 4


def serve(n: int, fast: float, slow: float, every: int, seed: int) -> None:
    """The child: n backends; prints their ports as one JSON line, then serves until stdin closes."""
    rng = random.Random(seed)
    lock = threading.Lock()
    counts = [0] * n

    def connection(s, k):
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    d = s.recv(65536)
                    if not d:
                        return
                    buf += d
                head, _, buf = buf.partition(b"\r\n\r\n")
                if head.startswith(b"GET /_count"):
                    body = json.dumps(counts).encode()
                else:
                    with lock:
                        counts[k] += 1
                        wait = slow if rng.random() < 1.0 / every else fast
                    if wait and select.select([s], [], [], wait)[0] and not s.recv(1, socket.MSG_PEEK):
                        return              # the edge abandoned this one (a hedge won): nothing to answer
                    body = b"ok"
                s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        except OSError:
            pass
        finally:
            s.close()

    def accept(ls, k):
        while True:
            s, _ = ls.accept()
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=connection, args=(s, k), daemon=True).start()

    ports = []
    for k in range(n):
        ls = socket.create_server(("127.0.0.1", 0), backlog=512)
        ports.append(ls.getsockname()[1])
        threading.Thread(target=accept, args=(ls, k), daemon=True).start()
    print(json.dumps(ports), flush=True)
    sys.stdin.read()


def pool_count(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /_count HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while not data.endswith(b"]"):
            data += s.recv(4096)
    return sum(json.loads(data.partition(b"\r\n\r\n")[2]))


def metric(edge, name: str) -> float:
    from tests.test_failover import metric as m
    return m(edge, name)


def one_run(edge, port0: int, rate: int, seconds: float) -> dict:
    before = pool_count(port0), metric(edge, 'lb_hedges_total{result="won"}'), \
        metric(edge, 'lb_hedges_total{result="lost"}'), metric(edge, 'lb_hedges_total{result="failed"}')
    r = loadgen.run(f"http://127.0.0.1:{edge.port}/", threads=1, connections=64 if rate else 8,
                    duration=seconds, rate=rate)
    after = pool_count(port0), metric(edge, 'lb_hedges_total{result="won"}'), \
        metric(edge, 'lb_hedges_total{result="lost"}'), metric(edge, 'lb_hedges_total{result="failed"}')
    got = [a - b for a, b in zip(after, before)]
    lm = r["latency_ms"]
    done = max(1, r["completed"])
    return {"p50": lm["p50"], "p90": lm["p90"], "p99": lm["p99"], "p99.9": lm["p99.9"], "max": lm["max"],
            "rate": r["achieved_rate"], "kept_up": r["kept_up"] if rate else True,
            "hedged": (got[1] + got[2] + got[3]) / done, "won": got[1] / done, "load": got[0] / done,
            "non2xx": sum(v for k, v in r["status"].items() if not str(k).startswith("2"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rates", default="100,200,0", help="requests/s; 0: a closed loop of 8 connections")
    ap.add_argument("--fast-ms", type=float, default=2.0)
    ap.add_argument("--slow-ms", type=float, default=250.0)
    ap.add_argument("--slow-every", type=int, default=20)
    ap.add_argument("--hedge-after", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=28)
    ap.add_argument("--out", help="also write the Markdown report here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        serve(POOL, a.fast_ms / 1000, a.slow_ms / 1000, a.slow_every, a.seed)
        return
    rates = [int(x) for x in a.rates.split(",")]
    child = subprocess.Popen([sys.executable, __file__, "--child", "--fast-ms", str(a.fast_ms), "--slow-ms",
                              str(a.slow_ms), "--slow-every", str(a.slow_every), "--seed", str(a.seed)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ports = json.loads(child.stdout.readline())
    urls = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    common = ["--backends", urls, "--strategy", "round-robin", "--health-interval", "3600", "--admin", "127.0.0.1:0",
              "--eject-after", "0", "--access-log", "/dev/null"]
    variants = {"off": "0", f"hedge {a.hedge_after:g}s": str(a.hedge_after)}
    edges = {}
    rows = {(v, r): [] for v in variants for r in rates}
    try:
        for v, s in variants.items():
            edges[v] = Edge(*common, "--hedge-after", s, name=f"bench-hedge-{s}")
        for e in edges.values():      # warm: every backend connection open before the first measured run
            loadgen.run(f"http://127.0.0.1:{e.port}/", threads=1, connections=8, duration=1.0, rate=0)
        print(f"# {len(rates) * len(variants) * a.repeats} rows of {a.seconds:g} s ...", flush=True)
        for _ in range(a.repeats):
            for rate in rates:
                for v, e in edges.items():
                    row = one_run(e, ports[0], rate, a.seconds)
                    rows[(v, rate)].append(row)
                    print(v, rate or "closed", json.dumps(row), flush=True)
    finally:
        for e in edges.values():
            e.stop()
        child.stdin.close()
        child.wait(5)
    cmd = "python -m bench.hedge_bench " + shlex.join(sys.argv[1:])
    out = [f"`{cmd}` -- {POOL} backends, each request slow ({a.slow_ms:g} ms) with probability 1/{a.slow_every}, "
           f"else {a.fast_ms:g} ms; round-robin; {a.seconds:g} s per row, {a.repeats} repeats interleaved "
           "(each cell: the repeats' values, in order).", "",
           "| variant | rate | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | hedged | hedges won | pool requests per request | req/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        for v in variants:
            rs = rows[(v, rate)]
            cell = lambda k, f="{:.1f}": " / ".join(f.format(r[k]) for r in rs)  # noqa: E731
            out.append(f"| {v} | {rate or 'closed, 8 conn'} | {cell('p50')} | {cell('p90')} | {cell('p99')} | "
                       f"{cell('p99.9')} | {cell('max')} | {cell('hedged', '{:.1%}')} | {cell('won', '{:.1%}')} | "
                       f"{cell('load', '{:.3f}')} | {cell('rate', '{:.0f}')}"
                       + (" (not kept up)" if not all(r["kept_up"] for r in rs) else "")
                       + (f" ({sum(r['non2xx'] for r in rs)} non-2xx)" if any(r["non2xx"] for r in rs) else "")
                       + " |")
    text = "\n".join(out)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
