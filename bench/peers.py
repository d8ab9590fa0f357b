"""The edge beside other proxies, measured the same way in one sitting: req/s and proxy CPU per request.

    python3 bench/peers.py [--seconds 8] [--rounds 3] [--connections 32] [--only edge,nginx]
                           [--peer-python /tmp/venv/bin/python]

Every proxy runs pinned alone on the last CPU, wrk (-t1, closed loop) and one nginx backend (`return 200`,
wrk/nginx_target.py) on the first (wrk/placement.py); the edge on Redis talks to a redis-server pinned
with the load, so Redis's own CPU is not counted. Rounds interleave (every proxy once per round) so a noisy
minute hits them all; the table shows the median round. CPU per request is the proxy's process tree's
CPU time (/proc/PID/stat utime+stime, every live descendant too: proxy.py forks acceptors) over the
requests wrk completed; switches per request the same tree's context switches (every thread's, from
/proc/PID/task/*/status), a count the machine's noise leaves alone where CPU time moves 10-40%.

The peers and their configurations (bench/peers/):
  nginx        one worker, upstream keepalive 64 (wrk/nginx_target.py's proxy role)
  haproxy      haproxy.cfg: nbthread 1, http-reuse always
  caddy        Caddyfile, GOMAXPROCS=1
  proxy.py     proxypy_reverse.py: --threaded, one worker, one acceptor, its reverse-proxy plugin
  twisted      twisted_proxy.py: twisted.web.proxy.ReverseProxyResource
  edge         python3 edge.py --backends ... (this checkout)
  edge-limit   + --limit 10000000/s (memory store; every request admitted)
  edge-redis   + --store redis://... (the same limit in Redis)
  floor        floor_threads.py: the least a thread-per-connection Python proxy can do (no parsing, no
               checks, no pool: one recv, one sendall each way) -- the model's own cost, not a product

--edge NAME=DIR[,arg=FLAG][,python=PATH]... adds a row: the edge of another checkout (`git archive REV | tar
-x -C DIR`) with the plain edge's flags and any extra ones, interleaved with the rest -- a before/after beside
nginx in one sitting, e.g. --edge before=/tmp/edge-main --edge before-limit=/tmp/edge-main,arg=--limit=10000000/s;
python=PATH runs that row's edge with another interpreter (e.g. --edge pgo=.,python=/usr/bin/python3: the
same code under another build of CPython). The other rows run under the Python that runs this script.

Install the peers outside the project's requirements:
  apt-get install -y nginx-light haproxy caddy
  python3 -m venv /tmp/peers && /tmp/peers/bin/pip install proxy.py twisted   # then --peer-python /tmp/peers/bin/python
A peer whose program is missing is reported as such and left out; the rest still run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from wrk.nginx_target import run_nginx  # noqa: E402
from wrk.placement import machine, place  # noqa: E402

PEERS_DIR = ROOT / "bench" / "peers"
TICK = os.sysconf("SC_CLK_TCK")
ORDER = ("nginx", "haproxy", "edge", "edge-limit", "edge-redis", "caddy", "proxy.py", "twisted", "floor")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def tree(pid: int) -> list[int]:
    """pid and every live descendant."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
    return out


def cpu_seconds(pid: int) -> float:
    total = 0
    for p in tree(pid):
        with contextlib.suppress(OSError):
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
    return total / TICK


def thread_switches(pid: int) -> dict[tuple[int, str], int]:
    """{(process, thread): its context switches so far (voluntary and not)} over pid's tree."""
    out = {}
    for p in tree(pid):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    n = 0
                    for line in Path(f"/proc/{p}/task/{task}/status").read_text().splitlines():
                        if "ctxt_switches:" in line:
                            n += int(line.split()[1])
                    out[(p, task)] = n
    return out


class Switches:
    """The context switches of pid's tree while a run lasts, every thread's: unlike CPU time, a count this
    shared machine's noise hardly moves, and each is a wait or a GIL hand-off. Sampled every 0.2 s, since a
    thread's count leaves /proc with the thread (the floor's end with their connections): a thread that
    exits loses at most its last 0.2 s; one born during the run counts from zero."""

    def __init__(self, pid: int):
        self.pid, self.first, self.last = pid, thread_switches(pid), {}
        self.done = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self) -> None:
        while True:
            self.last.update(thread_switches(self.pid))
            if self.done.wait(0.2):
                return

    def stop(self) -> int:
        self.done.set()
        self.sampler.join()
        self.last.update(thread_switches(self.pid))
        return sum(n - self.first.get(t, 0) for t, n in self.last.items())


