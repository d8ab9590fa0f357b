"""The edge's per-request CPU with nothing to wait for: one thread, real sockets, no other process.

    python -m bench.request_path                          # this checkout
    python -m bench.request_path --variant before=/tmp/edge-before --variant after=.   # A/B, interleaved

A through-the-edge benchmark (bench/tail_bench.py) mixes the edge's own work with wake-ups, the GIL
hand-offs of sixteen threads and the generator's share of a 2-core machine: its run-to-run spread
(+-15% here) is larger than most single changes. This one isolates the work: the client is a socket
pair whose far end this thread writes and drains itself, the backend a thread that answers each request
with a canned nginx response. Each request takes the real path -- Reader, parse, the rate-limit stage
(memory token bucket, a keyed client), the balancer, the pool, upstream_head, sendall, parse_response,
relay, metrics -- and its four system calls; what is timed is this thread's CPU (time.thread_time: the
backend thread's is not in it), to a few percent from run to run. Variants run in separate processes
(each imports its own checkout), alternating, best of `--rounds`.

--routes N: N [[routes]] ahead of the request (path_prefix /rI/ and a host, none of which it matches:
the worst case, every route tried before the default pool); --routes-hit: the last one matches instead.
A variant may name its own count, interleaved with the others: --variant none=. --variant r100=.@100
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REQUEST = (b"GET /api/items?page=2 HTTP/1.1\r\nHost: api.example.com\r\nUser-Agent: bench/1.0\r\n"
           b"Accept: */*\r\nX-Api-Key: bench-unlimited\r\n\r\n")
# nginx's answer to the protocol's GET / (its default page, shortened): the headers a real backend sends.
RESPONSE = (b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 15:00:00 GMT\r\n"
            b"Content-Type: text/html\r\nContent-Length: 615\r\nLast-Modified: Mon, 23 Jan 2023 10:00:00 GMT\r\n"
            b"Connection: keep-alive\r\nETag: \"63ce5b3c-267\"\r\nAccept-Ranges: bytes\r\n\r\n" + b"x" * 615)


def _routes_config(port: int, n: int, hit: bool) -> str:
    """A config file with n routes the bench's request does not match (or, hit, matches only the last)."""
    import tempfile
    lines = [f'[[backends]]\nurl = "http://127.0.0.1:{port}"\n']
    for i in range(n):
        prefix = "/api/" if hit and i == n - 1 else f"/r{i}/"
        lines.append(f'[[routes]]\nname = "r{i}"\nmatch = {{ path_prefix = "{prefix}", host = "api.example.com" }}\n'
                     f'pool = "default"\n')
    fd, path = tempfile.mkstemp(suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write("".join(lines))
    return path


def measure(n: int, extra: list[str], routes: int = 0, hit: bool = False, limit: bool = True) -> dict:
    """In this process (the checkout on sys.path): µs per request, best of 5 batches of n.
    limit: the rate-limit stage on (--limit 1000000/s, memory store), else no limiting at all."""
    try:
        from lb.config import load as config
        from lb.http.framing import Reader, parse_request
        from lb.process.app import App
    except ImportError:          # a checkout from before the rooms (02319e1): one flat lb/
        from lb import config    # type: ignore[no-redef]
        from lb.app import App   # type: ignore[no-redef]
        from lb.httpio import Reader, parse_request   # type: ignore[no-redef]

    backend = socket.create_server(("127.0.0.1", 0))
    port = backend.getsockname()[1]
    where = ["--config", _routes_config(port, routes, hit)] if routes else ["--backends", f"http://127.0.0.1:{port}"]
    limiting = ["--limit", "1000000/s"] if limit else []
    cfg = config.load(["--listen", "127.0.0.1:0", *where, *limiting, "--health-interval", "3600", *extra])
    app = App(cfg)
    edge = app.edge
    cs, cp = socket.socketpair()           # the client connection: the edge's end, ours
    cs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    reader = Reader(cs, cfg.send_timeout) if hasattr(cfg, "send_timeout") else Reader(cs)
    try:          # a checkout with the per-connection object (lb/proxy/conn.py): made once, as a connection does
        from lb.proxy.conn import ClientConn
        from lb.proxy.downstream import H1Downstream
        conn = ClientConn(cs, "127.0.0.1", False, reader)
        args = (conn, H1Downstream(conn, edge))
        handle = edge.handle
    except ImportError:
        # (client ip, trusted, over TLS): as many as this checkout's handle() takes (older ones take fewer)
        args = (reader, cs) + (b"127.0.0.1", False, "127.0.0.1", False)[:len(inspect.signature(edge.handle).parameters) - 3]
        handle = edge.handle

    # As the connection loop parses (Edge._serve): with the connection's memo in a checkout that has one.
    memo = (getattr(reader, "memo", None),) if "memo" in inspect.signature(parse_request).parameters else ()

    # EDGE_BENCH_DISTINCT=1: each request head and each response head its own bytes (the same lengths), as
    # real traffic's (another path or cookie, a Date that ticks): a per-connection memo of the last head never
    # hits, so what it costs when it misses shows. Unset: the same bytes every time (the memo's best case).
    vary = [0] if os.environ.get("EDGE_BENCH_DISTINCT") else None

    def one() -> None:
        if vary is not None:  # each head its own bytes (same length): the memo never hits
            vary[0] += 1
            cp.sendall(REQUEST.replace(b"page=2", b"p=%04d" % (vary[0] % 10000)))
        else:
            cp.sendall(REQUEST)
        reader.fill()
        req = parse_request(reader.read_head(), *memo)
        handle(req, *args)

    def serve_backend() -> None:
        while True:
            conn, _ = backend.accept()
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                if data.endswith(b"\r\n\r\n"):
                    if vary is not None:
                        conn.sendall(RESPONSE.replace(b"15:00:00", b"%08d" % (vary[0] % 100000000)))
                    else:
                        conn.sendall(RESPONSE)

    threading.Thread(target=serve_backend, daemon=True).start()
    best = float("inf")
    for i in range(6):
        t0 = time.thread_time()
        for _ in range(n):
            one()
            cp.recv(65536)
        if i:                              # the first batch warms up
            best = min(best, (time.thread_time() - t0) / n)
    app.server.server_close()
    return {"us": best * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", help="NAME=DIR (default: this checkout)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating runs of each variant")
    ap.add_argument("-n", type=int, default=5000, help="requests per batch")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--edge-arg", action="append", default=[], help="an extra edge flag (repeatable)")
    ap.add_argument("--routes", type=int, default=0, help="[[routes]] the request is matched against (none matches)")
    ap.add_argument("--routes-hit", action="store_true", help="with --routes: the last route matches")
    ap.add_argument("--no-limit", action="store_true", help="no rate limiting (default: --limit 1000000/s, memory)")
    a = ap.parse_args()
    if a.child:
        sys.path.insert(0, a.child)
        os.chdir(a.child)
        import logging
        logging.disable(logging.CRITICAL)
        print(json.dumps(measure(a.n, a.edge_arg, a.routes, a.routes_hit, not a.no_limit)))
        return
    variants = [v.partition("=")[::2] for v in (a.variant or [f"this={Path.cwd()}"])]
    got: dict[str, list[float]] = {name: [] for name, _ in variants}
    for r in range(a.rounds):
        for name, d in variants:
            d, _, routes = d.partition("@")
            out = subprocess.run([sys.executable, "-m", "bench.request_path", "--child", str(Path(d).resolve()),
                                  "-n", str(a.n), *(f"--edge-arg={x}" for x in a.edge_arg),
                                  "--routes", routes or str(a.routes), *(["--routes-hit"] if a.routes_hit else []),
                                  *(["--no-limit"] if a.no_limit else [])],
                                 cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{name}: {out.stderr[-2000:]}")
            got[name].append(json.loads(out.stdout.splitlines()[-1])["us"])
            print(f"round {r + 1} {name}: {got[name][-1]:.1f} us/request", flush=True)
    first = min(got[variants[0][0]])
    print("\n| variant | µs/request, best of rounds | per round | vs first |\n|---|---|---|---|")
    for name, _ in variants:
        b = min(got[name])
        print(f"| {name} | {b:.1f} | {' / '.join(f'{x:.1f}' for x in got[name])} | {first / b:.2f}x |")


if __name__ == "__main__":
    main()
