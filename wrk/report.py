"""A load-test run's text, in wrk2's layout: written by wrk.loadgen (format_report), read back from
either tool's output (parse_output) into one dict. The writer and the reader of one format live together.

    from wrk.report import parse_output
    r = parse_output(text, requested_rate=1000)
    r["latency_ms"]["p99"], r["requests_per_sec"], r["admitted_per_sec"], r["kept_up"]

What it reads (wrk2 prints the first group; wrk.loadgen prints all of it in the same layout):
  ' 99.000%   11.18ms'            rows of a 'Latency Distribution (...Recorded Latency...)' table
                                  (the '-U' 'Uncorrected Latency' table and the detailed spectrum are skipped)
  '    Latency     6.60ms ...'    Thread Stats row: mean, stdev, max
  '  60018 requests in 30.00s, 19.81MB read'
  '  Socket errors: connect 0, read 0, write 0, timeout 0'   (wrk2 prints it only when not all zero)
  '  Non-2xx or 3xx responses: N'                             (wrk2: status > 399; only when N > 0)
  'Requests/sec:   2000.28'
wrk/limit.lua under wrk2, and wrk.loadgen always:
  'responses: N', 'status CODE: N' (one per code), 'admitted: N requests, R req/s (non-429)'
wrk.loadgen only:
  'Intended rate: R req/s, achieved A req/s (...); sent S of N scheduled; unsent U; reconnects C'
  'Send lag (actual - intended send time): p50 X, p99 Y, max Z'
  'WARNING: could not keep up: ...'

Keys of the dict (None where the output did not say): tool, url, threads, connections, latency_ms
{p50, p75, p90, p99, p99.9, p99.99, p99.999, max, mean, stdev}, completed, duration_s, bytes_read,
requests_per_sec, achieved_rate, errors {connect, read, write, timeout}, non_2xx_3xx, responses,
status {"200": N, ...}, admitted, admitted_per_sec, intended_rate, sent, intended_requests, unsent,
send_lag_ms {p50, p99, max}, kept_up, warnings. The names match `python -m wrk.loadgen --json`.
"""

from __future__ import annotations

import re

PCT_KEYS = {50.0: "p50", 75.0: "p75", 90.0: "p90", 99.0: "p99", 99.9: "p99.9", 99.99: "p99.99",
            99.999: "p99.999", 100.0: "max"}
JSON_PERCENTILES = {k: p for p, k in PCT_KEYS.items()}      # the --json names
FULL_PERCENTILES = tuple(PCT_KEYS)                          # --latency
SHORT_PERCENTILES = (50.0, 90.0, 99.0, 99.9, 100.0)
KEEP_UP_RATE = 0.99       # achieved / requested at or above this (for wrk2 output: the whole rule)...
KEEP_UP_LAG_MS = 10.0     # ...and send-lag p99 at or below this (wrk.loadgen): "kept up"
KEEP_UP_RULE = f"achieved >= {KEEP_UP_RATE:.0%} of requested and send lag p99 <= {KEEP_UP_LAG_MS:g} ms"

_TIME = r"(\d+(?:\.\d+)?)(us|ms|s|m|h)"
_TIME_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}
_BIN = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4, "P": 1024 ** 5}

