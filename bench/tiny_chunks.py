"""The edge's CPU for one streamed POST of N one-byte chunks (issue 23: a write per chunk toward the
backend), per checkout: the edge's own process CPU from /proc, and its sendto calls when strace is
there. A/B across checkouts, alternating:

    python3 -m bench.tiny_chunks --variant base=/tmp/edge-base --variant now=. -n 300000 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import time

from tests.rawserver import ConnReader, RecordingBackend
from tests.support import Edge


def cpu_seconds(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def post(port: int, body: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(b"POST /tiny HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
        head = ConnReader(s).head()
        return int(head[9:12])


def one(directory: str, n: int, traced: bool = False) -> tuple[float, int | None]:
    """(edge CPU seconds, sendto calls if traced): CPU is measured untraced (ptrace costs the traced)."""
    b = RecordingBackend()
    e = Edge("--backends", b.url, "--health-interval", "30", cwd=directory)
    trace = out = None
    try:
        if traced:
            out = f"/tmp/tiny-chunks-strace-{os.getpid()}.txt"
            trace = subprocess.Popen(["strace", "-f", "-c", "-e", "trace=sendto", "-o", out, "-p", str(e.popen.pid)],
                                     stderr=subprocess.DEVNULL)
            time.sleep(1.0)          # attached to every thread before the request
        body = b"1\r\na\r\n" * n + b"0\r\n\r\n"
        c0 = cpu_seconds(e.popen.pid)
        assert post(e.port, body) == 200
        cpu = cpu_seconds(e.popen.pid) - c0
    finally:
        if trace is not None:
            trace.terminate()
            trace.wait()
        e.stop()
        b.close()
    calls = None
    if out and os.path.exists(out):
        m = re.search(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)(?:\s+\d+)?\s+sendto$", open(out).read(), re.M)
        calls = int(m.group(1)) if m else None
        os.unlink(out)
    return cpu, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="NAME=DIR (default: this checkout)")
    ap.add_argument("-n", type=int, default=300_000, help="one-byte chunks in the body")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    variants = [v.split("=", 1) for v in a.variant] or [["this", "."]]
    results: dict[str, list] = {name: [] for name, _ in variants}
    for _ in range(a.rounds):
        for name, d in variants:
            results[name].append(one(os.path.abspath(d), a.n)[0])
            print(f"{name}: edge CPU {results[name][-1]:.2f} s", flush=True)
    calls = {name: one(os.path.abspath(d), a.n, traced=True)[1] if shutil.which("strace") else None
             for name, d in variants}
    print(f"\n| variant | edge CPU s, best of {a.rounds} ({a.n:,} one-byte chunks) | sendto calls (strace -c) |")
    print("|---|---|---|")
    for name, rs in results.items():
        print(f"| {name} | {min(rs):.2f} | {calls[name]} |")


if __name__ == "__main__":
    main()
