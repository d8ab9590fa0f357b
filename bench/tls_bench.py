"""What TLS termination costs, measured side by side in one run against the same backend (nginx).

    python -m bench.tls_bench                  # ~2 minutes; --quick for ~40 s
    python -m bench.tls_bench --out docs/journal/bench-tls.md

Three edges on one backend: plain HTTP, TLS with an ECDSA P-256 certificate, TLS with RSA-2048.
1. New connections per second: closed loop, 4 client threads, each connection does connect (+ a full
   TLS handshake: no session resumption), one GET with Connection: close, read to the close. Also the
   edge's CPU ms per connection (from /proc), the figure that does not depend on the client's speed.
2. Requests over one kept-alive connection: N sequential GETs, ms p50 / p99 / mean per request.
3. Session resumption (ECDSA edge): new connections as in 1, each client thread offering the session of
   its previous connection (SSLSocket.session), TLS 1.3 and TLS 1.2, against full handshakes; the share
   that resumed; and the same with --workers 2 (each worker has its own ticket keys: see the README).
4. SNI with 100 certificates: the sni_callback's own cost per handshake (in-process, a name from the
   middle of the set, a wildcard, an unknown one), the time to build the 100 contexts (start, SIGHUP),
   and new connections/s + edge CPU per connection naming certificate 57 vs an edge with one certificate.

    python -m bench.tls_bench --sections 3,4   # only the resumption and SNI parts

Each row runs twice, interleaved (plain, ECDSA, RSA, plain, ...), because this 2-core machine is shared.
The client is Python (ssl), pinned with nginx to one CPU; the edges to the other.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
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
from tests.support import Edge, wait_until  # noqa: E402
from wrk.nginx_target import nginx_target  # noqa: E402
from wrk.placement import describe, place  # noqa: E402

REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"
CLOSE = b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"


def client_ctx(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def one_connection(port: int, ctx: ssl.SSLContext | None, session=None, name: str = "127.0.0.1"):
    """One connection, one GET, read to the close; the TLS session (a ticket to offer next time) and
    whether this one was resumed."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    # no Nagle: a TLS 1.2 resumed handshake ends with the client's Finished and its request in two
    # small writes, and the second would wait out the edge's delayed ACK (40 ms) -- the client's artefact
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        if ctx is not None:
            s = ctx.wrap_socket(s, server_hostname=name, session=session)
        s.sendall(CLOSE)
        out = b""
        while chunk := s.recv(65536):
            out += chunk   # (TLS 1.3 tickets arrive after the handshake: read before taking the session)
        assert out.startswith(b"HTTP/1.1 200"), out[:100]
        return (s.session, s.session_reused) if ctx is not None else (None, False)
    finally:
        s.close()


def connections_per_second(port: int, ctx, pid: int, seconds: float, threads: int = 4, resume: bool = False,
                           name: str = "127.0.0.1", reused: list | None = None) -> tuple[float, float]:
    """(connections/s, edge CPU ms per connection). resume: each thread offers its last session;
    `reused` gets [resumed, connections]."""
    stop = time.monotonic() + seconds
    counts = [0] * threads
    hits = [0] * threads

    def loop(i):
        session = None
        while time.monotonic() < stop:
            new, was = one_connection(port, ctx, session if resume else None, name)
            session = new if resume else None
            counts[i] += 1
            hits[i] += was

    c0, t0 = cpu_seconds(pid), time.monotonic()
    ts = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    elapsed, cpu = time.monotonic() - t0, cpu_seconds(pid) - c0
    n = sum(counts)
    if reused is not None:
        reused[:] = [sum(hits), n]
    return n / elapsed, cpu * 1000 / max(n, 1)


