"""What idle keep-alive connections cost (issue 31, item 2): the edge's RSS, address space (VSZ) and
threads with N connections open, each having had one request answered, against an nginx backend.

    python3 bench/idle_connections.py --connections 10000 --variant default=. \\
        --variant 8mib=.,arg=--thread-stack=0

Raises this process's descriptor limit to its hard limit (the edge inherits it) and the edge's
--max-connections above N."""

from __future__ import annotations

import argparse
import resource
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.tail_bench import Variant  # noqa: E402
from wrk.nginx_target import nginx_target  # noqa: E402


def status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmSize", "Threads"):
            out[k] = int(v.split()[0])
    return out


def open_idle(port: int, n: int, batch: int = 250) -> list[socket.socket]:
    req = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Api-Key: bench-unlimited\r\n\r\n".encode()
    socks: list[socket.socket] = []
    while len(socks) < n:
        group = [socket.create_connection(("127.0.0.1", port)) for _ in range(min(batch, n - len(socks)))]
        for s in group:
            s.sendall(req)
        for s in group:
            s.settimeout(30)
            got = b""
            while b"\r\n\r\n" not in got or not got.endswith(b"ok\n"):
                chunk = s.recv(4096)
                if not chunk:
                    raise SystemExit(f"closed after {len(socks)} connections: {got[:200]!r}")
                got += chunk
        socks.extend(group)
    return socks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, help="NAME=DIR[,arg=FLAG]")
    ap.add_argument("--connections", type=int, default=10000)
    a = ap.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < a.connections + 100:
        raise SystemExit(f"descriptor hard limit {hard} < {a.connections} connections")
    with nginx_target() as nport:
        for spec in a.variant:
            v = Variant(f"{spec},arg=--max-connections={a.connections + 1000}")
            v.start(f"http://127.0.0.1:{nport}", [])
            try:
                time.sleep(1)
                idle = status(v.pid)
                t0 = time.monotonic()
                socks = open_idle(v.port, a.connections)
                took = time.monotonic() - t0
                time.sleep(2)
                held = status(v.pid)
                per = (held["VmRSS"] - idle["VmRSS"]) / a.connections
                print(f"{v.name}: idle RSS {idle['VmRSS'] / 1024:.1f} MB VSZ {idle['VmSize'] / 1024:.0f} MB; "
                      f"{a.connections} idle connections (opened in {took:.1f} s): RSS {held['VmRSS'] / 1024:.1f} MB "
                      f"({per:.1f} KB each), VSZ {held['VmSize'] / 1024:,.0f} MB, {held['Threads']} threads", flush=True)
                for s in socks:
                    s.close()
            finally:
                v.stop()


if __name__ == "__main__":
    main()
