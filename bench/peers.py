"""The edge among its peers (issue 31's table): each proxy pinned alone on one CPU, wrk and an nginx backend
on the other, `wrk -t1 -c32` closed loop, repeats interleaved. Per proxy: req/s and the proxy's own CPU per
request (its process's utime+stime over the run, /proc; the backend's and wrk's are not in it).

    python3 bench/peers.py                                   # every peer found on this machine
    python3 bench/peers.py --peers edge,edge-limit,nginx --repeats 3 --duration 8s
    python3 bench/peers.py --edge main=/work/main --edge new=.   # several edge checkouts side by side

Peers (configurations in bench/peers/): edge (`--limit 1000000/s`, the client keyed: the limiter runs and
never refuses), edge-limit (the same), edge-nolimit (no --limit), nginx (one worker, keep-alive upstream:
wrk/nginx_target.py), haproxy (nbthread 1, http-reuse always: bench/peers/haproxy.cfg), caddy
(GOMAXPROCS=1: bench/peers/Caddyfile), twisted (ReverseProxyResource: bench/peers/twisted_proxy.py). A peer
whose program is not installed is skipped with a line saying so (apt-get install haproxy caddy; pip
install twisted).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.edge_bench import cpu_seconds  # noqa: E402
from tests.support import wait_until  # noqa: E402
from wrk.loadgen import parse_duration  # noqa: E402
from wrk.nginx_target import nginx_target, run_nginx  # noqa: E402
from wrk.placement import describe, place  # noqa: E402

PEERS = Path(__file__).resolve().parent / "peers"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Peer:
    """A proxy as a child process pinned to `cpu`, listening on a free port, proxying to `backend`."""

    def __init__(self, name: str, argv: list[str], cwd: Path = ROOT, env: dict | None = None,
                 config: tuple[str, str] | None = None, version: list[str] | None = None):
        self.name, self.argv, self.cwd, self.env, self.config, self.version_argv = name, argv, cwd, env, config, version

    def available(self) -> bool:
        return shutil.which(self.argv[0]) is not None

    def version(self) -> str:
        if not self.version_argv:
            return ""
        out = subprocess.run(self.version_argv, capture_output=True, text=True, cwd=self.cwd)
        return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else ""

    def start(self, backend: int, cpu: int | None) -> None:
        self.port = _free_port()
        self.tmp = tempfile.mkdtemp(prefix=f"peer-{self.name}-")
        subst = {"{listen}": str(self.port), "{backend}": str(backend), "{tmp}": self.tmp}
        if self.config:                     # (template in bench/peers/, the file it becomes in tmp)
            text = (PEERS / self.config[0]).read_text()
            for k, v in subst.items():
                text = text.replace(k, v)
            Path(self.tmp, self.config[1]).write_text(text)
        argv = [a for a in self.argv]
        for i, a in enumerate(argv):
            for k, v in subst.items():
                a = a.replace(k, v)
            argv[i] = a
        pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
        self.log = open(Path(self.tmp, "log"), "w+")
        self.proc = subprocess.Popen(argv, cwd=self.cwd, env={**os.environ, **(self.env or {})}, preexec_fn=pin,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)

        def up():
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"{self.name} exited: {self.log.read()[-800:]}")
            return _listening(self.port)

        wait_until(up, 20, what=f"{self.name} listening")
        self.pid = self.proc.pid
        self.url = f"http://127.0.0.1:{self.port}/"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class NginxPeer(Peer):
    def __init__(self):
        super().__init__("nginx", ["nginx"], version=["nginx", "-v"])

    def available(self) -> bool:
        return shutil.which("nginx") is not None or Path("/usr/sbin/nginx").exists()

    def start(self, backend: int, cpu: int | None) -> None:
        self.ctx = run_nginx(proxy_to=backend, cpu=cpu)
        n = self.ctx.__enter__()
        self.url = f"http://127.0.0.1:{n.port}/"
        self.pid = wait_until(n.pid_of_worker, 10, what="nginx's worker")

    def stop(self) -> None:
        self.ctx.__exit__(None, None, None)


def edge(name: str, directory: str, *flags: str) -> Peer:
    return Peer(name, [sys.executable, "edge.py", "--listen", "127.0.0.1:{listen}", "--backends",
                       "http://127.0.0.1:{backend}", "--health-interval", "3600", *flags],
                cwd=Path(directory).resolve())


def known(edges: list[tuple[str, str]]) -> dict[str, Peer]:
    peers = {}
    for name, d in edges:
        peers[name] = edge(name, d, "--limit", "1000000/s")
    first = edges[0][1]
    peers["edge-nolimit"] = edge("edge-nolimit", first)
    peers["nginx"] = NginxPeer()
    peers["haproxy"] = Peer("haproxy", ["haproxy", "-db", "-f", "{tmp}/haproxy.cfg"], config=("haproxy.cfg", "haproxy.cfg"),
                            version=["haproxy", "-v"])
    peers["caddy"] = Peer("caddy", ["caddy", "run", "--adapter", "caddyfile", "--config", "{tmp}/Caddyfile"],
                          env={"GOMAXPROCS": "1"}, config=("Caddyfile", "Caddyfile"), version=["caddy", "version"])
    peers["twisted"] = Peer("twisted", [sys.executable, str(PEERS / "twisted_proxy.py"), "{listen}", "{backend}"],
                            version=[sys.executable, "-c", "import twisted; print('Twisted', twisted.__version__)"])
    peers["twisted"].available = lambda: subprocess.run([sys.executable, "-c", "import twisted"],
                                                        capture_output=True).returncode == 0
    return peers


def wrk(url: str, connections: int, seconds: float) -> tuple[float, int]:
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "-H", "X-Api-Key: bench-unlimited", url],
                         capture_output=True, text=True, timeout=seconds + 60).stdout
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)), int(re.search(r"(\d+) requests in", out).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--edge", action="append", help="NAME=DIR: an edge checkout (default: edge=this one)")
    ap.add_argument("--peers", help="comma-separated names (default: the edges, edge-nolimit and every peer found)")
    ap.add_argument("--duration", type=parse_duration, default=8.0)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    edges = [tuple(e.split("=", 1)) for e in (a.edge or [f"edge={ROOT}"])]
    table = known(edges)
    names = a.peers.split(",") if a.peers else [*(n for n, _ in edges), "edge-nolimit", "nginx", "haproxy",
                                                  "caddy", "twisted"]
    peers = []
    for n in names:
        p = table.get(n)
        if p is None:
            raise SystemExit(f"--peers: unknown peer {n!r} (known: {', '.join(table)})")
        if p.available():
            peers.append(p)
        else:
            print(f"# {n}: not installed, skipped", flush=True)
    load_cpu, pin = place()
    cpu = int(pin[-1]) if pin else None
    print(f"# peers: {describe(load_cpu, pin)}; wrk -t1 -c{a.connections} -d{a.duration:g}s; "
          f"load {os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
    for p in peers:
        v = p.version()
        if v:
            print(f"# {p.name}: {v}", flush=True)
    got: dict[str, list[tuple[float, float]]] = {}
    with nginx_target() as backend:
        started = []
        try:
            for p in peers:
                p.start(backend, cpu)
                started.append(p)
                wrk(p.url, 16, 2)                    # warm-up
            for rep in range(1, a.repeats + 1):
                for p in peers:
                    c0 = cpu_seconds(p.pid)
                    rps, total = wrk(p.url, a.connections, a.duration)
                    us = 1e6 * (cpu_seconds(p.pid) - c0) / max(1, total)
                    got.setdefault(p.name, []).append((rps, us))
                    print(f"r{rep} {p.name}: {rps:,.0f} req/s, {us:.1f} us CPU/request (load {os.getloadavg()[0]:.1f})",
                          flush=True)
        finally:
            for p in started:
                p.stop()
    ref = got.get("nginx")
    ref_us = sum(u for _, u in ref) / len(ref) if ref else None
    print("\n| proxy | req/s (mean) | CPU us/request (mean) | per repeat | vs nginx's CPU |\n|---|---|---|---|---|")
    for p in peers:
        rs = got[p.name]
        rps, us = sum(r for r, _ in rs) / len(rs), sum(u for _, u in rs) / len(rs)
        print(f"| {p.name} | {rps:,.0f} | {us:.1f} | {' / '.join(f'{u:.0f}' for _, u in rs)} | "
              f"{us / ref_us:.2f}x |" if ref_us else f"| {p.name} | {rps:,.0f} | {us:.1f} | | |")


if __name__ == "__main__":
    main()
