"""The load-test protocol runner (wrk/protocol.py): its pure helpers. The smoke run of the whole thing
(--quick) is the spec's milestone 8: tests/acceptance/test_m8_load_test.py."""

from __future__ import annotations

import os

from wrk import protocol
from wrk.protocol_report import target_line


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
