"""Measure wrk.loadgen's own ceiling on this machine against nginx on 127.0.0.1 (see docs/loadgen.md).

    python -m wrk.ceiling [--duration 10s] [--rates 5000,10000,12500,15000,20000] [--threads 1,2]

For each -t: one closed-loop run (-R 0, the most it can push), then the open-loop rates in order,
stopping at the first that does not keep up. Prints each exact command and a Markdown table.
Bounded: at most (1 + len(rates)) runs per -t, each --duration long.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from wrk.loadgen import parse_duration
from wrk.nginx_target import nginx_target


def one(args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        cmd = [sys.executable, "-m", "wrk.loadgen", *args, "--json", path]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", default="10s")
    p.add_argument("--connections", type=int, default=50)
    p.add_argument("--rates", default="5000,10000,12500,15000,20000")
    p.add_argument("--threads", default="1,2")
    a = p.parse_args(argv)
    parse_duration(a.duration)
    rows = []
    with nginx_target() as port:
        url = f"http://127.0.0.1:{port}/"
        print(f"nginx (1 worker, `return 200 \"ok\\n\"`, access_log off) on {url}; nproc {os.cpu_count()}; "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        for t in (int(x) for x in a.threads.split(",")):
            for rate in [0] + [int(x) for x in a.rates.split(",")]:
                args = [f"-t{t}", f"-c{a.connections}", f"-d{a.duration}", f"-R{rate}", url]
                load = os.getloadavg()[0]
                r = one(args)
                lm = r["latency_ms"]
                lag = "-" if rate == 0 else f"{r['send_lag_ms']['p99']:.2f}"
                row = (f"| {t} | {'closed' if rate == 0 else rate} | {r['achieved_rate']:.0f} | "
                       f"{'-' if r['kept_up'] is None else ('yes' if r['kept_up'] else 'NO')} | "
                       f"{lm['p50']:.2f} | {lm['p99']:.2f} | {lm['max']:.2f} | "
                       f"{lag} | "
                       f"{r['generator_cpu_pct_of_core']:.0f}% | "
                       f"{1e6 * r['generator_cpu_s'] / max(1, r['completed']):.0f} | {load:.2f} |")
                rows.append(row)
                print("python -m wrk.loadgen " + " ".join(shlex.quote(x) for x in args), flush=True)
                print(row, flush=True)
                if r["kept_up"] is False:
                    break
    print()
    print("| -t | -R | achieved req/s | kept up | p50 ms | p99 ms | max ms | send lag p99 ms "
          "| generator CPU (of one core) | CPU us/request | load avg before |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
