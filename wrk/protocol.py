"""The load-test protocol (spec section 5, issue 6), end to end, into one report.

    python -m wrk.protocol                      # full run: several minutes; writes wrk/reports/protocol.{md,png}
    python -m wrk.protocol --quick --out /tmp/r.md   # the CI smoke run: ~30 s, tiny rates
    python -m wrk.protocol --redis auto         # also the enforcement rows with the Redis store

Steps (one function each, below):
  1. baseline     straight at one backend (nginx from wrk/nginx_target.py; `python -m lb.demo` if no nginx)
  2. edge         the same rates through `edge.py` (limiter on, generous limit, the client keyed): p99 delta.
                  Baseline and edge rows are interleaved (b r1, e r1, b r2, e r2, ...) and the whole
                  sequence is run twice, so the report shows the noise next to the delta.
  3. enforcement  a per-key limit, driven at 2x it, per algorithm (and per store): admitted vs limit.
  4. pool         the edge with pooling vs --no-pool at one rate: p50/p99 and the p50 ratio.

The generator is wrk2 when `--wrk2 PATH` ($WRK2, else `wrk` on PATH) is wrk2 (its --help mentions
-R/--rate; Debian's `wrk` package is plain wrk and is not used here), else wrk.loadgen
(same flags, same coordinated-omission-free measurement). Every row records the equivalent command line
for both tools. Every run is bounded: the generator's own deadline, plus a subprocess timeout for wrk2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import http.client
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from limiter import parse_rate
from wrk import loadgen
from wrk.nginx_target import find_nginx, nginx_target
from wrk.report import parse_output

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
ALGORITHMS = ("token-bucket", "fixed-window", "sliding-log", "sliding-counter")
UNLIMITED_KEY = "protocol-unlimited"    # the latency rows' client: the default limit is far above any rate
ENFORCED_KEY = "protocol-k1"            # the enforcement rows' client
GENEROUS_LIMIT = "1000000/s"
TOLERANCE = 0.02                        # enforcement: admitted within 2% of the limit
TARGET_DELTA_MS = 0.5                   # edge p99 - baseline p99 at 1,000 req/s (memory store)
TARGET_DELTA_REDIS_MS = 1.0             # the same, with the Redis store
# Connections per row. wrk2 needs -t <= -c and usually runs -t2; ours runs -t1 at these rates
# (docs/loadgen.md: -t2 only adds headroom above ~10k req/s and takes CPU from the system under test).
LATENCY_CONNS, ENFORCE_CONNS = 50, 10
WRK2_THREADS, LOADGEN_THREADS = 2, 1


# ------------------------------------------------------------------------------------------ records

@dataclasses.dataclass
class Result:
    """One measured (or skipped) row of the protocol."""
    step: str                     # baseline | edge | enforce | pool | no-pool
    target: str                   # what was driven: "nginx", "edge (memory)", "token-bucket / memory", ...
    rate: float                   # requested req/s
    run: int                      # 1, 2: the repeat
    wrk2_cmd: str                 # the equivalent command lines, for both tools
    loadgen_cmd: str
    data: dict | None = None      # parse_output()-shaped dict (wrk.loadgen.run() returns a superset)
    skipped: str | None = None    # why this row was not measured
    extra: dict = dataclasses.field(default_factory=dict)   # enforcement: the arithmetic and series

    def lat(self, key: str) -> float | None:
        return None if self.data is None else self.data["latency_ms"].get(key)


@dataclasses.dataclass
class Target:
    """A process the generator drives: where it listens and how to start it by hand."""
    name: str
    port: int
    start_cmd: str
    admin_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"


class Skip(Exception):
    """A target could not be started (e.g. the Redis store is not implemented yet): rows are skipped."""


# ------------------------------------------------------------------------------------------ the tool

def detect_wrk2(exe: str = "wrk") -> bool:
    """True when `exe` (by default `wrk` on PATH) is wrk2: its usage text lists -R/--rate (Debian's
    plain wrk does not)."""
    exe = shutil.which(exe)
    if not exe:
        return False
    try:
        p = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return re.search(r"(^|\s)(-R,|--rate\b)", p.stdout + p.stderr, re.M) is not None


def fmt_secs(s: float) -> str:
    return f"{s:g}s"


def wrk2_argv(url: str, rate: float, duration: float, conns: int, script: str | None) -> list[str]:
    threads = 1 if script == "wrk/limit.lua" else min(WRK2_THREADS, conns)
    return ["wrk", f"-t{threads}", f"-c{conns}", f"-d{fmt_secs(duration)}", f"-R{rate:g}", "--latency",
            *(["-s", script] if script else []), url]


def commands(url: str, rate: float, duration: float, conns: int, key: str | None, script: str | None
             ) -> tuple[str, str]:
    """The equivalent (wrk2, wrk.loadgen) command lines for one row."""
    wrk2 = (f"WRK_API_KEY={shlex.quote(key)} " if key else "") + shlex.join(wrk2_argv(url, rate, duration, conns, script))
    lg = ["python", "-m", "wrk.loadgen", f"-t{LOADGEN_THREADS}", f"-c{conns}", f"-d{fmt_secs(duration)}",
          f"-R{rate:g}", "--latency", *(["-H", f"X-Api-Key: {key}"] if key else []), url]
    return wrk2, shlex.join(lg)


def drive(tool: str, url: str, rate: float, duration: float, conns: int, key: str | None = None,
          script: str | None = None, wrk2_exe: str = "wrk") -> dict:
    """One constant-rate run with the chosen tool; returns the parse_output()-shaped dict."""
    if tool == "wrk2":
        env = {**os.environ, **({"WRK_API_KEY": key} if key else {})}
        argv = [wrk2_exe, *wrk2_argv(url, rate, duration, conns, script)[1:]]
        p = subprocess.run(argv, capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=duration + 60)
        if p.returncode != 0:
            raise RuntimeError(f"wrk2 exited {p.returncode}: {p.stderr.strip()[-500:]}")
        r = parse_output(p.stdout, rate)
        r["raw"] = p.stdout
        return r
    return loadgen.run(url, threads=LOADGEN_THREADS, connections=conns, duration=duration, rate=rate,
                       headers=[("X-Api-Key", key)] if key else [],
                       command=commands(url, rate, duration, conns, key, script)[1])


# ------------------------------------------------------------------------------------------ targets

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(name: str, argv: list[str], ready: str, admin: bool = False, timeout: float = 15.0):
    """Start argv, wait for the `ready` regex in its output, yield (ready match, admin port or None).
    A process that exits first raises Skip with its last output line (that is how an edge whose
    --store is not implemented yet is reported). Stopped with SIGTERM (then SIGKILL) on the way out."""
    log = tempfile.NamedTemporaryFile(prefix=f"protocol-{name}-", suffix=".log", delete=False)
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    text = lambda: Path(log.name).read_text(errors="replace")  # noqa: E731
    try:
        deadline = time.monotonic() + timeout
        while True:
            out = text()
            m = re.search(ready, out)
            a = re.search(r"admin on 127\.0\.0\.1:(\d+)", out) if admin else None
            if m and (a or not admin):
                break
            if proc.poll() is not None:
                lines = [ln.strip() for ln in text().splitlines() if ln.strip()]
                raise Skip(f"{name} exited with status {proc.returncode} at start-up: "
                           + (lines[-1] if lines else "(no output)"))
            if time.monotonic() > deadline:
                raise Skip(f"{name} did not report ready within {timeout:g} s")
            time.sleep(0.02)
        yield m, int(a.group(1)) if a else None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()
        os.unlink(log.name)


@contextlib.contextmanager
def backend():
    """The baseline backend: nginx (fast, so the edge is what the edge rows measure), else lb.demo."""
    if find_nginx():
        with nginx_target() as port:
            yield Target("nginx", port, f"python -m wrk.nginx_target --port {port}")
    else:
        with process("backend", [PY, "-m", "lb.demo", "--port", "0", "--name", "baseline"],
                     r"listening 127\.0\.0\.1:(\d+)") as (m, _):
            port = int(m.group(1))
            yield Target("lb.demo", port, f"python -m lb.demo --port {port} --name baseline")


@contextlib.contextmanager
def edge(name: str, backend_url: str, *args: str, admin: bool = False):
    """`python edge.py` on a free port in front of one backend; raises Skip if it will not start."""
    argv = (["--backends", backend_url.rstrip("/"), *args] + (["--admin", "127.0.0.1:0"] if admin else [])
            + EDGE_PIN)
    with process(name, [PY, "edge.py", "--listen", "127.0.0.1:0", *argv],
                 r"listening on 127\.0\.0\.1:(\d+)", admin=admin) as (m, admin_port):
        port = int(m.group(1))
        shown = [f"127.0.0.1:{admin_port}" if x == "127.0.0.1:0" else x for x in argv]
        yield Target(name, port, f"python edge.py --listen 127.0.0.1:{port} {shlex.join(shown)}", admin_port)


@contextlib.contextmanager
def redis_server(spec: str | None):
    """Yields (store URL or a Skip, how it was started). None: no Redis rows. 'auto': our own
    redis-server on a free port, no persistence, stopped afterwards. Otherwise the URL as given."""
    if spec is None:
        yield None, None
    elif spec != "auto":
        yield spec, f"(given) {spec}"
    elif not shutil.which("redis-server"):
        yield Skip("--redis auto: redis-server is not installed"), None
    else:
        port = _free_port()
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(process("redis", argv, r"Ready to accept connections"))
            except Skip as why:
                yield why, None
                return
            yield f"redis://127.0.0.1:{port}/0", shlex.join(argv)


# ------------------------------------------------------------------------------------------ progress

class Progress:
    """One line per run: [i/n] elapsed, estimated remaining, what is running; then its headline figures."""

    def __init__(self, planned_runs: list[float], overhead: float = 1.5):
        self.left = list(planned_runs)
        self.n, self.i, self.overhead = len(planned_runs), 0, overhead
        self.t0 = time.monotonic()

    def start(self, what: str, seconds: float) -> None:
        self.i += 1
        if self.left:
            self.left.pop(0)
        remaining = seconds + sum(self.left) + self.overhead * (len(self.left) + 1)
        el = time.monotonic() - self.t0
        print(f"[{self.i:>2}/{self.n}] {el // 60:.0f}:{el % 60:04.1f} elapsed, ~{remaining // 60:.0f}:"
              f"{remaining % 60:02.0f} left | {what} ...", end="", flush=True)

    def done(self, text: str) -> None:
        print(" " + text, flush=True)

    def skip(self, what: str, why: str) -> None:
        self.i += 1
        if self.left:
            self.left.pop(0)
        print(f"[{self.i:>2}/{self.n}] skipped {what}: {why}", flush=True)


def headline(r: dict) -> str:
    lm = r["latency_ms"]
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    s = f"p50 {f(lm['p50'])} p99 {f(lm['p99'])} p99.9 {f(lm.get('p99.9'))} ms, {r['achieved_rate'] or 0:.0f} req/s"
    if r.get("status"):
        s += ", status " + " ".join(f"{k}:{v}" for k, v in sorted(r["status"].items()))
    if r.get("kept_up") is False:
        s += " [NOT KEPT UP]"
    return s


# ------------------------------------------------------------------------------------------ the steps

def measure(cfg, progress: Progress, step: str, target: Target, rate: float, run: int, duration: float,
            conns: int, key: str | None = None, script: str | None = None, what: str = "") -> Result:
    wrk2_cmd, lg_cmd = commands(target.url, rate, duration, conns, key, script)
    res = Result(step, target.name, rate, run, wrk2_cmd, lg_cmd)
    progress.start(what or f"{step} ({target.name}) {rate:g} req/s, run {run}", duration)
    res.data = drive(cfg.tool, target.url, rate, duration, conns, key, script, cfg.wrk2_exe)
    progress.done(headline(res.data))
    return res


def warm_up(cfg, target: Target, key: str | None) -> None:
    """Not reported: a short run so the first measured row does not pay for thread/connection set-up."""
    if cfg.warmup > 0:
        drive(cfg.tool, target.url, min(cfg.rates), cfg.warmup, LATENCY_CONNS, key,
              "wrk/keyed.lua" if key else None, cfg.wrk2_exe)


def step_latency(cfg, progress: Progress, base: Target, redis_url=None) -> list[Result]:
    """Steps 1 and 2: baseline and through-the-edge rows, interleaved, the whole sequence cfg.repeats times.
    With a Redis store, a third row per rate: the same edge limiting through Redis."""
    rows: list[Result] = []
    with contextlib.ExitStack() as stack:
        e = stack.enter_context(edge("edge", base.url, "--limit", GENEROUS_LIMIT))
        cfg.targets.append(("edge (latency rows)", e.start_cmd))
        er = None
        if isinstance(redis_url, str):
            try:
                er = stack.enter_context(edge("edge-redis", base.url, "--limit", GENEROUS_LIMIT,
                                              "--store", redis_url))
                cfg.targets.append(("edge with the Redis store (latency rows)", er.start_cmd))
            except Skip as why:
                progress.skip("edge-redis latency rows", str(why))
        warm_up(cfg, base, None)
        warm_up(cfg, e, UNLIMITED_KEY)
        if er:
            warm_up(cfg, er, UNLIMITED_KEY)
        for run in range(1, cfg.repeats + 1):
            for rate in cfg.rates:
                rows.append(measure(cfg, progress, "baseline", base, rate, run, cfg.duration, LATENCY_CONNS))
                rows.append(measure(cfg, progress, "edge", e, rate, run, cfg.duration, LATENCY_CONNS,
                                    UNLIMITED_KEY, "wrk/keyed.lua"))
                if er:
                    rows.append(measure(cfg, progress, "edge-redis", er, rate, run, cfg.duration, LATENCY_CONNS,
                                        UNLIMITED_KEY, "wrk/keyed.lua"))
    return rows


def scrape_admitted(admin_port: int) -> tuple[int, int]:
    """(requests answered, requests rejected with 429) from the edge's /metrics."""
    c = http.client.HTTPConnection("127.0.0.1", admin_port, timeout=2)
    try:
        c.request("GET", "/metrics")
        text = c.getresponse().read().decode()
    finally:
        c.close()
    total = int(re.search(r"^lb_request_duration_seconds_count (\d+)", text, re.M).group(1))
    limited = int(re.search(r"^lb_rate_limited_total (\d+)", text, re.M).group(1))
    return total, limited