_RX = {
    "running": re.compile(r"^Running \S+ test @ (\S+)"),
    "threads": re.compile(r"^\s*(\d+) threads and (\d+) connections"),
    "dist": re.compile(r"^\s*Latency Distribution\b(.*)$"),
    "pct_row": re.compile(r"^\s*(\d+(?:\.\d+)?)%\s+" + _TIME + r"\s*$"),
    "stats_row": re.compile(r"^\s+Latency\s+" + _TIME + r"\s+" + _TIME + r"\s+" + _TIME + r"\s+"),
    "requests_in": re.compile(r"^\s*(\d+) requests in " + _TIME + r", (\d+(?:\.\d+)?)([KMGTP]?)B read"),
    "socket_errors": re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)"),
    "non2xx": re.compile(r"Non-2xx or 3xx responses: (\d+)"),
    "rps": re.compile(r"^Requests/sec:\s*(\d+(?:\.\d+)?)"),
    "responses": re.compile(r"^responses: (\d+)\s*$"),
    "status": re.compile(r"^status (\d{3}): (\d+)\s*$"),
    "admitted": re.compile(r"^admitted: (\d+) requests, (\d+(?:\.\d+)?) req/s \(non-429\)"),
    "intended": re.compile(r"^Intended rate: (\d+(?:\.\d+)?) req/s, achieved (\d+(?:\.\d+)?) req/s.*?"
                           r"sent (\d+) of (\d+) scheduled(?:; unsent (-?\d+))?"),
    "closed": re.compile(r"^Closed loop: achieved (\d+(?:\.\d+)?) req/s"),
    "lag": re.compile(r"Send lag \(actual - intended send time\): p50 " + _TIME + r", p99 " + _TIME
                      + r", max " + _TIME),
    "warning": re.compile(r"^WARNING: (.*)$"),
}


# ------------------------------------------------------------------------------- writing (wrk.loadgen)

def _format_units(n: float, base: str, units: tuple, scale: int, digits: int) -> str:
    """wrk's format_units(): step up a unit once the amount reaches 85% of the next one."""
    amt, unit = n, base
    for i in range(len(units) - 1):
        if amt < scale * 0.85:
            break
        amt /= scale
        unit = units[i]
    return f"{amt:.{digits}f}{unit}"


def format_time_us(us: float) -> str:
    """wrk's format_time_us(): 812.00us, 6.67ms, 1.20s, 1.00m."""
    if us >= 1_000_000:
        return _format_units(us / 1_000_000, "s", ("m", "h", None), 60, 2)
    return _format_units(us, "us", ("ms", "s", None), 1000, 2)


def format_binary(n: float) -> str:
    return _format_units(n, "", ("K", "M", "G", "T", "P", None), 1024, 2)


def _units_col(msg: str, width: int) -> str:
    """wrk's print_units(): right-align in width, two trailing spaces less one per letter of unit."""
    pad = 2 - (msg[-1:].isalpha()) - (msg[-2:-1].isalpha())
    w = width - pad
    return msg[:w].rjust(w) + "  "[:pad]


