"""wrk.loadgen (the open-loop generator), wrk.report (one parser for wrk2's output and ours); the
Lua scripts run under real wrk binaries in tests/test_wrk_scripts.py. Real runs are short and slow (tens of requests/s, 0.5-2 s) against the identity
backend; timings are asserted only with wide margins, since the machine is shared and noisy."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support import PY, ROOT, free_port
from wrk import loadgen, report
from wrk.report import parse_output

DATA = Path(__file__).parent / "data"
JSON_KEYS = {
    "tool", "command", "url", "threads", "connections", "mode", "intended_rate", "duration_s",
    "intended_requests", "sent", "unsent", "completed", "achieved_rate", "requests_per_sec", "status",
    "errors", "admitted", "admitted_per_sec", "latency_ms", "send_lag_ms", "kept_up", "kept_up_rule",
    "reconnects", "bytes_read",
}


def cli(*args: str, script: bool = False, timeout: float = 30) -> subprocess.CompletedProcess:
    cmd = [PY, "wrk/loadgen.py"] if script else [PY, "-m", "wrk.loadgen"]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def assert_accounted(r: dict) -> None:
    """Every request handed to a connection ended as exactly one response or one error."""
    assert r["sent"] == sum(r["status"].values()) + sum(r["errors"].values()), r
    assert r["completed"] == sum(r["status"].values())
    if r["mode"] == "open":
        assert r["sent"] + r["unsent"] == r["intended_requests"]


# ------------------------------------------------------------------------------------------- runs

def test_smoke_run_counts_add_up_and_json_has_the_runner_fields(backend, tmp_path):
    out = tmp_path / "r.json"
    p = cli("-t", "1", "-c", "4", "-d", "2s", "-R", "200", "--latency", "--json", str(out), f"{backend.url}/")
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert JSON_KEYS <= set(r)
    assert set(r["latency_ms"]) >= {"p50", "p75", "p90", "p99", "p99.9", "p99.99", "max"}
    assert set(r["errors"]) == {"connect", "read", "write", "timeout"}
    assert r["mode"] == "open" and r["intended_rate"] == 200 and r["duration_s"] == pytest.approx(2, abs=0.01)
    assert r["intended_requests"] == 400
    assert_accounted(r)
    assert r["status"].get("200", 0) >= 0.9 * r["sent"]
    assert 0.5 * 200 <= r["achieved_rate"] <= 1.1 * 200        # generous: a shared 2-core machine
    lm = r["latency_ms"]
    assert 0 < lm["p50"] <= lm["p90"] <= lm["p99"] <= lm["p99.9"] <= lm["max"]

    # The text says the same as the JSON, through the one parser the protocol runner will use.
    t = parse_output(p.stdout)
    assert t["tool"] == "wrk.loadgen"
    assert t["completed"] == r["completed"] and t["status"] == r["status"] and t["errors"] == r["errors"]
    assert t["requests_per_sec"] == pytest.approx(r["requests_per_sec"], abs=0.01)
    assert t["admitted"] == r["admitted"] and t["intended_rate"] == 200
    assert t["latency_ms"]["p99.999"] is not None                  # --latency: the full list
    assert t["kept_up"] == r["kept_up"]


def test_script_form_two_workers_and_closed_loop(backend):
    p = cli("-t2", "-c4", "-d1s", "-R100", "--json", "-", f"{backend.url}/", script=True)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout[p.stdout.index("\n{") + 1:])
    assert r["threads"] == 2 and r["intended_requests"] == 100
    assert_accounted(r)
    assert r["completed"] >= 50
    # -R 0: closed loop, for the maximum; no intended times, so no keep-up verdict.
    c = loadgen.run(f"{backend.url}/", threads=1, connections=2, duration=0.5, rate=0)
    assert c["mode"] == "closed" and c["kept_up"] is None and c["completed"] > 0
    assert c["sent"] == c["completed"] + sum(c["errors"].values())


def test_rate_is_required_like_wrk2():
    p = cli("-d1s", "http://127.0.0.1:9/")
    assert p.returncode == 2 and "-R" in p.stderr


def test_dead_port_gives_connect_errors_not_a_crash():
    port = free_port()   # nothing listens there
    p = cli("-t1", "-c2", "-d1s", "-R50", "--json", "-", f"http://127.0.0.1:{port}/")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout[p.stdout.index("\n{") + 1:])
    assert r["completed"] == 0 and r["sent"] > 0
    assert r["errors"]["connect"] == r["sent"]
    assert_accounted(r)
    assert r["kept_up"] is False
    assert "WARNING: could not keep up" in p.stdout
    assert parse_output(p.stdout)["errors"]["connect"] == r["sent"]


def test_latency_counts_from_the_intended_send_time(backend):
    """One connection, 200 ms per response, 20 requests/s wanted: requests queue behind each other.
    A closed-loop tool would report ~200 ms; counted from when each request should have gone out,
    request k waits ~k*150 ms more (coordinated-omission correction, as wrk2 does)."""
    r = loadgen.run(f"{backend.url}/slow?ms=200", threads=1, connections=1, duration=2.0, rate=20)
    assert_accounted(r)
    assert r["completed"] >= 4
    assert r["latency_ms"]["p50"] > 2 * 200
    assert r["latency_ms"]["max"] > 4 * 200
    assert r["send_lag_ms"]["max"] > 200          # they really waited for the one connection
    assert r["unsent"] > 0 and r["kept_up"] is False
    assert any("achieved" in why for why in r["not_kept_up_because"])


def test_body_framings_and_error_kinds(backend):
    url = backend.url
    run = lambda path, **kw: loadgen.run(url + path, threads=1, connections=2, duration=0.5,  # noqa: E731
                                         rate=kw.pop("rate", 20), **kw)
    for path in ("/chunked?parts=5", "/big?bytes=300000", "/cookies"):
        r = run(path)
        assert_accounted(r)
        assert r["completed"] >= 5 and set(r["status"]) == {"200"}, (path, r["errors"])
    big = run("/big?bytes=300000", rate=10)
    assert big["bytes_read"] >= big["completed"] * 300000
    for path, kind in (("/reset", "read"), ("/garbage", "read")):
        r = run(path)
        assert_accounted(r)
        assert r["completed"] == 0 and r["errors"][kind] == r["sent"] > 0, (path, r["errors"])
    r = run("/hang", timeout=0.3)
    assert_accounted(r)
    assert r["completed"] == 0 and r["errors"]["timeout"] > 0


def test_request_bytes():
    host, port, req = loadgen.build_request("http://127.0.0.1:8080/echo?x=1", "POST",
                                            [("X-Api-Key", "k1")], "hello")
    assert (host, port) == ("127.0.0.1", 8080)
    assert req == (b"POST /echo?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nX-Api-Key: k1\r\n"
                   b"Content-Length: 5\r\n\r\nhello")
    assert loadgen.build_request("http://h/")[2] == b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"


def test_flags_and_units_follow_wrk():
    assert loadgen.parse_duration("10s") == 10 and loadgen.parse_duration("1m") == 60
    assert loadgen.parse_duration("2h") == 7200 and loadgen.parse_duration("30") == 30
    assert loadgen.parse_metric("2k") == 2000 and loadgen.parse_metric("150") == 150
    # wrk's units: a step up at 85% of the next unit; seconds and minutes past 1 s.
    assert report.format_time_us(812) == "812.00us"
    assert report.format_time_us(850) == "0.85ms"
    assert report.format_time_us(6670) == "6.67ms"
    assert report.format_time_us(1_200_000) == "1.20s"
    assert report.format_time_us(60_000_000) == "1.00m"
    assert report.format_binary(19.81 * 1024 * 1024) == "19.81M"
    assert report._units_col("6.67ms", 10) == "    6.67ms" and report._units_col("1.20s", 10) == "    1.20s "


# ------------------------------------------------------------------------------------- the parser

def test_parse_wrk2_latency_output():
    r = parse_output((DATA / "wrk2_latency.txt").read_text(), requested_rate=2000)
    assert r["tool"] == "wrk2"
    assert (r["threads"], r["connections"], r["url"]) == (2, 100, "http://127.0.0.1:80/index.html")
    assert r["latency_ms"] == {"p50": 6.67, "p75": 7.78, "p90": 9.14, "p99": 11.18, "p99.9": 12.30,
                               "p99.99": 12.45, "p99.999": 12.50, "max": 12.50, "mean": 6.60, "stdev": 1.92}
    assert r["completed"] == 60018 and r["duration_s"] == 30.0
    assert r["bytes_read"] == round(19.81 * 1024 ** 2)
    assert r["requests_per_sec"] == 2000.28 and r["achieved_rate"] == 2000.28
    assert r["errors"] == {"connect": 0, "read": 0, "write": 0, "timeout": 0} and r["non_2xx_3xx"] == 0
    assert r["status"] == {} and r["admitted"] is None          # no limit.lua in this run
    assert r["kept_up"] is True


def test_parse_wrk2_without_latency_flag():
    r = parse_output((DATA / "wrk2_plain.txt").read_text(), requested_rate=2500)
    assert r["tool"] == "wrk2" and r["requests_per_sec"] == 2000.15 and r["duration_s"] == 30.01
    assert r["latency_ms"]["p99"] is None
    assert r["latency_ms"]["max"] == 12.34 and r["latency_ms"]["mean"] == 6.46
    assert r["kept_up"] is False and r["warnings"]


def test_parse_wrk2_enforcement_run_with_limit_lua_and_uncorrected_table():
    r = parse_output((DATA / "wrk2_limit_u.txt").read_text(), requested_rate=200)
    assert r["latency_ms"]["p50"] == 1.13 and r["latency_ms"]["max"] == 52.22    # Recorded, not -U's
    assert r["latency_ms"]["p99.99"] == 41.44
    assert r["duration_s"] == 60.0 and r["completed"] == 11998                   # '1.00m'
    assert r["errors"]["timeout"] == 2 and r["non_2xx_3xx"] == 5982
    assert r["responses"] == 11998 and r["status"] == {"200": 6016, "429": 5982}
    assert r["admitted"] == 6016 and r["admitted_per_sec"] == 100.26
    assert r["requests_per_sec"] == 199.95 and r["kept_up"] is True


@pytest.mark.parametrize("name", ["loadgen_nginx", "loadgen_slow"])
def test_parse_captured_loadgen_output_agrees_with_its_json(name):
    text = (DATA / f"{name}.txt").read_text()
    js = json.loads((DATA / f"{name}.json").read_text())
    r = parse_output(text)
    assert r["tool"] == "wrk.loadgen"
    for k in ("completed", "status", "errors", "admitted", "sent", "intended_requests", "unsent", "kept_up",
              "threads", "connections", "url", "intended_rate"):
        assert r[k] == js[k], k
    assert r["requests_per_sec"] == pytest.approx(js["requests_per_sec"], abs=0.01)
    assert r["admitted_per_sec"] == pytest.approx(js["admitted_per_sec"], abs=0.01)
    for k in ("p50", "p90", "p99", "max"):   # printed with 2 decimals in a unit: within 0.5%
        assert r["latency_ms"][k] == pytest.approx(js["latency_ms"][k], rel=0.005, abs=0.006), k