class PeriodSampler(threading.Thread):
    """Scrapes the edge's counters at every wall-clock multiple of the limit's period (the fixed
    windows' boundaries), so admitted requests can be counted per period, whatever the generator."""

    def __init__(self, admin_port: int, period: float):
        super().__init__(daemon=True, name="period-sampler")
        self.admin_port, self.period = admin_port, period
        self.samples: list[tuple[float, int, int]] = []   # (wall clock, answered, 429) at the start, then at each boundary
        self.final: tuple[float, int, int] | None = None   # after the run: not on a boundary
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.time(), *scrape_admitted(self.admin_port)))
            nxt = (time.time() // self.period + 1) * self.period
            self.stop.wait(max(0.0, nxt - time.time()))
        self.final = (time.time(), *scrape_admitted(self.admin_port))


def steady_state(samples, final, demand: float, period: float) -> dict:
    """Per-period admitted counts, and the admitted rate excluding the first period of the run.

    Intervals between samples: the first one with any request holds the run's start, so the run's
    first period ends inside the next one; steady state starts one interval later. It ends with the
    last whole period (boundary to boundary: the final sample is not on one) that saw (nearly) the full
    demand, i.e. before the partial last one. The series (for the chart) has every interval, as a rate."""
    iv = [(a[0], b[0], b[1] - a[1], b[2] - a[2]) for a, b in zip(samples, samples[1:])]
    tail = [(samples[-1][0], final[0], final[1] - samples[-1][1], final[2] - samples[-1][2])] if final else []
    series = [(t0, (n - lim) / (t1 - t0)) for t0, t1, n, lim in iv + tail if n > 0 and t1 > t0]
    busy = [i for i, (_, _, n, _) in enumerate(iv) if n > 0]
    if not busy:
        return {"series": series, "rate": None}
    first = busy[0] + 2
    full = [i for i, (t0, t1, n, _) in enumerate(iv) if n >= 0.98 * demand * (t1 - t0)]
    last = max((i for i in full if i >= first), default=None)
    if last is None:
        return {"series": series, "rate": None, "why": "run too short for a steady-state period"}
    span = iv[first:last + 1]
    admitted = sum(n - lim for _, _, n, lim in span)
    seconds = span[-1][1] - span[0][0]
    return {"series": series, "rate": admitted / seconds, "admitted": admitted, "seconds": seconds,
            "periods": len(span)}


def allowance(algorithm: str, n: int) -> tuple[int, str]:
    """What a whole run at 2x the limit admits beyond limit x duration (the first window's allowance)."""
    return {
        "token-bucket": (n, "the bucket starts full: N tokens on top of the refill"),
        "fixed-window": (n, "at most: the run touches D/P + 1 clock-aligned windows unless it starts on a boundary"),
        "sliding-log": (0, "none: every trailing window holds <= N, and the run is D/P such windows"),
        "sliding-counter": (0, "about none, as the log it approximates"),
    }[algorithm]


def step_enforcement(cfg, progress: Progress, base: Target, redis_url) -> list[Result]:
    """Step 3: per algorithm (and per store), the limit driven at 2x for cfg.enforce_duration."""
    n, period = cfg.limit_n, cfg.limit_period
    limit_rate = n / period
    demand = 2 * limit_rate
    stores = [("memory", "memory")]
    if redis_url is not None:
        stores.append(("redis", redis_url))
    rows = []
    for store_name, store in stores:
        for alg in cfg.algorithms:
            name = f"{alg} / {store_name}"
            extra_n, why = allowance(alg, n)
            expected = limit_rate * cfg.enforce_duration + extra_n
            arithmetic = (f"{limit_rate:g}/s x {cfg.enforce_duration:g} s + {extra_n} = {expected:,.0f} -> "
                          f"{expected / cfg.enforce_duration:.1f}/s = {expected / cfg.enforce_duration / limit_rate - 1:+.1%}")
            extra = {"algorithm": alg, "store": store_name, "allowance": extra_n, "allowance_why": why,
                     "expected": expected, "arithmetic": arithmetic, "limit_rate": limit_rate}
            try:
                if isinstance(store, Skip):
                    raise store
                with edge(f"edge-{alg}-{store_name}", base.url, "--limit", cfg.limit, "--algorithm", alg,
                          "--store", store, admin=True) as e:
                    cfg.targets.append((f"edge ({name})", e.start_cmd))
                    sampler = PeriodSampler(e.admin_port, period)
                    sampler.start()
                    try:
                        res = measure(cfg, progress, "enforce", e, demand, 1, cfg.enforce_duration, ENFORCE_CONNS,
                                      ENFORCED_KEY, "wrk/limit.lua", what=f"enforcement {name} at {demand:g} req/s")
                    finally:
                        sampler.stop.set()
                        sampler.join(10)
                    res.target = name
                    res.extra = extra | {"steady": steady_state(sampler.samples, sampler.final, demand, period)}
            except Skip as why:
                wrk2_cmd, lg_cmd = commands("http://127.0.0.1:$EDGE/", demand, cfg.enforce_duration,
                                            ENFORCE_CONNS, ENFORCED_KEY, "wrk/limit.lua")
                res = Result("enforce", name, demand, 1, wrk2_cmd, lg_cmd, skipped=str(why), extra=extra)
                progress.skip(f"enforcement {name}", str(why))
            rows.append(res)
    return rows


def step_pool(cfg, progress: Progress, base: Target) -> list[Result]:
    """Step 4: the edge with its backend pool vs --no-pool (a new TCP connection per request)."""
    rows = []
    with edge("edge-pool", base.url, "--limit", GENEROUS_LIMIT) as pooled, \
            edge("edge-no-pool", base.url, "--limit", GENEROUS_LIMIT, "--no-pool") as unpooled:
        cfg.targets.append(("edge (pooling)", pooled.start_cmd))
        cfg.targets.append(("edge (--no-pool)", unpooled.start_cmd))
        warm_up(cfg, pooled, UNLIMITED_KEY)
        warm_up(cfg, unpooled, UNLIMITED_KEY)
        for run in range(1, cfg.repeats + 1):
            for step, t in (("pool", pooled), ("no-pool", unpooled)):
                rows.append(measure(cfg, progress, step, t, cfg.pool_rate, run, cfg.duration, LATENCY_CONNS,
                                    UNLIMITED_KEY, "wrk/keyed.lua"))
    return rows


# ------------------------------------------------------------------------------------------ the run

def machine(when: str) -> dict:
    return {f"load_{when}": os.getloadavg()}


EDGE_PIN: list[str] = []   # --cpu-affinity for the edges, set by run_protocol (bench/placement.py)


def run_protocol(cfg) -> dict:
    from bench.placement import describe, place
    load_cpu, pin = place()    # the generator and the backend on one CPU, every edge on another
    EDGE_PIN[:] = pin
    cfg.placement = describe(load_cpu, pin)
    cfg.targets = []
    n_lat = len(cfg.rates) * (3 if cfg.redis else 2) * cfg.repeats
    n_enf = len(cfg.algorithms) * (2 if cfg.redis else 1)
    planned = ([cfg.duration] * n_lat + [cfg.enforce_duration] * n_enf + [cfg.duration] * 2 * cfg.repeats)
    progress = Progress(planned)
    info = {"nproc": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            **machine("start")}
    print(f"protocol: tool {cfg.tool}; {len(planned)} runs, ~{sum(planned) / 60:.1f} min of load; "
          f"nproc {info['nproc']}, load {' '.join(f'{x:.2f}' for x in info['load_start'])}", flush=True)
    results: list[Result] = []
    with backend() as base, redis_server(cfg.redis) as (redis_url, redis_cmd):
        cfg.backend = base
        cfg.targets.append((f"backend ({base.name})", base.start_cmd))
        if redis_cmd:
            cfg.targets.append(("redis", redis_cmd))
        results += step_latency(cfg, progress, base, redis_url)
        results += step_enforcement(cfg, progress, base, redis_url)
        results += step_pool(cfg, progress, base)
    info.update(machine("end"), finished=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                elapsed_s=time.monotonic() - progress.t0)
    return {"info": info, "results": results}


# ------------------------------------------------------------------------------------------ rendering

def _f(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(a, b) -> str:
    return "-" if a is None or not b else f"{a / b - 1:+.1%}"


def _within(rate, limit) -> str:
    if rate is None:
        return "-"
    return "PASS" if abs(rate / limit - 1) <= TOLERANCE else "FAIL"


def _kept(r: Result) -> str:
    d = r.data
    lag = (d.get("send_lag_ms") or {}).get("p99")
    s = "yes" if d.get("kept_up") else ("NO" if d.get("kept_up") is False else "?")
    return s + (f" (lag p99 {lag:.2f})" if lag is not None else "")


def problems(results: list[Result]) -> list[str]:
    """What makes a row invalid (not merely slow): 429s in the latency rows, errors, non-2xx."""
    out = []
    for r in results:
        if r.data is None:
            continue
        st, err = r.data.get("status", {}), r.data.get("errors", {})
        bad = {k: v for k, v in st.items() if k != "200" and not (r.step == "enforce" and k == "429")}
        if r.step != "enforce" and st.get("429"):
            out.append(f"{r.step} {r.target} {r.rate:g} req/s run {r.run}: {st['429']} responses were 429 "
                       f"(the latency client must never be limited)")
        elif bad:
            out.append(f"{r.step} {r.target} {r.rate:g} req/s run {r.run}: non-200 responses {bad}")
        if any(err.values()):
            out.append(f"{r.step} {r.target} {r.rate:g} req/s run {r.run}: socket errors {err}")
    return out


def target_line(deltas: dict, target_ms: float, store: str) -> str | None:
    """The verdict on the p99 delta at 1,000 req/s over the runs, or None if that rate was not run."""
    at = [(run, d) for (rate, run), d in deltas.items() if rate == 1000 and d is not None]
    if not at:
        return None
    verdict = "MET" if all(d < target_ms for _, d in at) else (
        "MISSED" if all(d >= target_ms for _, d in at) else "MIXED (met in one run, missed in another)")
    return (f"**Target** (edge p99 - baseline p99 at 1,000 req/s < {target_ms} ms, {store}): **{verdict}** - "
            + ", ".join(f"run {run}: {d:+.2f} ms" for run, d in at) + ".")


def render_markdown(cfg, out: dict, png_name: str) -> str:
    info, results = out["info"], out["results"]
    by = lambda step: [r for r in results if r.step == step]  # noqa: E731
    L: list[str] = []
    w = L.append
    tool_line = (f"wrk2 (`{cfg.wrk2_exe}`; its --help lists -R/--rate)" if cfg.tool == "wrk2" else
                 "wrk.loadgen, our constant-rate generator (`python -m wrk.loadgen`)"
                 + (f"; wrk2 was not found (`{cfg.wrk2_exe} --help` lists no `-R`/`--rate`, or it is missing: "
                    "pass --wrk2 PATH)" if not cfg.wrk2_available else ""))
    w("# Load-test protocol report")
    w("")
    w(f"Generated by `{cfg.argv_line}` ({'QUICK smoke run: durations and rates too small to mean anything' if cfg.quick else 'full run'}).")
    w("")
    w(f"- **Tool:** {tool_line}. Open loop, constant rate, latency from each request's intended send time "
      "(coordinated omission corrected).")
    w(f"- **Machine:** `nproc` = {info['nproc']}; load average (1/5/15 min) at start "
      f"{' / '.join(f'{x:.2f}' for x in info['load_start'])}, at end {' / '.join(f'{x:.2f}' for x in info['load_end'])}; "
      f"Python {info['python']}; {info['platform']}. Shared with other work: runs are noisy.")
    w(f"- **When:** {info['started']} to {info['finished']} ({info['elapsed_s'] / 60:.1f} min).")
    w(f"- **Placement:** {getattr(cfg, 'placement', 'not pinned')}: the edge has a core of its own, as in "
      "production where the load comes from other machines.")
    w(f"- **Backend:** {cfg.backend.name}"
      + (" (Debian nginx-light, one worker, `return 200 \"ok\\n\"`, access log off: a fast backend, so that "
         "the edge, not the backend, is what the through-edge rows add)" if cfg.backend.name == "nginx" else
         " (the Python identity backend: nginx was not found, so the baseline is slower than it should be "
         "and the edge's cost is measured against a Python server)") + ".")
    w(f"- **Per row:** {fmt_secs(cfg.duration)} at each rate; {cfg.repeats} runs of the whole baseline/edge "
      f"sequence, interleaved (baseline r, edge r, next rate ...); {LATENCY_CONNS} keep-alive connections; "
      + (f"each target warmed up for {fmt_secs(cfg.warmup)} first (not reported)." if cfg.warmup else "no warm-up."))
    w("")

    # 1 + 2
    w("## 1-2. Baseline vs through the edge")
    w("")
    w(f"The edge: limiter on (token bucket, memory store), `--limit {GENEROUS_LIMIT}`, the client keyed with "
      f"`X-Api-Key: {UNLIMITED_KEY}` so it is never limited (any 429 would be listed under Problems). "
      "Latencies in ms; delta = edge p99 - baseline p99 of the same run and rate: what the edge costs.")
    w("")
    w("| rate req/s | run | baseline p50 | p99 | p99.9 | edge p50 | p99 | p99.9 | **p99 delta** | kept up: baseline / edge (send lag p99 ms) |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    base_rows, edge_rows = by("baseline"), by("edge")
    deltas = {}
    for b, e in zip(base_rows, edge_rows):
        d = None if b.lat("p99") is None or e.lat("p99") is None else e.lat("p99") - b.lat("p99")
        deltas[(b.rate, b.run)] = d
        w(f"| {b.rate:,.0f} | {b.run} | {_f(b.lat('p50'))} | {_f(b.lat('p99'))} | {_f(b.lat('p99.9'))} | "
          f"{_f(e.lat('p50'))} | {_f(e.lat('p99'))} | {_f(e.lat('p99.9'))} | **{_f(d)}** | {_kept(b)} / {_kept(e)} |")
    w("")
    line = target_line(deltas, TARGET_DELTA_MS, "memory store")
    if line:
        w(line)
    else:
        w(f"**Target** (p99 delta at 1,000 req/s < {TARGET_DELTA_MS} ms): not measured - 1,000 req/s is not among "
          f"the rates of this run ({', '.join(f'{r:g}' for r in cfg.rates)}).")
    w("")

    redis_rows = by("edge-redis")
    if redis_rows:
        w("### Through the edge with the Redis store")
        w("")
        w("The same edge limiting through Redis (`--store`, every request one EVALSHA round trip), "
          "interleaved with the rows above; delta = its p99 - baseline p99 of the same run and rate.")
        w("")
        w("| rate req/s | run | edge+Redis p50 | p99 | p99.9 | **p99 delta** | kept up |")
        w("|---|---|---|---|---|---|---|")
        rdeltas = {}
        for r in redis_rows:
            b = next((x for x in base_rows if x.rate == r.rate and x.run == r.run), None)
            d = None if b is None or b.lat("p99") is None or r.lat("p99") is None else r.lat("p99") - b.lat("p99")
            rdeltas[(r.rate, r.run)] = d
            w(f"| {r.rate:,.0f} | {r.run} | {_f(r.lat('p50'))} | {_f(r.lat('p99'))} | {_f(r.lat('p99.9'))} | "
              f"**{_f(d)}** | {_kept(r)} |")
        w("")
        line = target_line(rdeltas, TARGET_DELTA_REDIS_MS, "Redis store")
        if line:
            w(line)
            w("")

    # 3
    w("## 3. Enforcement")
    w("")
    w(f"Per-key limit `--limit {cfg.limit}` ({cfg.limit_n / cfg.limit_period:g} req/s), the client "
      f"(`X-Api-Key: {ENFORCED_KEY}`) driven at 2x = {2 * cfg.limit_n / cfg.limit_period:g} req/s for "
      f"{fmt_secs(cfg.enforce_duration)}, {ENFORCE_CONNS} connections. Admitted = non-429 responses as the "
      "client counted them. **Whole run** = admitted / duration, the first window's (or the full bucket's) "
      "allowance included once. **Steady state** excludes the run's first period: the edge's own counters "
      "(`/metrics` on `--admin`) are read at every multiple of the period on the wall clock (the fixed windows' "
      "boundaries); it counts from the first boundary at least one period after the start to the last boundary "
      f"before the end. PASS = within {TOLERANCE:.0%} of the limit.")
    w("")
    w("| algorithm / store | requests | admitted | whole run req/s | vs limit | whole run | steady state req/s (periods) | vs limit | steady state | kept up |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    lim = cfg.limit_n / cfg.limit_period
    for r in by("enforce"):
        if r.skipped:
            w(f"| {r.target} | - | - | - | - | SKIPPED | - | - | SKIPPED | {r.skipped} |")
            continue
        d, st = r.data, r.extra["steady"]
        rate = d["admitted_per_sec"] if d.get("admitted_per_sec") is not None else d["admitted"] / cfg.enforce_duration
        w(f"| {r.target} | {d.get('responses') or d.get('completed')} | {d['admitted']:,} | {rate:.2f} | {_pct(rate, lim)} | "
          f"**{_within(rate, lim)}** | {_f(st.get('rate'))} ({st.get('periods', '-')}) | {_pct(st.get('rate'), lim)} | "
          f"**{_within(st.get('rate'), lim)}** | {_kept(r)} |")
    w("")
    w("The arithmetic (expected whole-run admitted = limit x duration + allowance, and what it is as a rate):")
    w("")
    seen = set()
    for r in by("enforce"):
        x = r.extra
        if x["algorithm"] in seen:
            continue
        seen.add(x["algorithm"])
        w(f"- {x['algorithm']}: {x['arithmetic']} (allowance: {x['allowance_why']}).")
    w("")
    measured = [r for r in by("enforce") if not r.skipped]
    fails = [r.target for r in measured
             if _within(r.data["admitted_per_sec"], lim) != "PASS" or _within(r.extra["steady"].get("rate"), lim) != "PASS"]
    w(f"**Target** (admitted within {TOLERANCE:.0%} of the limit, every algorithm): "
      + ("**MET** for every measured row." if measured and not fails else
         f"**MISSED** for {', '.join(fails)}." if fails else "nothing measured.")
      + (" Skipped rows are not a pass." if any(r.skipped for r in by("enforce")) else ""))
    w("")

    # 4
    w("## 4. Connection reuse")
    w("")
    w(f"Two edges in front of the same backend, same limiter settings as in 1-2, at {cfg.pool_rate:g} req/s: "
      "one with its urllib3 pool to the backend (keep-alive), one with `--no-pool` (a new TCP connection, "
      "`Connection: close`, per request). Runs interleaved.")
    w("")
    w("| run | pooled p50 | p99 | --no-pool p50 | p99 | **p50 ratio (no-pool / pooled)** | p99 ratio | kept up: pooled / no-pool |")
    w("|---|---|---|---|---|---|---|---|")
    for p, q in zip(by("pool"), by("no-pool")):
        ratio = lambda k: "-" if not p.lat(k) or q.lat(k) is None else f"{q.lat(k) / p.lat(k):.2f}x"  # noqa: E731
        w(f"| {p.run} | {_f(p.lat('p50'))} | {_f(p.lat('p99'))} | {_f(q.lat('p50'))} | {_f(q.lat('p99'))} | "
          f"**{ratio('p50')}** | {ratio('p99')} | {_kept(p)} / {_kept(q)} |")
    w("")

    # invocations
    w("## Invocations")
    w("")
    w("Ports are the free ports this run got; start the targets the same way and substitute yours. "
      "Run from the repository root. wrk2 needs `-t <= -c`; ours runs `-t1` at these rates.")
    w("")
    w("Targets:")
    w("")
    for what, cmd in cfg.targets:
        w(f"- {what}: `{cmd}`")
    w("")
    w("| step | rate | wrk2 | without wrk2 (`wrk.loadgen`) |")
    w("|---|---|---|---|")
    seen_cmds = set()
    for r in results:
        if (r.step, r.target, r.rate) in seen_cmds:
            continue
        seen_cmds.add((r.step, r.target, r.rate))
        w(f"| {r.step} ({r.target}) | {r.rate:g} | `{r.wrk2_cmd}` | `{r.loadgen_cmd}` |")
    w("")
    w(f"![latency chart]({png_name})")
    w("")
    w("## Problems")
    w("")
    probs = problems(results)
    w("\n".join(f"- {p}" for p in probs) if probs else "None: no 429 in the latency rows, no socket errors, "
      "no unexpected status.")
    not_kept = [f"{r.step} {r.target} {r.rate:g} req/s run {r.run}" for r in results
                if r.data is not None and r.data.get("kept_up") is False]
    if not_kept:
        w("")
        w("Rows where the generator did not keep up with the requested rate (their latencies include that "
          "lag, so read them as upper bounds): " + "; ".join(not_kept) + ".")
    w("")
    return "\n".join(L)


def render_chart(cfg, out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = out["results"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    ax = axes[0]
    for step, color in (("baseline", "tab:blue"), ("edge", "tab:red"), ("edge-redis", "tab:purple")):
        for key, style in (("p50", ":"), ("p99", "-"), ("p99.9", "--")):
            for run in range(1, cfg.repeats + 1):
                rows = [r for r in results if r.step == step and r.run == run and r.lat(key) is not None]
                ax.plot([r.rate for r in rows], [r.lat(key) for r in rows], style, marker="o", color=color,
                        alpha=1.0 if run == 1 else 0.5,
                        label=f"{step} {key}" if run == 1 else None)
    ax.set_xlabel("requested rate (req/s)")
    ax.set_ylabel("latency (ms), from intended send time")
    ax.set_yscale("log")
    ax.set_title(f"1-2. baseline ({cfg.backend.name}) vs edge; each run drawn")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)

    ax = axes[1]
    lim = cfg.limit_n / cfg.limit_period
    for r in results:
        if r.step == "enforce" and not r.skipped:
            series = r.extra["steady"]["series"]
            if series:
                t0 = series[0][0]
                ax.step([t - t0 for t, _ in series], [v for _, v in series], where="post", label=r.target)
    ax.axhline(lim, color="black", lw=0.8, label=f"limit {lim:g}/s")
    ax.axhspan(lim * (1 - TOLERANCE), lim * (1 + TOLERANCE), color="green", alpha=0.15, label="+-2%")
    ax.set_xlabel("seconds; one step per period of the limit (wall clock; first and last partial)")
    ax.set_ylabel("admitted req/s in each period (edge counters)")
    ax.set_title(f"3. enforcement at {2 * lim:g} req/s demand")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)

    ax = axes[2]
    labels, p50, p99 = [], [], []
    for r in results:
        if r.step in ("pool", "no-pool") and r.data:
            labels.append(f"{r.step}\nrun {r.run}")
            p50.append(r.lat("p50"))
            p99.append(r.lat("p99"))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"4. pooling vs --no-pool at {cfg.pool_rate:g} req/s")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"edge load-test protocol - tool: {cfg.tool}; nproc {out['info']['nproc']}; "
                 f"{out['info']['started']}" + (" (QUICK smoke run)" if cfg.quick else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ CLI

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m wrk.protocol", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="CI smoke run: 2 s rows at 100 req/s, enforcement 3 s at 50/s, pool at 100 req/s")
    p.add_argument("--duration", type=loadgen.parse_duration, help="each latency/pool row (default 30s)")
    p.add_argument("--rates", help="comma-separated req/s for steps 1-2 (default 500,1000,2000)")
    p.add_argument("--limit", help="step 3's per-key limit N/PERIOD (default 100/s); driven at 2x")
    p.add_argument("--enforce-duration", type=loadgen.parse_duration, help="step 3's run (default 60s)")
    p.add_argument("--pool-rate", type=float, help="step 4's rate (default 1000)")
    p.add_argument("--repeats", type=int, help="runs of the baseline/edge and pool sequences (default 2; --quick 1)")
    p.add_argument("--warmup", type=loadgen.parse_duration, help="unreported warm-up per target (default 2s)")
    p.add_argument("--out", default=str(ROOT / "wrk" / "reports" / "protocol.md"),
                   help="the Markdown report; the chart goes next to it as .png")
    p.add_argument("--redis", metavar="auto|redis://HOST:PORT/DB",
                   help="also run step 3 with --store redis://...; 'auto' starts a throwaway redis-server")
    p.add_argument("--tool", choices=("auto", "wrk2", "loadgen"), default="auto")
    p.add_argument("--wrk2", default=os.environ.get("WRK2", "wrk"), metavar="PATH",
                   help="the wrk2 binary (default: $WRK2, else `wrk` on PATH if that is wrk2; Debian's `wrk` "
                        "is plain wrk, without -R)")
    a = p.parse_args(argv)
    q = a.quick
    a.duration = a.duration or (2.0 if q else 30.0)
    a.rates = [float(x) for x in (a.rates or ("100" if q else "500,1000,2000")).split(",")]
    a.limit = a.limit or ("50/s" if q else "100/s")
    a.limit_n, a.limit_period = parse_rate(a.limit)
    a.enforce_duration = a.enforce_duration or (3.0 if q else 60.0)
    a.pool_rate = a.pool_rate or (100.0 if q else 1000.0)
    a.repeats = a.repeats or (1 if q else 2)
    a.warmup = a.warmup if a.warmup is not None else (0.0 if q else 2.0)
    a.algorithms = ALGORITHMS
    if a.redis and a.redis != "auto" and not a.redis.startswith("redis://"):
        p.error("--redis: expected auto or redis://HOST:PORT/DB")
    a.wrk2_exe = a.wrk2
    a.wrk2_available = detect_wrk2(a.wrk2_exe)
    if a.tool == "auto":
        a.tool = "wrk2" if a.wrk2_available else "wrk.loadgen"
    elif a.tool == "wrk2" and not a.wrk2_available:
        p.error(f"--tool wrk2: {a.wrk2_exe} is not wrk2 (its --help lists no -R/--rate); pass --wrk2 PATH")
    elif a.tool == "loadgen":
        a.tool = "wrk.loadgen"
    a.argv_line = "python -m wrk.protocol" + ("" if not argv else " " + shlex.join(argv))
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv)
    out_md = Path(cfg.out)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    png = out_md.with_suffix(".png")
    out = run_protocol(cfg)
    out_md.write_text(render_markdown(cfg, out, png.name))
    render_chart(cfg, out, png)
    print(f"wrote {out_md} and {png}", flush=True)
    probs = problems(out["results"])
    for p in probs:
        print("PROBLEM: " + p, file=sys.stderr)
    return 1 if probs else 0


if __name__ == "__main__":
    raise SystemExit(main())
