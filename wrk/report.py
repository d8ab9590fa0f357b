"""Read a load-test run's text output, wrk2's or wrk.loadgen's, into one dict.

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
KEEP_UP_RATE = 0.99   # the same rule wrk.loadgen applies (for wrk2 output: on the rate alone)

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
