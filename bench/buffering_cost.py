"""What buffering costs a fast client: the edge's CPU per large response and per large upload, with
response/request buffering on (the default) and off. One edge process per setting, one demo.backends
backend, one client on this thread, sequential requests; the edge's CPU is read from /proc/PID/stat
(user + system), so the client's and the backend's are not in it.

    python3 bench/buffering_cost.py                      # 8 MiB responses, 1 MiB uploads, 40 each
    python3 bench/buffering_cost.py -n 100 --size 16777216

Buffering only changes the path of bodies that do not leave with their head (> 64 KiB); small
responses are bench/request_path.py's.
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support import Backend, Edge  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def run(edge: Edge, n: int, method: str, path: str, body: bytes | None) -> float:
    c = http.client.HTTPConnection("127.0.0.1", edge.port, timeout=60)
    for _ in range(3):                                   # warm: the pool, the threads
        c.request(method, path, body=body)
        c.getresponse().read()
    t0 = cpu(edge.popen.pid)
    for _ in range(n):
        c.request(method, path, body=body)
        r = c.getresponse()
        r.read()
        assert r.status == 200, r.status
    c.close()
    return (cpu(edge.popen.pid) - t0) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=40, help="requests per measurement")
    ap.add_argument("--size", type=int, default=8 << 20, help="response bytes")
    ap.add_argument("--upload", type=int, default=1 << 20, help="request body bytes")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs; best of them is shown")
    a = ap.parse_args()
    backend = Backend("bench")
    edges = {"on": Edge("--backends", backend.url, "--health-interval", "30"),
             "off": Edge("--backends", backend.url, "--health-interval", "30", "--proxy-buffering", "off",
                         "--request-buffering", "off")}
    best: dict = {}
    try:
        for _ in range(a.rounds):
            for name, e in edges.items():
                r = run(e, a.n, "GET", f"/big?bytes={a.size}", None)
                u = run(e, a.n, "POST", "/echo", b"u" * a.upload)
                b = best.setdefault(name, [r, u])
                b[0], b[1] = min(b[0], r), min(b[1], u)
                print(f"{name}: {r:.2f} ms CPU per {a.size >> 20} MiB response, {u:.2f} ms per "
                      f"{a.upload >> 10} KiB upload", flush=True)
    finally:
        for e in edges.values():
            e.stop()
        backend.stop()
    print(f"\n| buffering | ms CPU / {a.size >> 20} MiB response | ms CPU / {a.upload >> 10} KiB upload |")
    print("|---|---|---|")
    for name, (r, u) in best.items():
        print(f"| {name} | {r:.2f} | {u:.2f} |")


if __name__ == "__main__":
    main()
