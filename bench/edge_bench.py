"""What the edge costs, measured side by side in one run against the same fast backend (nginx).

    python -m bench.edge_bench                 # ~3 minutes; --quick for a ~1 minute look
    python -m bench.edge_bench --out docs/journal/bench-edge.md

1. Max throughput (closed loop: wrk when installed, else our generator with -R 0) and CPU ms per
   request, of the edge and of the 40-line ThreadingHTTPServer + urlopen proxy (bench/urlopen_proxy.py).
2. p50/p99 at fixed rates (open loop, wrk.loadgen: latency from the intended send time) for nginx
   direct and through the edge.
3. Pooling on vs --no-pool at the same rate.
4. Limiting on (memory token bucket, a key that is never limited) vs off at the same rate.

Every row is run twice, interleaved (A B A B), because this 2-core machine is shared and noisy; the
table shows both runs. The load generator, the proxy and nginx share the two cores: absolute numbers
are this machine's, the ratios are the point.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from wrk.placement import describe, place  # noqa: E402
from wrk.nginx_target import nginx_target  # noqa: E402
from tests.support import Edge, Proc  # noqa: E402
from wrk import loadgen  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def closed_loop(url: str, pid: int, seconds: float, connections: int = 16) -> tuple[float, float]:
    """(requests/s, CPU ms of the proxy process per request) at saturation."""
    c0 = cpu_seconds(pid)
    if shutil.which("wrk"):
        out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", url],
                             capture_output=True, text=True, timeout=seconds + 30).stdout
        rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
        total = int(re.search(r"(\d+) requests in", out).group(1))
    else:
        r = loadgen.run(url, threads=1, connections=connections, duration=seconds, rate=0)
        rps, total = r["achieved_rate"], sum(r["status"].values())
    cpu = cpu_seconds(pid) - c0
    return rps, cpu * 1000 / max(total, 1)


def open_loop(url: str, rate: int, seconds: float, headers=()) -> dict:
    r = loadgen.run(url, threads=1, connections=32, duration=seconds, rate=rate, headers=list(headers))
    lm = r["latency_ms"]
    return {"p50": lm["p50"], "p99": lm["p99"], "kept_up": r["kept_up"], "rate": r["achieved_rate"],
            "non2xx": sum(v for k, v in r["status"].items() if not k.startswith("2"))}


def fmt(r: dict) -> str:
    warn = "" if r["kept_up"] else " (fell behind)"
    return f"{r['p50']:.2f} / {r['p99']:.2f}{warn}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter runs (noisier)")
    ap.add_argument("--out", help="also write the Markdown report here")
    a = ap.parse_args()
    sat, fixed = (3, 5) if a.quick else (6, 10)

    load_cpu, pin = place()            # before nginx and the generator start: they inherit it
    stack = contextlib.ExitStack()
    nginx_port = stack.enter_context(nginx_target())

    class nginx:
        url = f"http://127.0.0.1:{nginx_port}"

    edge = Edge("--backends", nginx.url, "--health-interval", "30", *pin, name="bench-edge")
    nopool = Edge("--backends", nginx.url, "--health-interval", "30", "--no-pool", *pin, name="bench-nopool")
    limited = Edge("--backends", nginx.url, "--health-interval", "30", "--limit", "1000000/s",
                   *pin, name="bench-limited")
    yard = Proc(["taskset", "-c", pin[-1], sys.executable, "bench/urlopen_proxy.py", "0", nginx.url]
                if pin else [sys.executable, "bench/urlopen_proxy.py", "0", nginx.url], "bench-urlopen")
    yard_port = int(yard.wait_log(r"listening 127\.0\.0\.1:(\d+)").group(1))
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    try:
        say(f"# Edge benchmark ({time.strftime('%Y-%m-%d %H:%M')}, nproc={os.cpu_count()}, "
            f"load average {os.getloadavg()[0]:.2f})")
        say(f"\nCommand: `python -m bench.edge_bench{' --quick' if a.quick else ''}`. Backend: nginx "
            f"`return 200` (Debian nginx-light). Closed loop: {'wrk -t1 -c16' if shutil.which('wrk') else 'wrk.loadgen -R0 -c16'}, "
            f"{sat}s per run; open loop: wrk.loadgen -t1 -c32, {fixed}s per run. Placement: "
            f"{describe(load_cpu, pin)}; the urlopen proxy on the edge's CPU too.\n")
        say("## 1. Max throughput and CPU per request (closed loop, two runs each, interleaved)\n")
        say("| proxy | req/s run 1 | req/s run 2 | CPU ms/req run 1 | CPU ms/req run 2 |")
        say("|---|---|---|---|---|")
        thr = {"edge": [], "urlopen": []}
        for _ in range(2):
            thr["edge"].append(closed_loop(f"http://127.0.0.1:{edge.port}/", edge.popen.pid, sat))
            thr["urlopen"].append(closed_loop(f"http://127.0.0.1:{yard_port}/", yard.popen.pid, sat))
        for name, runs in thr.items():
            say(f"| {name} | {runs[0][0]:,.0f} | {runs[1][0]:,.0f} | {runs[0][1]:.3f} | {runs[1][1]:.3f} |")
        e_rps = sum(r[0] for r in thr["edge"]) / 2
        y_rps = sum(r[0] for r in thr["urlopen"]) / 2
        e_cpu = sum(r[1] for r in thr["edge"]) / 2
        y_cpu = sum(r[1] for r in thr["urlopen"]) / 2
        say(f"\nEdge / urlopen proxy: **{e_rps / y_rps:.2f}x** the throughput, "
            f"**{y_cpu / e_cpu:.2f}x** less CPU per request (mean of the two runs).\n")

        say("## 2. Latency at fixed rates, ms p50 / p99 (open loop, two runs each, interleaved)\n")
        say("| rate | nginx direct, run 1 | edge, run 1 | nginx direct, run 2 | edge, run 2 | p99 delta (mean) |")
        say("|---|---|---|---|---|---|")
        for rate in (1000, 2000):
            d1 = open_loop(f"{nginx.url}/", rate, fixed)
            e1 = open_loop(f"http://127.0.0.1:{edge.port}/", rate, fixed)
            d2 = open_loop(f"{nginx.url}/", rate, fixed)
            e2 = open_loop(f"http://127.0.0.1:{edge.port}/", rate, fixed)
            delta = ((e1["p99"] - d1["p99"]) + (e2["p99"] - d2["p99"])) / 2
            say(f"| {rate}/s | {fmt(d1)} | {fmt(e1)} | {fmt(d2)} | {fmt(e2)} | +{delta:.2f} ms |")

        say("\n## 3. Connection reuse: pooled vs --no-pool at 1000/s, ms p50 / p99\n")
        say("| run | pooled | --no-pool |")
        say("|---|---|---|")
        pr = []
        for i in (1, 2):
            p = open_loop(f"http://127.0.0.1:{edge.port}/", 1000, fixed)
            n = open_loop(f"http://127.0.0.1:{nopool.port}/", 1000, fixed)
            pr.append((p, n))
            say(f"| {i} | {fmt(p)} | {fmt(n)} |")
        p50_ratio = sum(n["p50"] for _, n in pr) / sum(p["p50"] for p, _ in pr)
        p99_ratio = sum(n["p99"] for _, n in pr) / sum(p["p99"] for p, _ in pr)
        say(f"\n--no-pool / pooled: p50 **{p50_ratio:.2f}x**, p99 **{p99_ratio:.2f}x**.\n")

        say("## 4. The limiter stage: limiting on (memory token bucket, never limited) vs off, 1000/s\n")
        say("| run | limiting off | limiting on |")
        say("|---|---|---|")
        lr = []
        for i in (1, 2):
            off = open_loop(f"http://127.0.0.1:{edge.port}/", 1000, fixed, [("X-Api-Key", "bench")])
            on = open_loop(f"http://127.0.0.1:{limited.port}/", 1000, fixed, [("X-Api-Key", "bench")])
            assert on["non2xx"] == 0, "the bench key was limited"
            lr.append((off, on))
            say(f"| {i} | {fmt(off)} | {fmt(on)} |")
        d50 = sum(on["p50"] - off["p50"] for off, on in lr) / 2
        d99 = sum(on["p99"] - off["p99"] for off, on in lr) / 2
        say(f"\nLimiter stage cost (mean of two runs): p50 {d50:+.3f} ms, p99 {d99:+.3f} ms.")
    finally:
        for p in (edge, nopool, limited, yard):
            p.stop()
        stack.close()
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
