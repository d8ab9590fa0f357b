"""Round robin vs least-request with one of three backends 10x slower: latency and the slow one's share.

    python -m bench.failover_bench [--seconds 10] [--rates 0,100,300] [--delay-ms 5] [--out docs/journal/bench-failover.md]

Three identity backends (demo/backends.py) answer after --delay-ms, the third after 10x that. Two edges over
them, --strategy round-robin and --strategy least-request, are driven in turn (A B A B: this machine is
shared and noisy) by wrk.loadgen at a constant rate (latency from each request's intended send time);
the slow backend's share is read from the backends' own counters. Rate 0 is a closed loop instead: 12
connections each sending its next request when the last is answered (latency from the actual send; it
shows what each strategy does under a fixed concurrency, and the throughput that results).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import Backend, Edge  # noqa: E402
from wrk import loadgen  # noqa: E402

STRATEGIES = ("round-robin", "least-request")


def one_run(edge, backends, rate: int, seconds: float) -> dict:
    before = [b.stats()["count"] for b in backends]
    r = loadgen.run(f"http://127.0.0.1:{edge.port}/", threads=1, connections=64 if rate else 12,
                    duration=seconds, rate=rate)
    got = [b.stats()["count"] - n for b, n in zip(backends, before)]
    lm = r["latency_ms"]
    return {"mean": lm["mean"], "p50": lm["p50"], "p90": lm["p90"], "p99": lm["p99"],
            "kept_up": r["kept_up"] if rate else True, "achieved": r["achieved_rate"],
            "rate": r["achieved_rate"], "slow_share": got[2] / max(1, sum(got)),
            "non2xx": sum(v for k, v in r["status"].items() if not str(k).startswith("2"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rates", default="0,100,300", help="requests/s; 0: closed loop, 12 connections")
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("--out", help="also write the Markdown report here")
    a = ap.parse_args()
    rates = [int(x) for x in a.rates.split(",")]
    slow = a.delay_ms * 10
    backends = [Backend("fast1", 0, "--delay-ms", f"{a.delay_ms:g}"),
                Backend("fast2", 0, "--delay-ms", f"{a.delay_ms:g}"),
                Backend("slow", 0, "--delay-ms", f"{slow:g}")]
    urls = ",".join(b.url for b in backends)
    edges = {s: Edge("--backends", urls, "--strategy", s, name=f"bench-{s}") for s in STRATEGIES}
    rows = {(s, r): [] for s in STRATEGIES for r in rates}
    print(f"# {len(rates) * 4} rows of {a.seconds:g} s ...", flush=True)
    try:
        for _ in range(2):
            for rate in rates:
                for s in STRATEGIES:
                    rows[(s, rate)].append(one_run(edges[s], backends, rate, a.seconds))
    finally:
        for e in edges.values():
            e.stop()
        for b in backends:
            b.stop()

    cmd = "python -m bench.failover_bench " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    out = [f"# Round robin vs least-request, one backend of three 10x slower\n",
           f"`{cmd.strip()}`: backends answer after {a.delay_ms:g}, {a.delay_ms:g} and {slow:g} ms; "
           f"wrk.loadgen -c64 at a constant rate, {a.seconds:g} s per row, two interleaved runs "
           f"(run 1 / run 2). The machine is a shared, noisy 2-core VM.\n",
           "| rate | strategy | req/s | mean ms | p50 ms | p90 ms | p99 ms | slow backend's share | non-2xx |",
           "|---|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        for s in STRATEGIES:
            rs = rows[(s, rate)]
            f = lambda k, d=2: " / ".join(f"{r[k]:.{d}f}" for r in rs)  # noqa: E731
            warn = "" if all(r["kept_up"] for r in rs) else " (generator fell behind)"
            shares = " / ".join(f"{r['slow_share']:.1%}" for r in rs)
            label = f"{rate}/s" if rate else "closed loop, 12 conns"
            out.append(f"| {label} | {s} | {f('achieved', 0)} | {f('mean')} | {f('p50')} | {f('p90')} | {f('p99')}{warn} | "
                       f"{shares} | {sum(r['non2xx'] for r in rs)} |")
    for rate in rates:
        ratios = []
        for k in ("mean", "p90", "p99"):
            rr = sum(r[k] for r in rows[("round-robin", rate)]) / 2
            lr = sum(r[k] for r in rows[("least-request", rate)]) / 2
            ratios.append(f"{k} {rr / lr:.2f}x")
        label = f"At {rate}/s" if rate else "Closed loop"
        out.append(f"\n{label}, round robin / least-request (means of the two runs): {', '.join(ratios)}.")
    text = "\n".join(out) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
