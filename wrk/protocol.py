"""The load-test protocol (spec section 5, issue 6), end to end, into one report.

    python -m wrk.protocol                      # full run: several minutes; writes wrk/reports/protocol.{md,png}
    python -m wrk.protocol --quick --out /tmp/r.md   # the CI smoke run: ~30 s, tiny rates
    python -m wrk.protocol --redis auto         # also the enforcement rows with the Redis store

Steps (one function each, below):
  1. baseline     straight at one backend (nginx from wrk/nginx_target.py; `python -m demo.backends` if no nginx)
  2. edge         the same rates through `edge.py` (limiter on, generous limit, the client keyed): p99 delta.
                  Baseline and edge rows are interleaved (b r1, e r1, b r2, e r2, ...) and the whole
                  sequence is run twice, so the report shows the noise next to the delta. Interleaved
                  with them, the reference: nginx as a proxy in the edge's place (--no-reference: not),
                  what the placement costs any proxy on this machine.
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
import subprocess
import sys
import threading
import time
from pathlib import Path

from limiter import parse_rate
from wrk import loadgen
from wrk.placement import describe, place
from wrk.protocol_report import fmt_secs, problems, render_chart, render_markdown
from wrk.report import parse_output
from wrk.targets import EDGE_PIN, ROOT, Skip, Target, backend, edge, redis_server, reference_proxy

ALGORITHMS = ("token-bucket", "fixed-window", "sliding-log", "sliding-counter")
UNLIMITED_KEY = "protocol-unlimited"    # the latency rows' client: the default limit is far above any rate
ENFORCED_KEY = "protocol-k1"            # the enforcement rows' client
GENEROUS_LIMIT = "1000000/s"
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
    With a Redis store, a row per rate of the same edge limiting through Redis; with cfg.reference, one of
    nginx as the proxy in the edge's place."""
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
        ref = None
        if cfg.reference:
            try:
                ref = stack.enter_context(reference_proxy(base))
                cfg.targets.append(("nginx as the proxy, the reference (latency rows)", ref.start_cmd))
            except Skip as why:
                progress.skip("reference latency rows", str(why))
        warm_up(cfg, base, None)
        warm_up(cfg, e, UNLIMITED_KEY)
        if er:
            warm_up(cfg, er, UNLIMITED_KEY)
        if ref:
            warm_up(cfg, ref, UNLIMITED_KEY)
        for run in range(1, cfg.repeats + 1):
            for rate in cfg.rates:
                rows.append(measure(cfg, progress, "baseline", base, rate, run, cfg.duration, LATENCY_CONNS))
                rows.append(measure(cfg, progress, "edge", e, rate, run, cfg.duration, LATENCY_CONNS,
                                    UNLIMITED_KEY, "wrk/keyed.lua"))
                if er:
                    rows.append(measure(cfg, progress, "edge-redis", er, rate, run, cfg.duration, LATENCY_CONNS,
                                        UNLIMITED_KEY, "wrk/keyed.lua"))
                if ref:
                    rows.append(measure(cfg, progress, "reference", ref, rate, run, cfg.duration, LATENCY_CONNS,
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
    m = re.search(r'^lb_edge_responses_total\{code="429"\} (\d+)', text, re.M)   # absent until the first
    limited = int(m.group(1)) if m else 0
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


def run_protocol(cfg) -> dict:
    load_cpu, pin = place()    # the generator and the backend on one CPU, every edge on another
    EDGE_PIN[:] = pin
    cfg.placement = describe(load_cpu, pin)
    cfg.targets = []
    n_lat = len(cfg.rates) * (2 + bool(cfg.redis) + cfg.reference) * cfg.repeats
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
    shape = {"generous_limit": GENEROUS_LIMIT, "unlimited_key": UNLIMITED_KEY, "enforced_key": ENFORCED_KEY,
             "latency_conns": LATENCY_CONNS, "enforce_conns": ENFORCE_CONNS}
    return {"info": info, "results": results, "shape": shape}


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
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure nginx as a reverse proxy in the edge's place (default: yes)")
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
