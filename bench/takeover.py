"""Requests lost while a new edge takes over a live port (README "Zero-downtime upgrade"), under load.

    python3 -m bench.takeover                        # 1 process each, --grace 1, 3 rounds
    python3 -m bench.takeover --workers 2 --rounds 5 --grace 0.5

Client threads drive the port the whole time: keep-alive clients (one connection each, reused while the
edge allows it, a new one when a response says Connection: close, as http.client does) and new-connection
clients (one connection per request). While they run: start B with --takeover on A's ports, wait for its
"ready" line, TERM A (which drains), wait for A to exit. A request is lost when it raised (reset, refused,
closed without an answer) or was answered with anything but 200. Reported per round: requests, lost, and
the kernel's net.ipv4.tcp_migrate_req (1: a closing SO_REUSEPORT listener hands its queued connections to
another one; 0: it resets them, and the edge takes what is queued right before it closes).
"""

from __future__ import annotations

import argparse
import http.client
import signal
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

from lb.netaddr import held, migrate_req  # noqa: E402
from tests.support import Backend, Edge, free_port, wait_until  # noqa: E402


class Traffic:
    """Keep-alive and new-connection client threads against 127.0.0.1:port until stop()."""

    def __init__(self, port: int, keepalive: int = 4, fresh: int = 4):
        self.port = port
        self.ok = 0
        self.lost: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._keepalive, daemon=True) for _ in range(keepalive)]
        self.threads += [threading.Thread(target=self._fresh, daemon=True) for _ in range(fresh)]
        for t in self.threads:
            t.start()

    def _one(self, c: http.client.HTTPConnection, close: bool) -> None:
        try:
            c.request("GET", "/", headers={"Connection": "close"} if close else {})
            r = c.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"status {r.status}")
            with self._lock:
                self.ok += 1
        except Exception as e:           # noqa: BLE001 -- every failure is a lost request, named
            with self._lock:
                self.lost.append((time.monotonic(), repr(e)[:120]))
            c.close()

    def _keepalive(self) -> None:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self._stop.is_set():
            self._one(c, close=False)
        c.close()

    def _fresh(self) -> None:
        while not self._stop.is_set():
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            self._one(c, close=True)
            c.close()

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(15)


def admin_ports(n: int) -> int:
    """A base port with n free ports from it (worker i's admin port is BASE + i)."""
    for _ in range(100):
        base = free_port()
        if base + n < 65536 and all(not held("127.0.0.1", base + i) for i in range(n)):
            return base
    raise RuntimeError("no run of free ports")


def take_over(backend_url: str, args: list[str], settle: float = 1.0, new_args: list[str] | None = None) -> dict:
    """One round: A serves, B (with NEW_ARGS, else ARGS) takes over under traffic, A drains and exits. The counts."""
    new_args = args if new_args is None else new_args
    admin = admin_ports(4)
    a = Edge("--backends", backend_url, "--admin", f"127.0.0.1:{admin}", *args, name="edge-a")
    port = a.port
    b = None
    try:
        a.wait_log(r"all \d+ workers ready" if "--workers" in args else r"INFO edge: ready", timeout=20)
        t = Traffic(port)
        time.sleep(settle)
        b = Edge("--backends", backend_url, "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}",
                 "--takeover", *new_args, name="edge-b")
        b.wait_log(r"all \d+ workers ready" if "--workers" in new_args else r"INFO edge: ready", timeout=20)
        t0 = time.monotonic()
        a.signal(signal.SIGTERM)
        wait_until(lambda: not a.alive(), timeout=60, what="the old edge's exit")
        a_done = time.monotonic() - t0
        time.sleep(settle)
        t.stop()
        still = socket.create_connection(("127.0.0.1", port), timeout=5)   # B serves on
        still.close()
        return {"requests": t.ok + len(t.lost), "lost": len(t.lost), "why": sorted({w for _, w in t.lost})[:3],
                "old_exit_s": round(a_done, 2), "queued_taken": a.log().count("queued connections"),
                "handed_over": "--takeover: handed" in a.log()}
    finally:
        a.stop()
        if b is not None:
            b.stop()


def in_private_netns(argv: list[str], timeout: float = 300, migrate_req: int = 1) -> list[dict] | None:
    """Run `python3 -m bench.takeover --json ARGV` in a network namespace of its own with
    net.ipv4.tcp_migrate_req = MIGRATE_REQ (root and unshare(1) needed; the machine's own setting is left
    alone): the rounds' dicts, or None where such a namespace cannot be made here."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return None
    script = (f"ip link set lo up && sysctl -q -w net.ipv4.tcp_migrate_req={int(migrate_req)} && "
              f'exec "$0" -m bench.takeover --json "$@"')
    p = subprocess.run(["unshare", "-n", "sh", "-c", script, sys.executable, *argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 and not p.stdout.strip():
        return None                       # no namespace (a container without CAP_SYS_ADMIN, say)
    rounds = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not rounds:
        raise RuntimeError(f"bench.takeover in a private namespace failed ({p.returncode}): {p.stderr[-2000:]}")
    return rounds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--new-workers", type=int, default=None, help="the new edge's --workers (default: --workers)")
    p.add_argument("--grace", default="1")
    p.add_argument("--json", action="store_true", help="one JSON object per round on stdout, nothing else")
    p.add_argument("--netns-migrate-req", type=int, choices=(0, 1), default=None,
                   help="run the rounds in a network namespace of their own with this net.ipv4.tcp_migrate_req "
                        "(root; the machine's setting is left alone)")
    o = p.parse_args(argv)
    args = ["--grace", o.grace] + (["--workers", str(o.workers)] if o.workers > 1 else [])
    nw = o.workers if o.new_workers is None else o.new_workers
    new_args = ["--grace", o.grace] + (["--workers", str(nw)] if nw > 1 else [])
    if o.netns_migrate_req is not None:
        rounds = in_private_netns(["--rounds", str(o.rounds), "--workers", str(o.workers), "--new-workers", str(nw),
                                   "--grace", o.grace],
                                  timeout=60 * o.rounds + 60, migrate_req=o.netns_migrate_req)
        if rounds is None:
            raise SystemExit("no private network namespace can be made here (root and unshare(1) needed)")
        for i, r in enumerate(rounds):
            print(json.dumps(r) if o.json else f"round {i + 1}: {r}", flush=True)
        print(f"total: {sum(r['lost'] for r in rounds)} of {sum(r['requests'] for r in rounds)} requests lost "
              f"(private namespace, tcp_migrate_req = {o.netns_migrate_req})")
        return
    say = (lambda *a, **k: None) if o.json else print
    say(f"kernel {Path('/proc/sys/kernel/osrelease').read_text().strip()}, "
        f"net.ipv4.tcp_migrate_req = {migrate_req()}, edge args {' '.join(args)}"
        + (f", new edge {' '.join(new_args)}" if new_args != args else ""))
    backend = Backend("t")
    total = lost = 0
    try:
        for i in range(o.rounds):
            r = take_over(backend.url, args, new_args=new_args)
            r["migrate_req"] = migrate_req()
            total += r["requests"]
            lost += r["lost"]
            if o.json:
                print(json.dumps(r), flush=True)
            else:
                print(f"round {i + 1}: {r}", flush=True)
    finally:
        backend.stop()
    say(f"total: {lost} of {total} requests lost")


if __name__ == "__main__":
    main()