def format_report(r: dict, full_latency: bool = False) -> str:
    """wrk2's text layout, line for line where the two tools share a line (so wrk.report reads both):
    the percentile rows, 'N requests in T, XB read', 'Socket errors: ...', 'Non-2xx or 3xx responses: N'
    (wrk counts status > 399 there), 'Requests/sec:', 'Transfer/sec:'. Then our own lines, which
    wrk/limit.lua also prints under wrk2: 'responses: N', 'status CODE: N',
    'admitted: N requests, R req/s (non-429)'. Then, only from us: 'Intended rate: ...', 'Send lag ...',
    'Generator CPU ...' and, when it fell behind, 'WARNING: could not keep up: ...'."""
    out = []
    dur = r["duration_s"]
    lm = r["latency_ms"]
    us = lambda ms: format_time_us(ms * 1000.0) if ms is not None else "-"  # noqa: E731
    out.append(f"Running {_format_units(r.get('requested_duration_s') or dur, 's', ('m', 'h', None), 60, 0)} "
               f"test @ {r['url']}")
    out.append(f"  {r['threads']} threads and {r['connections']} connections")
    if r["mode"] == "open":
        out.append(f"  Generator: wrk.loadgen, open loop at {r['intended_rate']:g} req/s; "
                   f"latency from each request's intended send time")
    else:
        out.append("  Generator: wrk.loadgen, CLOSED loop (-R 0): max throughput; latency from actual send time")
    if r.get("command"):
        out.append(f"  Command: {r['command']}")
    out.append("  Thread Stats%6s%11s%8s%12s" % ("Avg", "Stdev", "Max", "+/- Stdev"))
    within = lm["within_stdev_pct"] if lm["within_stdev_pct"] is not None else 0.0
    out.append("    %-10s" % "Latency" + _units_col(us(lm["mean"]), 8) + _units_col(us(lm["stdev"]), 10)
               + _units_col(us(lm["max"]), 9) + "%8.2f%%" % within)
    out.append(f"  Latency Distribution (exact - Recorded Latency{', from intended send time' if r['mode'] == 'open' else ''})")
    for p in (FULL_PERCENTILES if full_latency else SHORT_PERCENTILES):
        out.append("%7.3f%%" % p + _units_col(us(lm.get(PCT_KEYS[p])), 10))
    lg = r["send_lag_ms"]
    out.append(f"  Send lag (actual - intended send time): p50 {us(lg['p50'])}, p99 {us(lg['p99'])}, "
               f"max {us(lg['max'])}")
    out.append("----------------------------------------------------------")
    out.append(f"  {r['completed']} requests in {format_time_us(dur * 1e6)}, {format_binary(r['bytes_read'])}B read")
    e = r["errors"]
    out.append(f"  Socket errors: connect {e['connect']}, read {e['read']}, write {e['write']}, "
               f"timeout {e['timeout']}")
    out.append(f"  Non-2xx or 3xx responses: {sum(v for k, v in r['status'].items() if int(k) > 399)}")
    out.append("Requests/sec: %9.2f" % r["requests_per_sec"])
    out.append("Transfer/sec: %10sB" % format_binary(r["bytes_read"] / dur if dur else 0))
    out.append(f"responses: {r['completed']}")
    for code, n in r["status"].items():
        out.append(f"status {code}: {n}")
    out.append(f"admitted: {r['admitted']} requests, {r['admitted_per_sec']:.2f} req/s (non-429)")
    if r["mode"] == "open":
        out.append(f"Intended rate: {r['intended_rate']:.2f} req/s, achieved {r['achieved_rate']:.2f} req/s "
                   f"({r['achieved_rate'] / r['intended_rate']:.2%}); sent {r['sent']} of "
                   f"{r['intended_requests']} scheduled; unsent {r['unsent']}; reconnects {r['reconnects']}")
    else:
        out.append(f"Closed loop: achieved {r['achieved_rate']:.2f} req/s; reconnects {r['reconnects']}")
    out.append(f"Generator CPU: {r['generator_cpu_s']:.2f}s ({r['generator_cpu_pct_of_core']}% of one core)")
    if r["kept_up"] is False:
        out.append("WARNING: could not keep up: " + "; ".join(r["not_kept_up_because"])
                   + f"  [rule: {KEEP_UP_RULE}]")
    return "\n".join(out)


# ----------------------------------------------------------------------------- reading (either tool)

def _ms(value: str, unit: str) -> float:
    return float(value) * _TIME_MS[unit]


