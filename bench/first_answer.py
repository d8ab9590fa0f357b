"""Where the long waits at many connections are (issue 31, item 2): bench/closed_loop.c, a closed-loop
client like wrk -cN, reports each connection's FIRST request (timed from connect(): accept queue and
thread start included) apart from the steady ones, with the edge's CPU and context switches per request
(perf stat) over the steady window. nginx backend and client on one CPU, each edge on the other;
repeats interleave the variants.

    python3 bench/first_answer.py --variant off=. --variant gate16=.,arg=--running-threads=16 \\
        --connections 32,512 --duration 4 --warm 2 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.edge_bench import cpu_seconds  # noqa: E402
from bench.tail_bench import Variant  # noqa: E402
from wrk.nginx_target import nginx_target  # noqa: E402
from wrk.placement import describe, place  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, help="NAME=DIR[,switch=S][,arg=FLAG]")
    ap.add_argument("--connections", default="32,512")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds of the steady window")
    ap.add_argument("--warm", type=float, default=2.0, help="seconds from the connects to the steady window")
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    client = Path(tempfile.mkdtemp(prefix="closed-loop-")) / "closed_loop"
    subprocess.run(["gcc", "-O2", "-o", str(client), str(ROOT / "bench" / "closed_loop.c")], check=True)
    perf = shutil.which("perf")
    load_cpu, pin = place()
    variants = [Variant(s) for s in a.variant]
    print(f"# first_answer: {describe(load_cpu, pin)}; load {os.getloadavg()[0]:.1f}; {time.strftime('%H:%M:%S %Z')}")
    with nginx_target() as nport:
        for v in variants:
            v.start(f"http://127.0.0.1:{nport}", pin)
        try:
            for v in variants:  # warm-up: pools filled, code paths hot
                subprocess.run([str(client), str(v.port), "16", "1", "0"], capture_output=True)
            for rep in range(1, a.repeats + 1):
                for c in (int(x) for x in a.connections.split(",")):
                    for v in variants:
                        time.sleep(2)  # the last row's connections end
                        run = subprocess.Popen([str(client), str(v.port), str(c), str(a.duration), str(a.warm)],
                                               stdout=subprocess.PIPE, text=True)
                        time.sleep(a.warm)
                        window = a.duration - 0.3
                        c0 = cpu_seconds(v.pid)
                        stat = (subprocess.Popen([perf, "stat", "-x,", "-e", "context-switches", "-p", str(v.pid),
                                                  "--", "sleep", str(window)], stderr=subprocess.PIPE, text=True)
                                if perf else None)
                        time.sleep(window)
                        cpu = cpu_seconds(v.pid) - c0
                        out = run.communicate()[0].strip()
                        total = float(out.split()[1]) * window
                        cs = ""
                        if stat is not None:
                            n = int(stat.communicate()[1].strip().splitlines()[-1].split(",")[0])
                            cs = f", {n / max(1, total):.2f} context switches/req"
                        print(f"r{rep} -c{c} {v.name}: {out} | CPU {1e6 * cpu / max(1, total):.0f} us/req{cs} "
                              f"(load {os.getloadavg()[0]:.1f})", flush=True)
        finally:
            for v in variants:
                v.stop()


if __name__ == "__main__":
    main()
