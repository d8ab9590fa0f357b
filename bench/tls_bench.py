"""What TLS termination costs, measured side by side in one run against the same backend (nginx).

    python -m bench.tls_bench                  # ~2 minutes; --quick for ~40 s
    python -m bench.tls_bench --out docs/bench-tls.md

Three edges on one backend: plain HTTP, TLS with an ECDSA P-256 certificate, TLS with RSA-2048.
1. New connections per second: closed loop, 4 client threads, each connection does connect (+ a full
   TLS handshake: no session resumption), one GET with Connection: close, read to the close. Also the
   edge's CPU ms per connection (from /proc), the figure that does not depend on the client's speed.
2. Requests over one kept-alive connection: N sequential GETs, ms p50 / p99 / mean per request.

Each row runs twice, interleaved (plain, ECDSA, RSA, plain, ...), because this 2-core machine is shared.
The client is Python (ssl), pinned with nginx to one CPU; the edges to the other.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trustme  # noqa: E402

from bench.edge_bench import cpu_seconds  # noqa: E402
from tests.support import Edge  # noqa: E402
from wrk.nginx_target import nginx_target  # noqa: E402
from wrk.placement import describe, place  # noqa: E402

REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"
CLOSE = b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"


def client_ctx(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def one_connection(port: int, ctx: ssl.SSLContext | None) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        if ctx is not None:
            s = ctx.wrap_socket(s, server_hostname="127.0.0.1")
        s.sendall(CLOSE)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        assert out.startswith(b"HTTP/1.1 200"), out[:100]
    finally:
        s.close()


def connections_per_second(port: int, ctx, pid: int, seconds: float, threads: int = 4) -> tuple[float, float]:
    """(connections/s, edge CPU ms per connection)."""
    stop = time.monotonic() + seconds
    counts = [0] * threads

    def loop(i):
        while time.monotonic() < stop:
            one_connection(port, ctx)
            counts[i] += 1

    c0, t0 = cpu_seconds(pid), time.monotonic()
    ts = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    elapsed, cpu = time.monotonic() - t0, cpu_seconds(pid) - c0
    n = sum(counts)
    return n / elapsed, cpu * 1000 / max(n, 1)


def kept_alive(port: int, ctx, n: int) -> dict:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ctx is not None:
        s = ctx.wrap_socket(s, server_hostname="127.0.0.1")
    lat = []
    buf = b""
    try:
        for _ in range(n):
            t = time.perf_counter()
            s.sendall(REQUEST)
            while True:   # nginx answers "ok\n" with a Content-Length: read to the end of that body
                i = buf.find(b"\r\n\r\n")
                if i >= 0:
                    length = int(buf.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
                    if len(buf) >= i + 4 + length:
                        buf = buf[i + 4 + length:]
                        break
                chunk = s.recv(65536)
                if not chunk:
                    raise RuntimeError("closed")
                buf += chunk
            lat.append((time.perf_counter() - t) * 1000)
    finally:
        s.close()
    lat.sort()
    return {"p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99)], "mean": statistics.fmean(lat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    seconds, n = (3, 1000) if a.quick else (8, 4000)

    load_cpu, pin = place()
    stack = contextlib.ExitStack()
    backend = f"http://127.0.0.1:{stack.enter_context(nginx_target())}"
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    cas, edges = {}, {"plain": Edge("--backends", backend, "--health-interval", "30", *pin, name="bench-plain")}
    for name, kind in (("TLS ECDSA P-256", trustme.KeyType.ECDSA), ("TLS RSA-2048", trustme.KeyType.RSA)):
        ca = trustme.CA(key_type=kind)
        leaf = ca.issue_cert("127.0.0.1", key_type=kind)
        cert, key = tmp / f"{kind.name}.crt", tmp / f"{kind.name}.key"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        cas[name] = ca
        edges[name] = Edge("--backends", backend, "--health-interval", "30", "--tls-cert", str(cert),
                           "--tls-key", str(key), *pin, name="bench-tls")
    ctxs = {name: (client_ctx(cas[name]) if name in cas else None) for name in edges}
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    try:
        say(f"# TLS termination benchmark ({time.strftime('%Y-%m-%d %H:%M')}, nproc={os.cpu_count()}, "
            f"load average {os.getloadavg()[0]:.2f}, {ssl.OPENSSL_VERSION})")
        say(f"\nCommand: `python -m bench.tls_bench{' --quick' if a.quick else ''}`. Backend: nginx `return 200`. "
            f"Placement: {describe(load_cpu, pin)}. Client: Python ssl, TLS 1.3 (the edge's default "
            f"offer), full handshakes (no resumption). The machine is shared with other work: ratios, "
            f"not absolute figures, are the point.\n")
        say(f"## 1. New connections (connect, handshake, one GET, close), 4 client threads, {seconds}s per run\n")
        say("| listener | conn/s run 1 | conn/s run 2 | edge CPU ms/conn run 1 | run 2 |")
        say("|---|---|---|---|---|")
        res = {name: [] for name in edges}
        for _ in range(2):
            for name, e in edges.items():
                res[name].append(connections_per_second(e.port, ctxs[name], e.popen.pid, seconds))
        for name, runs in res.items():
            say(f"| {name} | {runs[0][0]:,.0f} | {runs[1][0]:,.0f} | {runs[0][1]:.3f} | {runs[1][1]:.3f} |")
        plain_rate = statistics.fmean(r[0] for r in res["plain"])
        plain_cpu = statistics.fmean(r[1] for r in res["plain"])
        for name in cas:
            rate = statistics.fmean(r[0] for r in res[name])
            cpu = statistics.fmean(r[1] for r in res[name])
            say(f"\n{name}: **{rate:,.0f} handshakes/s** ({rate / plain_rate:.2f}x the plain connection rate), "
                f"edge CPU **{cpu:.3f} ms** per connection vs {plain_cpu:.3f} plain (**+{cpu - plain_cpu:.3f} ms** "
                f"per handshake; one edge CPU would do ~{1000 / cpu:,.0f} of them a second).")

        say(f"\n## 2. One kept-alive connection, {n} sequential requests, ms per request\n")
        say("| listener | p50 run 1 | p99 run 1 | mean run 1 | p50 run 2 | p99 run 2 | mean run 2 |")
        say("|---|---|---|---|---|---|---|")
        ka = {name: [] for name in edges}
        for _ in range(2):
            for name, e in edges.items():
                ka[name].append(kept_alive(e.port, ctxs[name], n))
        for name, runs in ka.items():
            r1, r2 = runs
            say(f"| {name} | {r1['p50']:.3f} | {r1['p99']:.3f} | {r1['mean']:.3f} | {r2['p50']:.3f} | "
                f"{r2['p99']:.3f} | {r2['mean']:.3f} |")
        base50 = statistics.fmean(r["p50"] for r in ka["plain"])
        base99 = statistics.fmean(r["p99"] for r in ka["plain"])
        for name in cas:
            d50 = statistics.fmean(r["p50"] for r in ka[name]) - base50
            d99 = statistics.fmean(r["p99"] for r in ka[name]) - base99
            say(f"\n{name} over plain, kept alive (mean of two runs): p50 **{d50:+.3f} ms**, p99 **{d99:+.3f} ms**.")
    finally:
        for e in edges.values():
            e.stop()
        stack.close()
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