def parse_output(text: str, requested_rate: float | None = None) -> dict:
    """Parse wrk2 (--latency or not, with or without wrk/limit.lua) or wrk.loadgen text output.

    requested_rate: the -R of the run. wrk2 does not print it; given, `kept_up` is judged for wrk2
    output too (achieved >= 99% of it). For wrk.loadgen output `kept_up` is what the tool decided.
    """
    r: dict = {
        "tool": None, "url": None, "threads": None, "connections": None,
        "latency_ms": {k: None for k in PCT_KEYS.values()} | {"mean": None, "stdev": None},
        "completed": None, "duration_s": None, "bytes_read": None, "requests_per_sec": None,
        "achieved_rate": None,
        "errors": {"connect": 0, "read": 0, "write": 0, "timeout": 0}, "non_2xx_3xx": 0,
        "responses": None, "status": {}, "admitted": None, "admitted_per_sec": None,
        "intended_rate": requested_rate, "sent": None, "intended_requests": None, "unsent": None,
        "send_lag_ms": None, "kept_up": None, "warnings": [],
    }
    in_table = False          # inside a 'Latency Distribution' table we want
    saw_table = False
    for line in text.splitlines():
        m = _RX["dist"].match(line)
        if m:
            # wrk2 -U adds an 'Uncorrected Latency' table: that is the coordinated-omission view; skip it.
            in_table = "Uncorrected" not in m.group(1) and not saw_table
            saw_table = saw_table or in_table
            continue
        if in_table:
            m = _RX["pct_row"].match(line)
            if m:
                key = PCT_KEYS.get(round(float(m.group(1)), 3))
                if key:
                    r["latency_ms"][key] = _ms(m.group(2), m.group(3))
                continue
            in_table = False   # the first other line ends the table
        if (m := _RX["running"].match(line)):
            r["url"] = m.group(1)
        elif (m := _RX["threads"].match(line)):
            r["threads"], r["connections"] = int(m.group(1)), int(m.group(2))
        elif "Thread calibration:" in line and r["tool"] is None:
            r["tool"] = "wrk2"
        elif "Generator: wrk.loadgen" in line:
            r["tool"] = "wrk.loadgen"
        elif (m := _RX["stats_row"].match(line)):
            r["latency_ms"]["mean"] = _ms(m.group(1), m.group(2))
            r["latency_ms"]["stdev"] = _ms(m.group(3), m.group(4))
            if r["latency_ms"]["max"] is None:
                r["latency_ms"]["max"] = _ms(m.group(5), m.group(6))
        elif (m := _RX["requests_in"].match(line)):
            r["completed"] = int(m.group(1))
            r["duration_s"] = _ms(m.group(2), m.group(3)) / 1000.0
            r["bytes_read"] = round(float(m.group(4)) * _BIN[m.group(5)])
        elif (m := _RX["socket_errors"].search(line)):
            r["errors"] = dict(zip(("connect", "read", "write", "timeout"), map(int, m.groups())))
        elif (m := _RX["non2xx"].search(line)):
            r["non_2xx_3xx"] = int(m.group(1))
        elif (m := _RX["rps"].match(line)):
            r["requests_per_sec"] = float(m.group(1))
        elif (m := _RX["responses"].match(line)):
            r["responses"] = int(m.group(1))
        elif (m := _RX["status"].match(line)):
            r["status"][m.group(1)] = int(m.group(2))
        elif (m := _RX["admitted"].match(line)):
            r["admitted"], r["admitted_per_sec"] = int(m.group(1)), float(m.group(2))
        elif (m := _RX["intended"].match(line)):
            r["intended_rate"], r["achieved_rate"] = float(m.group(1)), float(m.group(2))
            r["sent"], r["intended_requests"] = int(m.group(3)), int(m.group(4))
            r["unsent"] = int(m.group(5)) if m.group(5) is not None else r["intended_requests"] - r["sent"]
        elif (m := _RX["closed"].match(line)):
            r["achieved_rate"] = float(m.group(1))
        elif (m := _RX["lag"].search(line)):
            g = m.groups()
            r["send_lag_ms"] = {"p50": _ms(g[0], g[1]), "p99": _ms(g[2], g[3]), "max": _ms(g[4], g[5])}
        elif (m := _RX["warning"].match(line)):
            r["warnings"].append(m.group(1))
    if r["tool"] is None and r["requests_per_sec"] is not None:
        r["tool"] = "wrk2" if saw_table or "HdrHistogram" in text else "wrk"
    if r["achieved_rate"] is None:
        r["achieved_rate"] = r["requests_per_sec"]
    if r["tool"] == "wrk.loadgen":
        if r["intended_rate"] is not None and r["sent"] is not None:
            r["kept_up"] = not any(w.startswith("could not keep up") for w in r["warnings"])
    elif requested_rate and r["achieved_rate"] is not None:
        r["kept_up"] = r["achieved_rate"] >= KEEP_UP_RATE * requested_rate
        if not r["kept_up"]:
            r["warnings"].append(f"could not keep up: achieved {r['achieved_rate']:.2f} req/s of "
                                 f"{requested_rate:.2f} requested")
    if r["admitted"] is None and r["status"]:
        r["admitted"] = sum(n for code, n in r["status"].items() if code != "429")
    return r


def main(argv=None) -> int:
    """python -m wrk.report FILE [REQUESTED_RATE]: print the parsed dict as JSON."""
    import json
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m wrk.report OUTPUT.txt [REQUESTED_RATE]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        text = f.read()
    print(json.dumps(parse_output(text, float(argv[1]) if len(argv) > 1 else None), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
