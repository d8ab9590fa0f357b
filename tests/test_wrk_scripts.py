"""wrk/limit.lua and wrk/keyed.lua executed by a real wrk binary against a real edge on 127.0.0.1.

Debian's `wrk` 4.1 (./run-tests installs it) always runs. wrk2 cannot be installed from a package; set
WRK2=/path/to/wrk2 (built from giltene/wrk2 with `make`) to run the same tests under it too. The two
differ where it matters here: wrk2's thread:get() copies a table with keys and values swapped, which is
why limit.lua passes only scalars between its threads and the main state.

Runs are short (1 s, a few connections) and bounded by the tool's -d plus a subprocess timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.support import ROOT, Edge, request, wait_until
from wrk.protocol import detect_wrk2
from wrk.report import parse_output

TOOLS = [
    pytest.param(shutil.which("wrk"), id="wrk",
                 marks=pytest.mark.skipif(not shutil.which("wrk"), reason="wrk is not installed (./run-tests installs it)")),
    pytest.param(os.environ.get("WRK2"), id="wrk2",
                 marks=pytest.mark.skipif(not os.environ.get("WRK2"), reason="set WRK2=/path/to/wrk2 to run under wrk2")),
]
CONNS = 4


def run_wrk(exe: str, url: str, script: str, key: str | None) -> subprocess.CompletedProcess:
    rate = ["-R400"] if detect_wrk2(exe) else []      # wrk2 requires a rate; plain wrk is closed loop
    env = {k: v for k, v in os.environ.items() if k != "WRK_API_KEY"} | ({"WRK_API_KEY": key} if key else {})
    p = subprocess.run([exe, "-t2", f"-c{CONNS}", "-d1s", *rate, "-s", script, url], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def metric(edge: Edge, name: str) -> int:
    """The sum of a counter's samples over its labels (lb_rate_limited_total is per rule), dry runs aside."""
    text = request(edge.admin_port, "GET", "/metrics").body.decode()
    found = re.findall(rf"^{name}(\{{[^}}]*\}})? (\d+)", text, re.M)
    assert found, name
    return sum(int(n) for labels, n in found if 'dry_run="true"' not in labels)


@pytest.mark.parametrize("exe", TOOLS)
def test_limit_lua_counts_each_status_as_the_edge_answered_it(exe, backend):
    # Two threads, both statuses on each: the counts must add up across threads, per status.
    edge = Edge("--backends", backend.url, "--limit", "10/s", "--algorithm", "fixed-window",
                "--admin", "127.0.0.1:0", name="edge-limit-lua")
    try:
        p = run_wrk(exe, f"http://127.0.0.1:{edge.port}/", "wrk/limit.lua", "wrk-k1")
        r = parse_output(p.stdout)
        wrk_total = int(re.search(r"(\d+) requests in", p.stdout).group(1))
        assert r["responses"] == wrk_total, p.stdout              # one response() per completed request
        assert set(r["status"]) == {"200", "429"}, p.stdout
        assert r["status"]["200"] + r["status"]["429"] == wrk_total
        assert r["admitted"] == r["status"]["200"]
        assert r["admitted_per_sec"] == pytest.approx(r["status"]["200"] / r["duration_s"], rel=0.02)
        # The edge's own counters: what it answered, less at most one in-flight request per connection
        # that the tool stopped waiting for.
        limited = wait_until(lambda: (n := metric(edge, "lb_rate_limited_total")) >= r["status"]["429"] and n,
                             what="the edge to count the 429s wrk saw")
        assert limited - r["status"]["429"] <= CONNS, (limited, p.stdout)
        answered = metric(edge, "lb_request_duration_seconds_count")
        assert 0 <= (answered - limited) - r["status"]["200"] <= CONNS, (answered, limited, p.stdout)
        assert "WRK_API_KEY was not set" not in p.stdout
    finally:
        edge.stop()


@pytest.mark.parametrize("exe", TOOLS)
def test_keyed_lua_sends_the_key_from_every_thread(exe, backend):
    # Clients are limited to 1/s by IP; only the key is allowed more. One thread without the key would
    # show as 429s.
    edge = Edge("--backends", backend.url, "--limit", "1/s", "--key-limit", "wrk-unlimited=1000000/s",
                "--admin", "127.0.0.1:0", name="edge-keyed-lua")
    try:
        url = f"http://127.0.0.1:{edge.port}/"
        p = run_wrk(exe, url, "wrk/keyed.lua", "wrk-unlimited")
        r = parse_output(p.stdout)
        assert r["completed"] > 10 and r["non_2xx_3xx"] == 0, p.stdout
        assert metric(edge, "lb_rate_limited_total") == 0
        # Without WRK_API_KEY: no key is sent (keyed.lua says so), and the per-IP limit answers 429.
        p = run_wrk(exe, url, "wrk/keyed.lua", None)
        assert "WRK_API_KEY is not set" in p.stderr
        assert parse_output(p.stdout)["non_2xx_3xx"] > 0, p.stdout
    finally:
        edge.stop()