def sni_callback_cost(tmp: Path, ca: trustme.CA, certs: list[tuple[str, str]], rounds: int = 200_000) -> dict:
    """Microseconds per sni_callback call (in this process) and seconds to build the contexts."""
    from lb.http.tls import CertSpec, listener_context
    t = time.perf_counter()
    ctx = listener_context(CertSpec(*certs[0]), tuple(CertSpec(*c) for c in certs[1:]))
    build = time.perf_counter() - t

    class Obj:   # what the callback touches of an SSLObject: its context
        context = None
    out = {"build": build}
    for label, name in (("exact (certificate 57)", "host57.bench.example"), ("wildcard", "x.wild99.bench.example"),
                        ("unknown -> default", "nobody.example")):
        o = Obj()
        cb = ctx.sni_callback
        t = time.perf_counter()
        for _ in range(rounds):
            cb(o, name, ctx)
        out[label] = (time.perf_counter() - t) / rounds * 1e6
    return out


def many_certificates(tmp: Path, ca: trustme.CA, n: int) -> list[tuple[str, str]]:
    """n ECDSA certificates: the first for 127.0.0.1 (the default), then host1..host{n-2}.bench.example,
    the last a wildcard *.wild99.bench.example."""
    out = []
    for i in range(n):
        ids = (("127.0.0.1",) if i == 0 else ("*.wild99.bench.example",) if i == n - 1
               else (f"host{i}.bench.example",))
        leaf = ca.issue_cert(*ids)
        cert, key = tmp / f"sni{i}.crt", tmp / f"sni{i}.key"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        out.append((str(cert), str(key)))
    return out


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
    ap.add_argument("--sections", default="1,2,3,4", help="which parts to run, e.g. 3,4")
    a = ap.parse_args()
    seconds, n = (3, 1000) if a.quick else (8, 4000)
    sections = {int(x) for x in a.sections.split(",")}

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
        cmd = "python -m bench.tls_bench" + (" --quick" if a.quick else "") + (
            f" --sections {a.sections}" if sections != {1, 2, 3, 4} else "")
        say(f"\nCommand: `{cmd}`. Backend: nginx `return 200`. "
            f"Placement: {describe(load_cpu, pin)}. Client: Python ssl, TLS 1.3 (the edge's default "
            f"offer), full handshakes (no resumption) but in part 3. The machine is shared with other work: "
            f"ratios, not absolute figures, are the point.\n")
        if 1 in sections:
            connection_rates(say, edges, ctxs, cas, seconds)
        if 2 in sections:
            kept_alive_rows(say, edges, ctxs, cas, n)
        if 3 in sections:
            resumption(say, edges["TLS ECDSA P-256"], cas["TLS ECDSA P-256"], tmp, backend, pin, seconds)
        if 4 in sections:
            sni(say, tmp, backend, pin, seconds)
    finally:
        for e in edges.values():
            e.stop()
        stack.close()
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


def connection_rates(say, edges, ctxs, cas, seconds) -> None:
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


def kept_alive_rows(say, edges, ctxs, cas, n) -> None:
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