def wrk(port: int, pid: int, seconds: float, connections: int) -> tuple[float, float, int, float]:
    """(req/s, proxy CPU µs per request, errors, proxy context switches per request) of one closed-loop run."""
    c0, sw = cpu_seconds(pid), Switches(pid)
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", f"http://127.0.0.1:{port}/"],
                         capture_output=True, text=True, timeout=seconds + 60).stdout
    cpu, switched = cpu_seconds(pid) - c0, sw.stop()
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if m is None:
        raise RuntimeError(out[-1500:])
    rps = float(m.group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    errors = sum(int(x) for x in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rps, cpu * 1e6 / max(total, 1), errors + (int(non2xx.group(1)) if non2xx else 0), switched / max(total, 1)


class Peer:
    """A started proxy: its port, the pid whose tree's CPU is counted, and how to stop it."""

    def __init__(self, name: str, port: int, proc: subprocess.Popen | None = None, pid: int | None = None,
                 stop=None):
        self.name, self.port, self.proc = name, port, proc
        self.pid = pid if pid is not None else proc.pid
        self._stop = stop

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def spawn(name: str, argv: list[str], cpu: int, port: int, env: dict | None = None, cwd=None) -> Peer:
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    deadline = time.monotonic() + 20
    while not listening(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            raise RuntimeError(f"{name} did not start: {log.read().decode(errors='replace')[-2000:]}")
        time.sleep(0.05)
    return Peer(name, port, proc)


def version(argv: list[str]) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        return (r.stdout + r.stderr).strip().splitlines()[0]
    return "?"


def edge_argv(checkout: Path, port: int, backend: int, cpu: int, python: str = sys.executable) -> list[str]:
    return [python, str(checkout / "edge.py"), "--listen", f"127.0.0.1:{port}", "--backends",
            f"http://127.0.0.1:{backend}", "--health-interval", "30", "--cpu-affinity", str(cpu)]


def start_other_edge(name: str, spec: str, cpu: int, backend: int) -> Peer:
    """--edge NAME=DIR[,arg=FLAG][,python=PATH]...: another checkout's edge, the plain edge's flags and the
    extra ones, run by this Python or the one named (another build of the interpreter: the same code)."""
    where, *opts = spec.split(",")
    extra = [o[4:] for o in opts if o.startswith("arg=")]
    pythons = [o[7:] for o in opts if o.startswith("python=")]
    if len(extra) + len(pythons) != len(opts) or len(pythons) > 1:
        raise SystemExit(f"--edge {name}: only arg=FLAG and one python=PATH are known, not {opts}")
    port = free_port()
    checkout = Path(where).resolve()
    argv = edge_argv(checkout, port, backend, cpu, *pythons)
    return spawn(name, [*argv, *extra], cpu, port, cwd=checkout)


def start(name: str, cpu: int, backend: int, redis_url: str, py: str, stack: contextlib.ExitStack) -> Peer:
    port = free_port()
    env = {"PEER_PORT": str(port), "BACKEND_PORT": str(backend)}
    if name == "nginx":
        n = stack.enter_context(run_nginx(proxy_to=backend, cpu=cpu))
        deadline = time.monotonic() + 10
        while n.pid_of_worker() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return Peer(name, n.port, pid=n.pid_of_worker())
    if name == "haproxy":
        return spawn(name, ["haproxy", "-db", "-f", str(PEERS_DIR / "haproxy.cfg")], cpu, port, env)
    if name == "caddy":
        home = stack.enter_context(tempfile.TemporaryDirectory(prefix="caddy-"))
        return spawn(name, ["caddy", "run", "--config", str(PEERS_DIR / "Caddyfile"), "--adapter", "caddyfile"],
                     cpu, port, {**env, "GOMAXPROCS": "1", "HOME": home, "XDG_DATA_HOME": home,
                                 "XDG_CONFIG_HOME": home})
    if name == "proxy.py":
        return spawn(name, [py, "-m", "proxy", "--hostname", "127.0.0.1", "--port", str(port), "--threaded",
                            "--num-workers", "1", "--num-acceptors", "1", "--enable-reverse-proxy",
                            "--plugins", "proxypy_reverse.ToBackend", "--log-level", "ERROR"], cpu, port,
                     {"PEER_BACKEND": f"http://127.0.0.1:{backend}", "PYTHONPATH": str(PEERS_DIR)})
    if name == "floor":
        return spawn(name, [sys.executable, str(PEERS_DIR / "floor_threads.py"), str(port), str(backend)], cpu, port)
    if name == "twisted":
        return spawn(name, [py, str(PEERS_DIR / "twisted_proxy.py"), str(port), str(backend)], cpu, port)
    edge = edge_argv(ROOT, port, backend, cpu)
    if name in ("edge-limit", "edge-redis"):
        edge += ["--limit", "10000000/s"]
    if name == "edge-redis":
        edge += ["--store", redis_url, "--redis-timeout", "1"]
    return spawn(name, edge, cpu, port, cwd=ROOT)


def versions(py: str) -> dict:
    return {
        "nginx": version(["nginx", "-v"]).replace("nginx version: ", ""),
        "haproxy": " ".join(version(["haproxy", "-v"]).split()[:3:2]),
        "caddy": "caddy " + version(["caddy", "version"]),
        "proxy.py": "proxy.py " + version([py, "-c", "import importlib.metadata as m; print(m.version('proxy.py'))"]),
        "twisted": "Twisted " + version([py, "-c", "import twisted; print(twisted.__version__)"]),
        "edge": f"edge {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip()}, "
                f"Python {sys.version.split()[0]}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0, help="per wrk run (default 8)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--connections", type=int, default=32, help="wrk -c (default 32)")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(ORDER)}")
    ap.add_argument("--peer-python", default=sys.executable,
                    help="the Python that has proxy.py and Twisted installed (default: this one)")
    ap.add_argument("--edge", action="append", default=[], metavar="NAME=DIR[,arg=FLAG][,python=PATH]",
                    help="another checkout's edge as one more row (repeatable)")
    a = ap.parse_args()
    others: dict[str, str] = {}
    for e in a.edge:  # a name a row already has would replace that row's figures without a word
        name, _, spec = e.partition("=")
        if name in ORDER or name in others or not spec:
            ap.error(f"--edge {e}: give a NAME=DIR whose name is new (not one of {', '.join(ORDER)}, nor twice)")
        others[name] = spec
    names = [n for n in ORDER if not a.only or n in a.only.split(",")]
    if not shutil.which("wrk"):
        sys.exit("wrk not found (apt-get install wrk)")
    load_cpu, pin = place()          # this process, nginx, Redis and wrk: the first CPU
    cpu = int(pin[-1]) if pin else 0
    rows: dict[str, list] = {}
    with contextlib.ExitStack() as stack:
        backend = stack.enter_context(run_nginx()).port
        redis_url = ""
        if "edge-redis" in names:
            rport = free_port()
            rdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="peers-redis-"))
            rproc = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", rdir], stdout=subprocess.DEVNULL)
            stack.callback(lambda: (rproc.terminate(), rproc.wait(5)))
            while not listening(rport):
                time.sleep(0.05)
            redis_url = f"redis://127.0.0.1:{rport}/0"
        peers = {}
        for n in names:
            try:
                peers[n] = start(n, cpu, backend, redis_url, a.peer_python, stack)
                stack.callback(peers[n].stop)
            except (RuntimeError, OSError) as e:
                print(f"# {n} left out: {str(e).splitlines()[0] if str(e) else type(e).__name__}", flush=True)
        for n, spec in others.items():
            peers[n] = start_other_edge(n, spec, cpu, backend)
            stack.callback(peers[n].stop)
        for p in peers.values():     # warm-up: pools filled, code paths and caches hot
            wrk(p.port, p.pid, 1, a.connections)
        for r in range(a.rounds):
            for n, p in peers.items():
                row = wrk(p.port, p.pid, a.seconds, a.connections)
                rows.setdefault(n, []).append(row)
                print(f"# round {r + 1} {n}: {row[0]:,.0f} req/s, {row[1]:.1f} µs/request, {row[3]:.2f} "
                      f"switches/request, {row[2]} errors", flush=True)
    vs = versions(a.peer_python)
    print(f"\n`python3 bench/peers.py --seconds {a.seconds:g} --rounds {a.rounds} --connections {a.connections}"
          f"{'' if a.peer_python == sys.executable else ' --peer-python ' + a.peer_python}"
          f"{' --only ' + a.only if a.only else ''}{''.join(' --edge ' + e for e in a.edge)}`"
          f" ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}, load average "
          f"{os.getloadavg()[0]:.1f}): each proxy pinned to CPU {cpu}, wrk -t1 -c{a.connections} and the nginx "
          f"backend on CPU {load_cpu}; median of {a.rounds} interleaved rounds.\n")
    print("| proxy | version | req/s (each round) | req/s | proxy CPU µs/request | x nginx | switches/request "
          "| errors |\n|---|---|---|---:|---:|---:|---:|---:|")
    base = None
    ref = statistics.median(x[1] for x in rows["nginx"]) if "nginx" in rows else None
    for n, xs in rows.items():
        rps = statistics.median(x[0] for x in xs)
        cpu_us = statistics.median(x[1] for x in xs)
        if n == "edge":
            base = cpu_us
        extra = f" (+{cpu_us - base:.1f})" if n in ("edge-limit", "edge-redis") and base is not None else ""
        label = {"edge-limit": "edge --limit (memory)", "edge-redis": "edge --limit on Redis"}.get(n, n)
        ver = others.get(n) or vs.get(n, vs["edge"] if n.startswith("edge") else "")
        times = f"{cpu_us / ref:.2f}x" if ref else ""
        sw = statistics.median(x[3] for x in xs)
        print(f"| {label} | {ver} | {' / '.join(f'{x[0]:,.0f}' for x in xs)} | {rps:,.0f} | {cpu_us:.1f}{extra} | "
              f"{times} | {sw:.2f} | {sum(x[2] for x in xs)} |")
    if "edge-limit" in rows and "edge-redis" in rows:
        m = statistics.median(x[0] for x in rows["edge-limit"])
        r = statistics.median(x[0] for x in rows["edge-redis"])
        print(f"\nedge on Redis / edge on memory, req/s: {r / m:.2f}x")


if __name__ == "__main__":
    main()
