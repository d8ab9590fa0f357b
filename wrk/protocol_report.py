"""The load-test protocol's report: the Markdown (every row, the verdicts against the targets, the
exact command lines) and the chart, from what wrk/protocol.py measured (its Result rows, and the run's
shape in out["shape"]: keys, limits, connections).
"""

from __future__ import annotations

from pathlib import Path

TOLERANCE = 0.02                        # enforcement: admitted within 2% of the limit
TARGET_DELTA_MS = 0.5                   # edge p99 - baseline p99 at 1,000 req/s (memory store)
TARGET_DELTA_REDIS_MS = 1.0             # the same, with the Redis store
BUSY_BASELINE_MS = 2.0                  # nginx-direct p99 above this: the run measured a busy machine


def fmt_secs(s: float) -> str:
    return f"{s:g}s"


def _f(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(a, b) -> str:
    return "-" if a is None or not b else f"{a / b - 1:+.1%}"


def _within(rate, limit) -> str:
    if rate is None:
        return "-"
    return "PASS" if abs(rate / limit - 1) <= TOLERANCE else "FAIL"


def _kept(r) -> str:
    d = r.data
    lag = (d.get("send_lag_ms") or {}).get("p99")
    s = "yes" if d.get("kept_up") else ("NO" if d.get("kept_up") is False else "?")
    return s + (f" (lag p99 {lag:.2f})" if lag is not None else "")


def problems(results: list) -> list[str]:
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


def target_line(deltas: dict, target_ms: float, store: str, baseline: dict | None = None) -> str | None:
    """The verdict on the p99 delta at 1,000 req/s over the runs, or None if that rate was not run.

    baseline: {(rate, run): nginx-direct p99}. A run whose baseline p99 is above BUSY_BASELINE_MS
    measured the machine, not the edge (nginx alone answers in well under a millisecond at these rates):
    it is listed but is no evidence either way, and a verdict needs every run to count."""
    at = [(run, d) for (rate, run), d in deltas.items() if rate == 1000 and d is not None]
    if not at:
        return None
    busy = {run for run, _ in at if baseline and (baseline.get((1000, run)) or 0) > BUSY_BASELINE_MS}
    valid = [(run, d) for run, d in at if run not in busy]
    if busy:
        verdict = "NOT MEASURED (the machine was busy: " + ", ".join(
            f"run {run}'s nginx-direct p99 was {baseline[(1000, run)]:.2f} ms" for run in sorted(busy)) + ")"
        if valid:
            verdict += "; the other runs " + ("met it" if all(d < target_ms for _, d in valid) else "missed it")
    else:
        verdict = "MET" if all(d < target_ms for _, d in valid) else (
            "MISSED" if all(d >= target_ms for _, d in valid) else "MIXED (met in one run, missed in another)")
    return (f"**Target** (edge p99 - baseline p99 at 1,000 req/s < {target_ms} ms, {store}): **{verdict}** - "
            + ", ".join(f"run {run}: {d:+.2f} ms" for run, d in at) + ".")


def _rows_vs_baseline(w, rows: list, base_rows: list, label: str) -> dict:
    """A table of rows measured beside the baseline ones (same rate and run); returns their p99 deltas."""
    w(f"| rate req/s | run | {label} p50 | p99 | p99.9 | **p99 delta** | kept up |")
    w("|---|---|---|---|---|---|---|")
    deltas = {}
    for r in rows:
        b = next((x for x in base_rows if x.rate == r.rate and x.run == r.run), None)
        d = None if b is None or b.lat("p99") is None or r.lat("p99") is None else r.lat("p99") - b.lat("p99")
        deltas[(r.rate, r.run)] = d
        w(f"| {r.rate:,.0f} | {r.run} | {_f(r.lat('p50'))} | {_f(r.lat('p99'))} | {_f(r.lat('p99.9'))} | "
          f"**{_f(d)}** | {_kept(r)} |")
    w("")
    return deltas


def render_markdown(cfg, out: dict, png_name: str) -> str:
    info, results, shape = out["info"], out["results"], out["shape"]
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
      f"sequence, interleaved (baseline r, edge r, next rate ...); {shape['latency_conns']} keep-alive connections; "
      + (f"each target warmed up for {fmt_secs(cfg.warmup)} first (not reported)." if cfg.warmup else "no warm-up."))
    w("")

    # 1 + 2
    w("## 1-2. Baseline vs through the edge")
    w("")
    w(f"The edge: limiter on (token bucket, memory store), `--limit {shape['generous_limit']}`, the client keyed with "
      f"`X-Api-Key: {shape['unlimited_key']}` so it is never limited (any 429 would be listed under Problems). "
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
    base_p99 = {(b.rate, b.run): b.lat("p99") for b in base_rows}
    line = target_line(deltas, TARGET_DELTA_MS, "memory store", base_p99)
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
        line = target_line(_rows_vs_baseline(w, redis_rows, base_rows, "edge+Redis"), TARGET_DELTA_REDIS_MS,
                           "Redis store", base_p99)
        if line:
            w(line)
            w("")

    ref_rows = by("reference")
    if ref_rows:
        w("### The reference: nginx as the proxy")
        w("")
        w("nginx itself in the edge's place (one worker, HTTP/1.1 keep-alive upstream, pinned to the edge's CPU), "
          "interleaved with the rows above: what putting any proxy on the other CPU costs on this machine (four "
          "cross-CPU wake-ups per request), with no Python in it. Not a target of the edge's; it says how much of "
          "the edge's delta the placement alone accounts for.")
        w("")
        line = target_line(_rows_vs_baseline(w, ref_rows, base_rows, "nginx-proxy"), TARGET_DELTA_MS,
                           "nginx as the proxy, for reference", base_p99)
        if line:
            w(line.replace("**Target**", "**The edge's target, applied to nginx**"))
            w("")

    # 3
    w("## 3. Enforcement")
    w("")
    w(f"Per-key limit `--limit {cfg.limit}` ({cfg.limit_n / cfg.limit_period:g} req/s), the client "
      f"(`X-Api-Key: {shape['enforced_key']}`) driven at 2x = {2 * cfg.limit_n / cfg.limit_period:g} req/s for "
      f"{fmt_secs(cfg.enforce_duration)}, {shape['enforce_conns']} connections. Admitted = non-429 responses as the "
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
    for step, color in (("baseline", "tab:blue"), ("edge", "tab:red"), ("edge-redis", "tab:purple"),
                        ("reference", "tab:gray")):
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
