"""The edge's tail latency and saturation throughput, A/B across variants, interleaved in one sitting.

    python -m bench.tail_bench --variant before=/tmp/edge-before --variant after=. \\
        --rates 1000,2000 --duration 10s --repeats 3 --wrk2 /tmp/wrk2/wrk

A variant is NAME=DIR[,switch=SECONDS][,redis][,env=NAME=VALUE][,arg=--flag=value...]: the edge.py of that checkout
(unpack another revision with `git archive REV | tar -x -C DIR`), optionally with
sys.setswitchinterval(SECONDS) set before it starts, its limit kept on Redis (`redis`: one redis-server
this bench starts on the generator's CPU, so Redis's own CPU is not the edge's; `--store
redis://127.0.0.1:PORT/0 --redis-timeout 1`), an environment variable set (e.g.
`env=EDGE_GC_FREEZE=0`), or extra edge flags. Every variant runs as the protocol
runs it: `--limit 1000000/s`, the client keyed (never limited), nginx behind it, the generator and nginx
on one CPU and every edge on the other (wrk/placement.py).

    python -m bench.tail_bench --variant edge=. --variant edge-redis=.,redis --rates 1000,2000 \\
        --duration 10s --repeats 3 --saturation 0 --wrk2 /tmp/wrk2/wrk

A last variant, "nginx-proxy" (--no-reference to leave it out), is the reference: nginx itself as a
reverse proxy in the edge's place (one worker, keep-alive upstream, pinned to the edge's CPU). What it
adds over nginx direct is what the placement costs on this machine, with no Python in it: a proxy on
another CPU adds four cross-CPU wake-ups per request, which a VM pays for dearly.

Per repeat, in order: nginx direct at each rate, then each variant at each rate (open loop: wrk2 when
--wrk2 is given, else wrk.loadgen; latency from the intended send time), then each variant's saturation
throughput (closed loop, wrk -t1 -c16, as bench/edge_bench.py). Repeats interleave, so a noisy minute
hits every variant. Prints each row as it goes and a Markdown summary: p99 and p99 delta (proxy - nginx
direct, same repeat and rate) for every repeat, and req/s at saturation.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.edge_bench import closed_loop, cpu_seconds  # noqa: E402
from tests.support import free_port, wait_until  # noqa: E402
from wrk.loadgen import parse_duration  # noqa: E402
from wrk.nginx_target import nginx_target, run_nginx  # noqa: E402
from wrk.placement import describe, machine, place  # noqa: E402
from wrk.protocol import detect_wrk2, drive  # noqa: E402

KEY = "bench-unlimited"


class Variant:
    def __init__(self, spec: str):
        name, _, rest = spec.partition("=")
        parts = rest.split(",")
        self.name, self.dir, self.switch, self.args = name, Path(parts[0]).resolve(), None, []
        self.redis, self.env = False, {}
        for p in parts[1:]:
            k, _, v = p.partition("=")
            if k == "switch":
                self.switch = float(v)
            elif k == "redis" and not v:
                self.redis = True
            elif k == "env" and "=" in v:
                name_, _, value = v.partition("=")
                self.env[name_] = value
            elif k == "arg":
                self.args.append(v)
            else:
                raise SystemExit(f"--variant {spec}: unknown option {k!r}")
        if not (self.dir / "edge.py").exists():
            raise SystemExit(f"--variant {spec}: no edge.py in {self.dir}")

    def start(self, backend_url: str, pin: list[str], redis_url: str = "") -> None:
        store = ["--store", redis_url, "--redis-timeout", "1"] if self.redis else []
        argv = ["edge.py", "--listen", "127.0.0.1:0", "--backends", backend_url, "--limit", "1000000/s",
                *pin, *store, *self.args]
        if self.switch is None:
            cmd = [sys.executable, *argv]
        else:
            cmd = [sys.executable, "-c", "import runpy, sys; sys.setswitchinterval(float(sys.argv[1])); "
                   "sys.argv = sys.argv[2:]; runpy.run_path('edge.py', run_name='__main__')",
                   str(self.switch), *argv]
        self.log = tempfile.NamedTemporaryFile(prefix=f"tail-{self.name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=self.dir, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **self.env})

        def port():
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited: {Path(self.log.name).read_text()[-500:]}")
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", Path(self.log.name).read_text())
            return m and int(m.group(1))

        self.port = wait_until(port, 20, what=f"{self.name} listening")
        self.url = f"http://127.0.0.1:{self.port}/"
        self.pid = self.proc.pid

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.unlink(self.log.name)


class NginxProxy:
    """The reference: nginx as a reverse proxy in the edge's place (one worker, keep-alive upstream,
    pinned to the edge's CPU). What it adds over nginx direct is what the placement itself costs on this
    machine -- the wake-ups across CPUs a proxy adds -- with no Python in it."""
    name = "nginx-proxy"

    def start(self, backend_url: str, pin: list[str], redis_url: str = "") -> None:
        self.ctx = run_nginx(proxy_to=int(backend_url.rsplit(":", 1)[1]), cpu=int(pin[-1]) if pin else None)
        n = self.ctx.__enter__()
        try:
            self.url, self.pid = f"http://127.0.0.1:{n.port}/", wait_until(n.pid_of_worker, 10, what="nginx's worker")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.ctx.__exit__(None, None, None)


def start_redis(stack: contextlib.ExitStack) -> str:
    """One redis-server for the `redis` variants, on this process's CPU (the generator's: place() pinned
    us, children inherit it), nothing saved; stopped when the stack closes."""
    port = free_port()
    rdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="tail-redis-"))
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", rdir], stdout=subprocess.DEVNULL)
    stack.callback(lambda: (proc.terminate(), proc.wait(5)))

    def up():
        if proc.poll() is not None:
            raise SystemExit("redis-server exited at start-up")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(up, 10, what="redis-server listening")
    return f"redis://127.0.0.1:{port}/0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, help="NAME=DIR[,switch=S][,redis][,env=K=V][,arg=FLAG]")
    ap.add_argument("--rates", default="1000,2000")
    ap.add_argument("--duration", type=parse_duration, default=10.0, help="each open-loop row")
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--saturation", type=parse_duration, default=6.0, help="closed-loop seconds (0: skip)")
    ap.add_argument("--wrk2", help="the wrk2 binary (else wrk.loadgen)")
    ap.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure nginx as a reverse proxy in the edge's place (default: yes)")
    a = ap.parse_args()
    variants = [Variant(s) for s in a.variant] + ([NginxProxy()] if a.reference else [])
    rates = [float(r) for r in a.rates.split(",") if r]   # --rates "": saturation only
    tool = "wrk2" if a.wrk2 and detect_wrk2(a.wrk2) else "wrk.loadgen"
    if a.wrk2 and tool != "wrk2":
        raise SystemExit(f"--wrk2 {a.wrk2}: not wrk2 (its --help lists no -R)")
    if a.saturation and not shutil.which("wrk"):
        raise SystemExit("saturation runs need wrk (apt-get install wrk), or --saturation 0")
    load_cpu, pin = place()
    p99: dict[tuple[str, float], list[float]] = {}
    delta: dict[tuple[str, float], list[float]] = {}
    sat: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    cpu_at: dict[tuple[str, float], list[float]] = {}      # edge CPU us per request in the open-loop rows
    print(f"# tail_bench: tool {tool}; {machine()}; {describe(load_cpu, pin)}; load {os.getloadavg()[0]:.2f}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
    with nginx_target() as nport, contextlib.ExitStack() as stack:
        base_url = f"http://127.0.0.1:{nport}/"
        redis_url = start_redis(stack) if any(getattr(v, "redis", False) for v in variants) else ""
        started = []
        try:
            for v in variants:
                v.start(base_url.rstrip("/"), pin, redis_url)
                started.append(v)
            for v in variants if rates else ():   # warm-up, not reported
                drive(tool, v.url, rates[0], 2, a.connections, KEY, "wrk/keyed.lua", a.wrk2 or "wrk")
            for rep in range(1, a.repeats + 1):
                for rate in rates:
                    b = drive(tool, base_url, rate, a.duration, a.connections, None, None, a.wrk2 or "wrk")
                    bp = b["latency_ms"]["p99"]
                    p99.setdefault(("nginx", rate), []).append(bp)
                    print(f"r{rep} {rate:g}/s nginx p99 {bp:.2f} (load {os.getloadavg()[0]:.2f})", flush=True)
                    for v in variants:
                        c0 = cpu_seconds(v.pid)
                        r = drive(tool, v.url, rate, a.duration, a.connections, KEY, "wrk/keyed.lua",
                                  a.wrk2 or "wrk")
                        us = 1e6 * (cpu_seconds(v.pid) - c0) / max(1, r["completed"] or 0)
                        cpu_at.setdefault((v.name, rate), []).append(us)
                        ep = r["latency_ms"]["p99"]
                        p99.setdefault((v.name, rate), []).append(ep)
                        delta.setdefault((v.name, rate), []).append(ep - bp)
                        bad = {k: n for k, n in r["status"].items() if k != "200"} or r.get("non_2xx_3xx")
                        print(f"r{rep} {rate:g}/s {v.name} p99 {ep:.2f} delta {ep - bp:+.2f}, CPU {us:.0f} us/req"
                              + (f" NON-200 {bad}" if bad else "") + ("" if r["kept_up"] else " NOT KEPT UP"),
                              flush=True)
                if a.saturation:
                    for v in variants:
                        rps, cpu_ms = closed_loop(v.url, v.pid, a.saturation)
                        sat.setdefault(v.name, []).append(rps)
                        cpu.setdefault(v.name, []).append(cpu_ms)
                        print(f"r{rep} saturation {v.name} {rps:,.0f} req/s, {cpu_ms:.3f} CPU ms/req", flush=True)
        finally:
            for v in started:
                v.stop()
    if rates:
        print_latency(a, tool, rates, variants, p99, delta, cpu_at)
    if sat:
        print_saturation(variants, sat, cpu)


def print_latency(a, tool, rates, variants, p99, delta, cpu_at) -> None:
    print(f"\n## p99 ms (and delta vs nginx direct, same repeat) per repeat; tool {tool}, "
          f"-c{a.connections}, {a.duration:g}s rows; load at end {os.getloadavg()[0]:.2f}\n")
    print("| rate | " + " | ".join(["nginx"] + [v.name for v in variants]) + " |")
    print("|---|" + "---|" * (1 + len(variants)))
    for rate in rates:
        cells = [" / ".join(f"{x:.2f}" for x in p99[("nginx", rate)])]
        for v in variants:
            cells.append(" / ".join(f"{x:.2f} ({d:+.2f})" for x, d in zip(p99[(v.name, rate)], delta[(v.name, rate)])))
        print(f"| {rate:,.0f}/s | " + " | ".join(cells) + " |")
    print("\n| proxy CPU us/request (mean of repeats) | " + " | ".join(v.name for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for rate in rates:
        print(f"| {rate:,.0f}/s | " + " | ".join(
            f"{sum(cpu_at[(v.name, rate)]) / len(cpu_at[(v.name, rate)]):.1f}" for v in variants) + " |")


def print_saturation(variants, sat, cpu) -> None:
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    first = mean(sat[variants[0].name])
    print("\n| saturation (wrk -t1 -c16) | " + " | ".join(v.name for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    print("| req/s per repeat | " + " | ".join(" / ".join(f"{x:,.0f}" for x in sat[v.name]) for v in variants) + " |")
    print("| req/s mean, vs the first | " + " | ".join(
        f"{mean(sat[v.name]):,.0f} ({mean(sat[v.name]) / first:.2f}x)" for v in variants) + " |")
    print("| proxy CPU us/request, mean | " + " | ".join(f"{1000 * mean(cpu[v.name]):.1f}" for v in variants) + " |")

if __name__ == "__main__":
    main()