def resumption(say, edge, ca, tmp, backend, pin, seconds) -> None:
    say(f"\n## 3. Session resumption (ECDSA P-256 edge), 4 client threads, {seconds}s per run\n")
    say("| client | conn/s run 1 | conn/s run 2 | edge CPU ms/conn run 1 | run 2 | resumed |")
    say("|---|---|---|---|---|---|")
    tls12 = client_ctx(ca)
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    rows = {}
    for label, ctx, resume in (("TLS 1.3 full", client_ctx(ca), False), ("TLS 1.3 resumed", client_ctx(ca), True),
                               ("TLS 1.2 full", tls12, False), ("TLS 1.2 resumed", tls12, True)):
        runs, hits = [], [0, 0]
        for _ in range(2):
            r = [0, 0]
            runs.append(connections_per_second(edge.port, ctx, edge.popen.pid, seconds, resume=resume, reused=r))
            hits = [hits[0] + r[0], hits[1] + r[1]]
        rows[label] = runs
        say(f"| {label} | {runs[0][0]:,.0f} | {runs[1][0]:,.0f} | {runs[0][1]:.3f} | {runs[1][1]:.3f} | "
            f"{hits[0]:,} of {hits[1]:,} |")
    for v in ("1.3", "1.2"):
        full, res = rows[f"TLS {v} full"], rows[f"TLS {v} resumed"]
        fr, rr = statistics.fmean(r[0] for r in full), statistics.fmean(r[0] for r in res)
        fc, rc = statistics.fmean(r[1] for r in full), statistics.fmean(r[1] for r in res)
        say(f"\nTLS {v}: resumed **{rr:,.0f}/s** vs full **{fr:,.0f}/s** ({rr / fr:.2f}x); edge CPU "
            f"**{rc:.3f}** vs **{fc:.3f} ms** per connection ({rc / fc:.2f}x).")
    # Two workers: they inherit the supervisor's context (one set of ticket keys) until a SIGHUP, after
    # which each has made its own.
    cert, key = tmp / "w.crt", tmp / "w.key"
    leaf = ca.issue_cert("127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    w = Edge("--backends", backend, "--health-interval", "30", "--tls-cert", str(cert), "--tls-key", str(key),
             "--workers", "2", "--cpu-affinity", "off", name="bench-tls-workers")
    try:
        w.wait_log(r"all 2 workers ready")
        r = [0, 0]
        connections_per_second(w.port, client_ctx(ca), w.popen.pid, seconds, resume=True, reused=r)
        w.signal(signal.SIGHUP)
        wait_until(lambda: w.log().count("reloaded:") >= 2, what="both workers reloaded")
        r1 = [0, 0]
        connections_per_second(w.port, client_ctx(ca), w.popen.pid, seconds, resume=True, reused=r1)
    finally:
        w.stop()
    say(f"\nTLS 1.3, resuming, `--workers 2`: **{r[0] / max(r[1], 1):.0%}** of connections resumed "
        f"({r[0]:,} of {r[1]:,}) with the context the workers inherited from the supervisor (one set of "
        f"ticket keys); after a SIGHUP (each worker made its own context, so its own keys) "
        f"**{r1[0] / max(r1[1], 1):.0%}** ({r1[0]:,} of {r1[1]:,}): a ticket is then good at its own worker only.")


def sni(say, tmp, backend, pin, seconds) -> None:
    ca = trustme.CA()
    certs = many_certificates(tmp, ca, 100)
    c = sni_callback_cost(tmp, ca, certs)
    say("\n## 4. SNI with 100 certificates (ECDSA P-256)\n")
    say(f"Building the 100 contexts (start-up, and every SIGHUP): **{c['build'] * 1000:.0f} ms**. The "
        f"sni_callback, per handshake, in-process: " + ", ".join(
            f"{k} **{v:.2f} us**" for k, v in c.items() if k != "build") + ".\n")
    conf = tmp / "sni.toml"
    conf.write_text(f'[tls]\ncert = "{certs[0][0]}"\nkey = "{certs[0][1]}"\n' + "".join(
        f'[[tls.certificates]]\ncert = "{a}"\nkey = "{b}"\n' for a, b in certs[1:]))
    many = Edge("--config", str(conf), "--backends", backend, "--health-interval", "30", *pin, name="bench-sni")
    one = Edge("--backends", backend, "--health-interval", "30", "--tls-cert", certs[57][0], "--tls-key",
               certs[57][1], *pin, name="bench-sni-one")
    try:
        say("| edge | conn/s run 1 | conn/s run 2 | edge CPU ms/conn run 1 | run 2 |")
        say("|---|---|---|---|---|")
        # (a client naming an IP address sends no SNI: the callback runs, finds nothing, switches nothing)
        rows = (("1 certificate (no callback)", one, "host57.bench.example"),
                ("100 certificates, no SNI: the default", many, "127.0.0.1"),
                ("100 certificates, SNI picks #57", many, "host57.bench.example"))
        res = {label: [] for label, _, _ in rows}
        for _ in range(2):
            for label, e, name in rows:
                res[label].append(connections_per_second(e.port, client_ctx(ca), e.popen.pid, seconds, name=name))
        for label, runs in res.items():
            say(f"| {label} | {runs[0][0]:,.0f} | {runs[1][0]:,.0f} | {runs[0][1]:.3f} | {runs[1][1]:.3f} |")
    finally:
        many.stop()
        one.stop()


if __name__ == "__main__":
    main()
