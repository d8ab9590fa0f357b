"""The edge's RSS: idle, after a burst of 1 MiB responses (and 1-10 s later), and under 512 connections.

    python3 bench/memory_return.py [--dir CHECKOUT] [--seconds 5] [--connections 512] [-- EDGE FLAGS...]

nginx serves a 1 MiB file (the backend: fast enough that the edge is the bottleneck); wrk -t1 -c32 fetches
it through the edge for --seconds; RSS is read from /proc/PID/status each second for 10 s after. Then
wrk -c{--connections} of small answers, RSS sampled every 0.2 s (the peak and its thread count), and
6 s after. --dir: another checkout's edge.py (the before of a change).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support import Edge  # noqa: E402
from wrk.nginx_target import _free_port, run_nginx  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def wrk(url: str, connections: int, seconds: float) -> str:
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", url], capture_output=True,
                         text=True).stdout
    return next((ln.split()[-1] for ln in out.splitlines() if "Requests/sec" in ln), "?")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=str(ROOT), help="the checkout whose edge.py runs (default: this one)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=512)
    ap.add_argument("edge_args", nargs="*")
    a = ap.parse_args()
    files = tempfile.mkdtemp(prefix="memory-return-")
    Path(files, "big").write_bytes(os.urandom(1 << 20))
    os.chmod(files, 0o755)                  # nginx's worker runs as another user
    os.chmod(Path(files, "big"), 0o644)
    big = _free_port()
    with run_nginx(http_extra="server { listen 127.0.0.1:%d; location / { root %s; } }" % (big, files)) as n:
        for backend, label in ((big, "1 MiB responses"), (n.port, "small answers")):
            e = Edge("--backends", f"http://127.0.0.1:{backend}", "--health-interval", "30", *a.edge_args,
                     cwd=a.dir, name="memory")
            pid = e.popen.pid
            try:
                if backend == big:
                    wrk(f"http://127.0.0.1:{e.port}/missing", 32, 2)    # threads and pools warm, small answers
                    time.sleep(1)
                    idle = rss_mb(pid)
                    assert b"200" in subprocess.run(["curl", "-sI", f"http://127.0.0.1:{e.port}/big"],
                                                    capture_output=True).stdout.split(b"\r\n")[0]
                    rps = wrk(f"http://127.0.0.1:{e.port}/big", 32, a.seconds)
                    after = [rss_mb(pid)]
                    for _ in range(10):
                        time.sleep(1)
                        after.append(rss_mb(pid))
                    print(f"{label}: {rps} req/s; RSS idle {idle:.1f} MB, right after {after[0]:.1f}, then "
                          f"{' '.join(f'{x:.1f}' for x in after[1:])} (10 s later {after[-1] / idle:.2f}x idle)")
                else:
                    idle = rss_mb(pid)
                    peak = [0.0, 0]
                    done = threading.Event()

                    def watch():
                        while not done.is_set():
                            r = rss_mb(pid)
                            if r > peak[0]:
                                peak[:] = [r, len(os.listdir(f"/proc/{pid}/task"))]
                            time.sleep(0.2)

                    t = threading.Thread(target=watch)
                    t.start()
                    rps = wrk(f"http://127.0.0.1:{e.port}/", a.connections, 6)
                    done.set()
                    t.join()
                    time.sleep(6)
                    print(f"{label} at -c{a.connections}: {rps} req/s; RSS idle {idle:.1f} MB, peak "
                          f"{peak[0]:.1f} MB with {peak[1]} threads, 6 s after {rss_mb(pid):.1f} MB")
            finally:
                e.stop()


if __name__ == "__main__":
    main()
