"""Does memory return after a burst of large responses? (issue 31, item 4) The edge's RSS idle, right
after 6 s of 1 MiB responses (wrk -c32, nginx serving the file), and 10 s later; per checkout.

    python3 bench/rss_return.py --variant main=/work/main --variant new=. --rounds 2
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from wrk.nginx_target import run_nginx  # noqa: E402


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096 / 2 ** 20


def one(edge_dir: str, files: str, big: int) -> tuple[float, float, float]:
    port = _free()
    p = subprocess.Popen([sys.executable, "edge.py", "--listen", f"127.0.0.1:{port}", "--backends",
                          f"http://127.0.0.1:{big}", "--health-interval", "3600"], cwd=edge_dir,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2)
        subprocess.run(["wrk", "-t1", "-c4", "-d1s", f"http://127.0.0.1:{port}/small"], capture_output=True)
        time.sleep(1)
        idle = _rss_mb(p.pid)
        subprocess.run(["wrk", "-t1", "-c32", "-d6s", f"http://127.0.0.1:{port}/big"], capture_output=True)
        after = _rss_mb(p.pid)
        time.sleep(10)
        return idle, after, _rss_mb(p.pid)
    finally:
        p.kill()          # (a TERM would drain for up to --drain-timeout: nothing here needs it)
        p.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", help="NAME=DIR (default: this checkout)")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    variants = [v.partition("=")[::2] for v in (a.variant or [f"this={Path.cwd()}"])]
    with tempfile.TemporaryDirectory() as files:
        Path(files).chmod(0o755)          # nginx's workers run as another user
        Path(files, "big").write_bytes(b"x" * (1 << 20))
        Path(files, "small").write_bytes(b"ok\n")
        big = _free()
        with run_nginx(http_extra=f"server {{ listen 127.0.0.1:{big}; root {files}; }}"):
            print("| variant | idle MB | after the 1 MiB run | 10 s later | later / idle |\n|---|---|---|---|---|")
            for _ in range(a.rounds):
                for name, d in variants:
                    idle, after, later = one(str(Path(d).resolve()), files, big)
                    print(f"| {name} | {idle:.1f} | {after:.1f} | {later:.1f} | {later / idle:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
