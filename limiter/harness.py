"""Comparison harness: one bursty client replayed against all four algorithms on a simulated clock.

    python -m limiter.harness                       # table + summary on stdout
    python -m limiter.harness --plot chart.png      # and a chart (needs matplotlib)

Default profile: limit 10 per 2 s window (a sustained 5 req/s); the client sends 3x that (15 req/s,
evenly spaced) for 2 s, is silent for 4 s, and repeats.  Each burst starts 1 s into a window, so it
straddles a window boundary: the fixed window admits a full quota on each side of it.
"""

from __future__ import annotations

import argparse
import math
import sys

from limiter import build

ORDER = ["fixed-window", "token-bucket", "sliding-counter", "sliding-log"]


def profile(limit, window, factor, burst, silence, duration, offset):
    """Request instants: factor x the sustained rate (limit/window) for `burst` s, then `silence` s."""
    step = window / (limit * factor)
    out = []
    start = offset
    while start < duration:
        i = 0
        while True:
            t = start + i * step
            if t >= start + burst or t >= duration:
                break
            out.append(t)
            i += 1
        start += burst + silence
    return out


def max_in_window(times, window):
    """Most instants s with a - window < s <= a, over all a (times sorted)."""
    best, j = 0, 0
    for i, a in enumerate(times):
        while not a < times[j] + window:
            j += 1
        best = max(best, i - j + 1)
    return best


def run(args):
    trace = profile(args.limit, args.window, args.factor, args.burst, args.silence, args.duration, args.offset)
    admitted = {}
    for name in ORDER:
        kw = {"burst": args.bucket_capacity} if (name == "token-bucket" and args.bucket_capacity) else {}
        lim = build(name, args.limit, args.window, **kw)
        admitted[name] = [t for t in trace if lim.allow("client", t).allowed]
    seconds = int(math.ceil(args.duration))
    series = {"offered": _per_second(trace, seconds)}
    for name in ORDER:
        series[name] = _per_second(admitted[name], seconds)
    return trace, admitted, series


def _per_second(times, seconds):
    counts = [0] * seconds
    for t in times:
        s = int(t)
        if 0 <= s < seconds:
            counts[s] += 1
    return counts


def table(args, trace, admitted, series):
    cols = ["offered"] + ORDER
    width = max(len(c) for c in cols) + 2
    lines = [
        f"# limiter harness: limit {args.limit} per {args.window:g} s window (sustained {args.limit / args.window:g}/s); "
        f"client sends {args.factor:g}x that for {args.burst:g} s, silent {args.silence:g} s, repeating from "
        f"t={args.offset:g} s, {args.duration:g} s simulated",
        "",
        "second" + "".join(c.rjust(width) for c in cols),
    ]
    for s in range(len(series["offered"])):
        lines.append(f"{s:>6}" + "".join(str(series[c][s]).rjust(width) for c in cols))
    lines += ["", "summary" + "".join(c.rjust(width) for c in cols)[1:]]
    lines.append("total " + "".join(str(len(trace) if c == "offered" else len(admitted[c])).rjust(width) for c in cols))
    peak = []
    for c in cols:
        v = max(series[c])
        peak.append(f"{v}@{series[c].index(v)}s")
    lines.append("peak  " + "".join(p.rjust(width) for p in peak))
    mw = [max_in_window(trace if c == "offered" else admitted[c], args.window) for c in cols]
    lines.append(f"max/{args.window:g}s".ljust(6) + "".join(str(v).rjust(width) for v in mw))
    lines.append(
        f"         (max/{args.window:g}s = most requests admitted inside any trailing {args.window:g} s window; "
        f"the limit is {args.limit})"
    )
    return "\n".join(lines)


def plot(args, trace, admitted, series, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "fixed-window": "#d62728",
        "token-bucket": "#ff7f0e",
        "sliding-counter": "#2ca02c",
        "sliding-log": "#1f77b4",
    }
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": [1, 1]})
    seconds = len(series["offered"])
    x = list(range(seconds))
    top.bar(x, series["offered"], width=1.0, align="edge", color="#dddddd", label="offered")
    bw = 0.8 / len(ORDER)
    for i, name in enumerate(ORDER):
        top.bar([s + 0.1 + i * bw for s in x], series[name], width=bw, align="edge", color=colors[name], label=name)
    top.set_ylabel("admitted per second")
    top.set_title(
        f"limit {args.limit}/{args.window:g}s; client: {args.factor:g}x for {args.burst:g}s, "
        f"{args.silence:g}s silence (bursts straddle window boundaries)"
    )
    top.set_ylim(0, max(series["offered"]) * 1.3 + 1)
    top.legend(loc="upper right", ncol=5, fontsize=8)

    # Bottom: how many admitted requests sit in the trailing window, sampled finely: the limit's own measure.
    steps = int(args.duration * 50)
    grid = [i / 50 for i in range(steps + 1)]
    for name in ORDER:
        times = admitted[name]
        ys, j, k = [], 0, 0
        for g in grid:
            while k < len(times) and times[k] <= g:
                k += 1
            while j < k and not g < times[j] + args.window:
                j += 1
            ys.append(k - j)
        bottom.plot(grid, ys, color=colors[name], label=name, linewidth=1.6)
    bottom.axhline(args.limit, color="black", linestyle="--", linewidth=1, label=f"limit {args.limit}")
    bottom.set_ylabel(f"admitted in trailing {args.window:g}s")
    bottom.set_xlabel("simulated time (s); dotted lines = fixed-window boundaries")
    bottom.set_ylim(0, 2.35 * args.limit)
    bottom.legend(loc="upper right", ncol=5, fontsize=8)
    from matplotlib.ticker import MaxNLocator

    for ax in (top, bottom):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        b = 0.0
        while b <= args.duration:
            ax.axvline(b, color="#999999", linestyle=":", linewidth=0.7)
            b += args.window
        ax.set_xlim(0, args.duration)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m limiter.harness", description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=10, help="N requests per window (default 10)")
    p.add_argument("--window", type=float, default=2.0, help="window in seconds (default 2)")
    p.add_argument("--factor", type=float, default=3.0, help="burst rate as a multiple of limit/window (default 3)")
    p.add_argument("--burst", type=float, default=2.0, help="burst length in seconds (default 2)")
    p.add_argument("--silence", type=float, default=4.0, help="silence between bursts in seconds (default 4)")
    p.add_argument("--duration", type=float, default=30.0, help="simulated seconds (default 30)")
    p.add_argument("--offset", type=float, default=None, help="first burst start (default: half a window)")
    p.add_argument("--bucket-capacity", type=int, default=None, help="token-bucket burst capacity (default: limit)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the series with matplotlib")
    args = p.parse_args(argv)
    if args.offset is None:
        args.offset = args.window / 2
    for name in ("limit", "window", "factor", "burst", "duration"):
        if not getattr(args, name) > 0:
            p.error(f"--{name} must be positive")
    if args.silence < 0 or args.offset < 0:
        p.error("--silence and --offset must be >= 0")
    trace, admitted, series = run(args)
    print(table(args, trace, admitted, series))
    if args.plot:
        plot(args, trace, admitted, series, args.plot)
        print(f"\nchart written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
