"""Fairness at many connections (issue 31, item 2): wrk -c32 / -c512 / -c1024 against each variant, an
nginx backend behind it, the generator and nginx on one CPU and every edge on the other (as
bench/tail_bench.py places them). Per row: req/s, p50/p99/max latency, the requests wrk gave up on (its
--timeout, 5 s here, so a wait over 1 s shows as the max, not as a lost sample) and the edge's CPU per
request. Repeats interleave the variants.

    python3 bench/fairness.py --variant main=/work/main --variant new=. --repeats 2
    python3 bench/fairness.py --variant new=. --connections 32,512,1024 --duration 8s
    python3 bench/fairness.py --variant main=/work/main --variant new=. --connections 8,32 --close

The goals (issue 31): at -c512 and -c1024 no request over 1 s, p99 at most 3x its -c32 value, and
req/s at -c512 at least 0.8x that at -c32.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.edge_bench import cpu_seconds  # noqa: E402
from bench.tail_bench import NginxProxy, Variant  # noqa: E402
from wrk.loadgen import parse_duration  # noqa: E402
from wrk.nginx_target import nginx_target  # noqa: E402
from wrk.placement import describe, machine, place  # noqa: E402

_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    return float(m.group(1)) * _UNIT[m.group(2)]


def wrk(url: str, connections: int, seconds: float, timeout: float = 5.0, close: bool = False) -> dict:
    """One closed-loop wrk run (keyed, never limited: wrk/keyed.lua); `close`: a new connection per request."""
    out = subprocess.run(["wrk", "-t2" if connections > 64 else "-t1", f"-c{connections}", f"-d{seconds:g}s",
                          "--latency", f"--timeout={timeout:g}s", "-s", "wrk/keyed.lua",
                          *(["-H", "Connection: close"] if close else []), url],
                         capture_output=True, text=True, timeout=seconds + 60,
                         env={**os.environ, "WRK_API_KEY": "bench-unlimited"},
                         cwd=Path(__file__).resolve().parent.parent).stdout
    lat = re.search(r"Latency\s+(\S+)\s+(\S+)\s+(\S+)", out)
    p = {k: _ms(v) for k, v in re.findall(r"^\s+(50|99)%\s+(\S+)", out, re.M)}
    timeouts = re.search(r"timeout (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "total": int(re.search(r"(\d+) requests in", out).group(1)),
            "p50": p.get("50", 0.0), "p99": p.get("99", 0.0), "max": _ms(lat.group(3)),
            "timeouts": int(timeouts.group(1)) if timeouts else 0,
            "errors": sum(map(int, errors.groups())) if errors else 0,
            "non2xx": int(non2xx.group(1)) if non2xx else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, help="NAME=DIR[,switch=S][,arg=FLAG]")
    ap.add_argument("--connections", default="32,512,1024")
    ap.add_argument("--duration", type=parse_duration, default=8.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--close", action="store_true",
                    help="every request on a new connection (Connection: close): what a connection costs")
    ap.add_argument("--reference", action=argparse.BooleanOptionalAction, default=False,
                    help="also nginx as a reverse proxy in the edge's place")
    a = ap.parse_args()
    variants = [Variant(s) for s in a.variant] + ([NginxProxy()] if a.reference else [])
    conns = [int(c) for c in a.connections.split(",")]
    load_cpu, pin = place()
    rows: dict[tuple[str, int], list[dict]] = {}
    print(f"# fairness: {machine()}; {describe(load_cpu, pin)}; load {os.getloadavg()[0]:.2f}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
    with nginx_target() as nport:
        started = []
        try:
            for v in variants:
                v.start(f"http://127.0.0.1:{nport}", pin)
                started.append(v)
            for v in variants:
                wrk(v.url, 16, 2)                      # warm-up: pools filled, code paths hot
            for rep in range(1, a.repeats + 1):
                for c in conns:
                    for v in variants:
                        time.sleep(3)       # the last row's connections end (else they count against -c1024's)
                        c0 = cpu_seconds(v.pid)
                        r = wrk(v.url, c, a.duration, close=a.close)
                        r["cpu_us"] = 1e6 * (cpu_seconds(v.pid) - c0) / max(1, r["total"])
                        rows.setdefault((v.name, c), []).append(r)
                        print(f"r{rep} -c{c} {v.name}: {r['rps']:,.0f} req/s, p50 {r['p50']:.1f} p99 {r['p99']:.1f} "
                              f"max {r['max']:.0f} ms, timeouts {r['timeouts']}, errors {r['errors']}, "
                              f"non-2xx {r['non2xx']}, CPU {r['cpu_us']:.0f} us/req (load {os.getloadavg()[0]:.1f})",
                              flush=True)
        finally:
            for v in started:
                v.stop()
    print(f"\n| variant | -c | req/s | p99 ms | max ms | timeouts | CPU us/req | req/s vs -c{conns[0]} | "
          f"p99 vs -c{conns[0]} |\n|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        base = rows[(v.name, conns[0])]
        brps = sum(r["rps"] for r in base) / len(base)
        bp99 = sum(r["p99"] for r in base) / len(base)
        for c in conns:
            rs = rows[(v.name, c)]
            rps = sum(r["rps"] for r in rs) / len(rs)
            p99 = sum(r["p99"] for r in rs) / len(rs)
            def each(k, f):
                return " / ".join(format(r[k], f) for r in rs)
            print(f"| {v.name} | {c} | {each('rps', ',.0f')} | {each('p99', '.0f')} | {each('max', '.0f')} | "
                  f"{each('timeouts', 'd')} | {sum(r['cpu_us'] for r in rs) / len(rs):.0f} | {rps / brps:.2f}x | "
                  f"{p99 / bp99:.1f}x |")

if __name__ == "__main__":
    main()
