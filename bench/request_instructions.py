"""Instructions per request on the edge's own path, counted by callgrind: an A/B that this noisy, shared
machine cannot blur (the same checkout gives the same count to a few parts in a thousand, whatever else
runs), where bench/request_path.py's CPU time moves ±10% from minute to minute.

    python3 bench/request_instructions.py                                   # this checkout
    python3 bench/request_instructions.py --variant main=/tmp/edge-main --variant mine=.
    python3 bench/request_instructions.py --edge-arg=--limit=1000/s         # any edge flag, as request_path
    python3 bench/request_instructions.py --no-limit                        # no rate-limit stage at all

It runs bench/request_path.py's child (one thread, real sockets, the real path: Reader, parse, limit stage,
balancer, pool, upstream head, parse_response, relay, metrics) under `valgrind --tool=callgrind` twice, with
n and 2n requests per batch, and divides the difference by the extra requests: start-up and imports cancel
out. The count includes the in-process backend thread's few instructions per request (the same for every
variant) and the kernel's work not at all (callgrind counts user space): a change that saves a system call
shows in request_path.py, not here. Instructions are not time -- a cache miss costs more than an add -- but
for Python code the two move together, and a change that removes 5% of them is real.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCHES = 6  # request_path's measure() runs six batches of n


def instructions(checkout: Path, n: int, extra: list[str], limit: bool = True) -> int:
    """Instructions callgrind counted for one child run with batches of n requests."""
    with tempfile.TemporaryDirectory(prefix="callgrind-") as d:
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={d}/out", sys.executable,
                "-m", "bench.request_path", "--child", str(checkout), "-n", str(n),
                *(f"--edge-arg={x}" for x in extra), *([] if limit else ["--no-limit"])]
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
        m = re.search(r"Collected : (\d+)", r.stderr)
        if r.returncode or m is None:
            raise SystemExit(f"callgrind failed for {checkout}:\n{r.stderr[-2000:]}")
        return int(m.group(1))


def per_request(checkout: Path, n: int, extra: list[str], limit: bool = True) -> float:
    return (instructions(checkout, 2 * n, extra, limit) - instructions(checkout, n, extra, limit)) / (BATCHES * n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", help="NAME=DIR (default: this checkout)")
    ap.add_argument("-n", type=int, default=300, help="requests per batch in the smaller run (default 300)")
    ap.add_argument("--edge-arg", action="append", default=[], help="an extra edge flag (repeatable)")
    ap.add_argument("--no-limit", action="store_true", help="no rate limiting (default: request_path's --limit 1000000/s)")
    a = ap.parse_args()
    if not shutil.which("valgrind"):
        sys.exit("valgrind not found (apt-get install valgrind)")
    variants = [v.partition("=")[::2] for v in (a.variant or [f"this={ROOT}"])]
    got = {}
    for name, d in variants:
        got[name] = per_request(Path(d).resolve(), a.n, a.edge_arg, not a.no_limit)
        print(f"{name}: {got[name]:,.0f} instructions/request", flush=True)
    first = got[variants[0][0]]
    print("\n| variant | instructions/request | vs first |\n|---|---:|---:|")
    for name, v in got.items():
        print(f"| {name} | {v:,.0f} | {v / first:.3f}x |")


if __name__ == "__main__":
    main()
