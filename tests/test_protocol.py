"""The load-test protocol runner (wrk/protocol.py): a smoke run of the whole thing at a tiny rate, checking
the report's shape only -- this machine is noisy, so no figure is asserted -- plus its pure helpers."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.support import ROOT
from wrk import protocol
from wrk.protocol_report import target_line

ALGS = ("token-bucket", "fixed-window", "sliding-log", "sliding-counter")


def test_quick_protocol_writes_a_report_of_the_right_shape(tmp_path):
    out = tmp_path / "report.md"
    p = subprocess.run([sys.executable, "-m", "wrk.protocol", "--quick", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)   # ~30 s here; a hang fails, not blocks
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^\[\s*1/\d+\] .* elapsed, ~.* left \|", p.stdout, re.M), p.stdout   # progress lines
    md = out.read_text()
    for section in ("# Load-test protocol report", "## 1-2. Baseline vs through the edge", "## 3. Enforcement",
                    "## 4. Connection reuse", "## Invocations", "## Problems"):
        assert section in md, section
    assert re.search(r"\*\*Tool:\*\* (wrk2|wrk\.loadgen)", md)
    assert re.search(r"`nproc` = \d+; load average .* at start .* at end", md)
    assert re.search(r"\*\*Backend:\*\* (nginx|lb\.demo)", md)
    # Invocations: both tools' command lines, and how each target was started.
    assert re.search(r"`python -m wrk\.loadgen -t1 -c50 -d2s -R100 --latency http://127\.0\.0\.1:\d+/`", md)
    assert re.search(r"`WRK_API_KEY=\S+ wrk -t1 -c10 -d3s -R\d+ --latency -s wrk/limit\.lua http://127\.0\.0\.1:\d+/`", md)
    assert re.search(r"`python edge\.py --listen 127\.0\.0\.1:\d+ --backends http://127\.0\.0\.1:\d+ ", md)
    # Latency rows: baseline and edge side by side, with the delta column.
    assert re.search(r"^\| 100 \| 1 \|( [-\d.]+ \|){6} \*\*[-\d.]+\*\* \|", md, re.M), md
    # The reference beside them (nginx is installed by ./run-tests): nginx as the proxy, pinned where the edge is.
    assert "### The reference: nginx as the proxy" in md
    assert re.search(r"^\| 100 \| 1 \|( [-\d.]+ \|){3} \*\*[-\d.]+\*\* \| (yes|NO)", md[md.index("### The reference"):],
                     re.M)   # kept up or not is the machine's: shape, not figures
    assert re.search(r"`python -m wrk\.nginx_target --port \d+ --proxy-to \d+( --cpu \d+)?`", md)
    # Enforcement: one row per algorithm with a PASS/FAIL verdict for the whole run and the steady state.
    for alg in ALGS:
        row = re.search(rf"^\| {alg} / memory \|.*$", md, re.M)
        assert row, alg
        # the whole run's verdict, and the steady state's -- "-" when the --quick run (3 s at a 1-s period)
        # holds no whole period after the first two, which depends on where the run starts against the
        # clock's seconds and on scrape lag on this shared machine: shape, not figures
        verdicts = re.findall(r"\*\*(PASS|FAIL|-)\*\*", row.group(0))
        assert len(verdicts) == 2 and verdicts[0] != "-", row.group(0)
        assert re.search(rf"^- {alg}: .* = [\d,]+ -> [\d.]+/s = [-+][\d.]+%", md, re.M), alg   # the arithmetic
    assert re.search(r"^\| 1 \|( [-\d.]+ \|){4} \*\*[\d.]+x\*\* \|", md, re.M)   # pool vs no-pool, p50 ratio
    png = out.with_suffix(".png")
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_steady_state_skips_the_first_period_and_the_partial_last_one():
    # Samples at t=0.5 (start of sampling), then boundaries 1..5; the run goes 0.6 .. 4.6 at 200 req/s;
    # the final sample (after the run) is off the boundaries.
    samples = [(0.5, 0, 0), (1.0, 80, 0), (2.0, 280, 80), (3.0, 480, 180), (4.0, 680, 280)]
    final = (4.7, 800, 340)
    s = protocol.steady_state(samples, final, demand=200, period=1.0)
    # first busy interval is [0.5, 1.0): the run starts inside it; steady starts 2 intervals later, at 2.0
    assert s["periods"] == 2 and s["admitted"] == 200 and s["rate"] == 100
    assert [round(v) for _, v in s["series"]] == [160, 120, 100, 100, 86]


def test_the_target_verdict_does_not_count_a_run_that_measured_a_busy_machine():
    deltas = {(1000, 1): 0.3, (1000, 2): 0.4, (2000, 1): 9.0}
    assert "**MET**" in target_line(deltas, 0.5, "memory store", {(1000, 1): 0.6, (1000, 2): 0.9})
    assert "**MIXED" in target_line({(1000, 1): 0.3, (1000, 2): 0.7}, 0.5, "memory store", {})
    # run 2's nginx-direct p99 was 800 ms: its -91 ms "delta" is the machine, not the edge
    line = target_line({(1000, 1): 0.3, (1000, 2): -91.1}, 0.5, "memory store", {(1000, 1): 0.6, (1000, 2): 804.35})
    assert "NOT MEASURED (the machine was busy: run 2's nginx-direct p99 was 804.35 ms); the other runs met it" in line
    assert target_line({(500, 1): 0.1}, 0.5, "memory store", {}) is None


def test_allowance_arithmetic():
    assert protocol.allowance("token-bucket", 100)[0] == 100
    assert protocol.allowance("fixed-window", 100)[0] == 100
    assert protocol.allowance("sliding-log", 100)[0] == 0


def test_wrk2_is_told_apart_from_plain_wrk(tmp_path, monkeypatch):
    fake = tmp_path / "wrk"
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    fake.write_text("#!/bin/sh\necho 'Usage: wrk <options> <url>'\necho '    -c, --connections <N>'\nexit 1\n")
    fake.chmod(0o755)
    assert protocol.detect_wrk2() is False
    fake.write_text("#!/bin/sh\necho 'Usage: wrk <options> <url>'\necho '    -R, --rate        <T>  work rate'\nexit 1\n")
    assert protocol.detect_wrk2() is True


def test_commands_for_both_tools():
    wrk2, lg = protocol.commands("http://127.0.0.1:9/", 200, 60, 10, "k1", "wrk/limit.lua")
    assert wrk2 == "WRK_API_KEY=k1 wrk -t1 -c10 -d60s -R200 --latency -s wrk/limit.lua http://127.0.0.1:9/"
    assert lg == "python -m wrk.loadgen -t1 -c10 -d60s -R200 --latency -H 'X-Api-Key: k1' http://127.0.0.1:9/"
    wrk2, lg = protocol.commands("http://127.0.0.1:9/", 1000, 30, 50, None, None)
    assert wrk2 == "wrk -t2 -c50 -d30s -R1000 --latency http://127.0.0.1:9/"
