"""A bounded soak: good traffic, a slowloris crowd, and backends killed and restarted, all at once.

    python -m bench.soak --seconds 180 --redis     # the figures in the README
    (tests/test_soak.py runs the same thing for ~20 s in CI)

Good clients send GET /echo?id=<unique> on keep-alive connections and check that each answer carries
their own id: a request lost, answered twice or answered with another's body is counted. The edge's
threads, open fds and RSS are sampled throughout. Everything targets 127.0.0.1 and stops by itself.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import Backend, Edge, request, wait_until  # noqa: E402


def proc_stats(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    field = {line.split(":")[0]: line.split(":")[1].split() for line in status.splitlines() if ":" in line}
    return {"threads": int(field["Threads"][0]), "rss_mb": int(field["VmRSS"][0]) / 1024,
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


# --thread-cache: connection threads kept parked when the crowd has gone. Few, so that a leak of the
# slowloris crowd's threads still shows above them, and some, so that the chaos runs through the cache.
THREAD_CACHE = 4


def run(seconds: float = 20.0, clients: int = 4, slowloris: int = 40, chaos_every: float = 3.0,
        redis_restart=None, extra_edge_args=()) -> dict:
    backends = [Backend(n) for n in ("s1", "s2", "s3")]
    edge = Edge("--backends", ",".join(b.url for b in backends), "--health-interval", "0.25",
                "--unhealthy-threshold", "2", "--healthy-threshold", "2", "--header-timeout", "2",
                "--max-connections", str(slowloris + clients + 50), "--read-timeout", "5",
                "--thread-cache", str(THREAD_CACHE), *extra_edge_args, name="soak-edge")
    ids = itertools.count()
    lock = threading.Lock()
    res = {"sent": 0, "answered": {}, "lost": 0, "mismatched": 0, "latencies": [], "slowloris_cut": 0,
           "slowloris_held_max": 0, "backend_restarts": 0, "redis_restarts": 0}
    stop = threading.Event()

    def good_client():
        conn = http.client.HTTPConnection("127.0.0.1", edge.port, timeout=10)
        while not stop.is_set():
            rid = next(ids)
            t = time.monotonic()
            try:
                r = request(edge.port, "GET", f"/echo?id={rid}", {"X-Api-Key": f"good-{rid % 7}"}, conn=conn)
            except (OSError, http.client.HTTPException):
                with lock:
                    res["sent"] += 1
                    res["lost"] += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", edge.port, timeout=10)
                continue
            dt = time.monotonic() - t
            with lock:
                res["sent"] += 1
                res["answered"][r.status] = res["answered"].get(r.status, 0) + 1
                if r.status == 200:
                    res["latencies"].append(dt)
                    if json.loads(r.body)["target"] != f"/echo?id={rid}":
                        res["mismatched"] += 1
            if r.header("Connection") == "close":
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", edge.port, timeout=10)

    held = []

    def loris():
        # Keeps `slowloris` connections open, each trickling a header byte every 0.5 s; reconnects when cut.
        socks = []
        while not stop.is_set():
            while len(socks) < slowloris:
                try:
                    s = socket.create_connection(("127.0.0.1", edge.port), timeout=2)
                    s.setblocking(False)
                    s.send(b"GET / HTTP/1.1\r\nHost: x\r\n")
                    socks.append(s)
                except OSError:
                    break
            alive = []
            for s in socks:
                try:
                    s.send(b"X")
                    try:
                        if s.recv(100) is not None:   # answered (408) or closed: the edge cut it off
                            res["slowloris_cut"] += 1
                            s.close()
                            continue
                    except BlockingIOError:
                        pass
                    alive.append(s)
                except OSError:
                    res["slowloris_cut"] += 1
                    s.close()
            socks = alive
            held.append(len(socks))
            stop.wait(0.5)
        for s in socks:
            s.close()

    def chaos():
        i = 0
        while not stop.wait(chaos_every):
            b = backends[i % len(backends)]
            port = b.port
            b.kill()
            stop.wait(chaos_every / 2)
            backends[i % len(backends)] = Backend(b.name.split("-", 1)[1], port=port)
            res["backend_restarts"] += 1
            if redis_restart is not None and i % 2 == 1:
                redis_restart()
                res["redis_restarts"] += 1
            i += 1

    samples = []
    try:
        request(edge.port, "GET", "/")
        start = proc_stats(edge.popen.pid)
        threads = [threading.Thread(target=good_client, daemon=True) for _ in range(clients)]
        threads += [threading.Thread(target=loris, daemon=True), threading.Thread(target=chaos, daemon=True)]
        for t in threads:
            t.start()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            samples.append(proc_stats(edge.popen.pid))
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(15)
        # after the crowd has gone: everything the attack held must be given back (but the threads the
        # cache keeps parked for the next connections)
        wait_until(lambda: proc_stats(edge.popen.pid)["threads"] <= start["threads"] + clients + 2 + THREAD_CACHE,
                   timeout=10, what="threads to come back down")
        try:   # closing is asynchronous too (a thread's socket after its last byte): give it a moment, no more
            wait_until(lambda: proc_stats(edge.popen.pid)["fds"] <= start["fds"] + 10, timeout=5,
                       what="descriptors to come back down")
        except AssertionError:
            pass    # what is still open is reported in "end" (and judged by the caller)
        res["end"] = proc_stats(edge.popen.pid)
        res["start"] = start
        res["high"] = {k: max(s[k] for s in samples) for k in ("threads", "fds", "rss_mb")}
        res["slowloris_held_max"] = max(held or [0])
        lat = sorted(res.pop("latencies"))
        res["good_p50_ms"] = round(lat[len(lat) // 2] * 1000, 2) if lat else None
        res["good_p99_ms"] = round(lat[int(len(lat) * 0.99)] * 1000, 2) if lat else None
        res["edge_alive"] = edge.alive()
        log = edge.log()
        res["tracebacks"] = log.count("Traceback")
        res["log_lines"] = {k: log.count(k) for k in (" DOWN:", " UP:", " connect:", " reset:", " timeout:",
                                                      " 408 ", "unavailable", "back after")}
        res["seconds"] = seconds
    finally:
        stop.set()
        edge.stop()
        for b in backends:
            b.stop()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--slowloris", type=int, default=100)
    ap.add_argument("--redis", action="store_true", help="limit through a redis-server of its own, "
                    "killed and restarted every other backend restart")
    a = ap.parse_args()
    if a.redis:
        from tests.redis_server import RedisServer
        server = RedisServer().start()

        def restart():
            server.kill()
            server.start()

        try:
            r = run(a.seconds, a.clients, a.slowloris, redis_restart=restart,
                    extra_edge_args=("--limit", "1000000/s", "--store", server.url))
        finally:
            server.stop()
    else:
        r = run(a.seconds, a.clients, a.slowloris)
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
