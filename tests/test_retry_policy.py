"""Retries by condition (--retry-on): the policy as a value, then through real edges and raw backends."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from lb.upstream.retrypolicy import RETRY_AFTER_MAX, RetryPolicy, parse_conditions, retry_after
from tests.rawserver import ConnReader, RawServer, RecordingBackend, read_request
from tests.support import Edge, request, wait_until
import json

from tests.test_failover import admin, metric

# -- the policy ---------------------------------------------------------------------------------------

ALL = ("connect", "reset", "timeout", "5xx")


@pytest.mark.parametrize("method", [b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE"])
@pytest.mark.parametrize("kind,status,cond", [("connect", None, "connect"), ("reset", None, "reset"),
                                              ("timeout", None, "timeout"), ("status", 503, "5xx"),
                                              ("status", 500, "5xx")])
def test_an_idempotent_method_with_a_buffered_body_is_retried_for_every_condition(method, kind, status, cond):
    p = RetryPolicy(ALL)
    assert p.should_retry(kind, status, method, replayable=True, sent_to_client=False) == cond


@pytest.mark.parametrize("method", [b"POST", b"PATCH", b"TRACE", b"CONNECT"])
def test_a_non_idempotent_method_is_retried_only_for_a_connect_failure(method):
    p = RetryPolicy(ALL)
    assert p.should_retry("connect", None, method, True, False) == "connect"
    for kind, status in (("reset", None), ("timeout", None), ("status", 502)):
        assert p.should_retry(kind, status, method, True, False) is None


def test_a_streamed_body_or_a_response_already_begun_is_never_retried_but_for_connect():
    p = RetryPolicy(ALL)
    for kind, status in (("reset", None), ("timeout", None), ("status", 503)):
        assert p.should_retry(kind, status, b"GET", replayable=False, sent_to_client=False) is None
        assert p.should_retry(kind, status, b"GET", replayable=True, sent_to_client=True) is None
    assert p.should_retry("connect", None, b"POST", replayable=False, sent_to_client=False) == "connect"


def test_only_the_configured_conditions_and_statuses_are_retried():
    p = RetryPolicy("503")
    assert p.statuses == {503}
    assert p.should_retry("status", 503, b"GET", True, False) == "503"
    for status in (500, 502, 504, 404, 200):
        assert p.should_retry("status", status, b"GET", True, False) is None
    assert p.should_retry("connect", None, b"GET", True, False) is None     # the list replaces the default
    assert p.should_retry("protocol", None, b"GET", True, False) is None    # never a condition
    assert RetryPolicy().on == {"connect"} and not RetryPolicy().statuses
    assert RetryPolicy("5xx,503").condition("status", 503) == "503"         # the narrower name counts


def test_the_backoff_is_full_jitter_under_an_exponential_cap():
    top = RetryPolicy(rng=lambda: 0.999999)
    assert [round(top.backoff(n), 4) for n in range(6)] == [0.025, 0.05, 0.1, 0.2, 0.25, 0.25]
    assert RetryPolicy(rng=lambda: 0.0).backoff(3) == 0.0
    assert RetryPolicy(rng=lambda: 0.5).backoff(1) == pytest.approx(0.025)
    assert top.backoff(10_000) <= 0.25                                       # no overflow, still capped


def test_conditions_parse_and_name_what_is_wrong():
    assert parse_conditions("connect, 503,5xx,503") == ("connect", "503", "5xx")
    assert parse_conditions(["Reset", "timeout"]) == ("reset", "timeout")
    with pytest.raises(ValueError, match="'418'"):
        parse_conditions("connect,418")


def test_retry_after_takes_seconds_or_a_date_and_is_bounded():
    assert retry_after(b"5") == 5.0
    assert retry_after(b" 0 ") == 0.0
    assert retry_after(b"86400") == RETRY_AFTER_MAX
    assert retry_after(b"Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)
    assert retry_after(b"soon") is None and retry_after(b"-3") is None


def test_the_config_names_the_key_of_a_bad_condition(tmp_path):
    from lb.config import load as config
    from lb.errors import ConfigError
    with pytest.raises(ConfigError, match=r"--retry-on: unknown retry condition '418'"):
        config.load(["--backends", "http://127.0.0.1:1", "--retry-on", "connect,418"])
    f = tmp_path / "edge.toml"
    f.write_text('[[backends]]\nurl = "http://127.0.0.1:1"\n[upstream]\nretry_on = ["reset", "50x"]\nper_try_timeout = 1\n')
    with pytest.raises(ConfigError, match=r"upstream.retry_on: unknown retry condition '50x'"):
        config.load(["--config", str(f)])
    f.write_text('[[backends]]\nurl = "http://127.0.0.1:1"\n[upstream]\nretry_on = ["reset", "503"]\nper_try_timeout = 1\n')
    c = config.load(["--config", str(f)])
    assert c.retry_on == ("reset", "503") and c.per_try_timeout == 1.0
    assert config.load(["--backends", "http://127.0.0.1:1"]).retry_on == ("connect",)


# -- through an edge -----------------------------------------------------------------------------------

class Scripted(RawServer):
    """Answers /health with 200 and every other request with answer(n) (n: 0, 1, ... of those it got):
    bytes to send (then the connection is closed), or a callable run on the socket."""

    def __init__(self, answer):
        self.answer, self.got, self.at = answer, [], []
        super().__init__(self._serve)

    def _serve(self, s, _server):
        r = ConnReader(s)
        try:
            req = read_request(r)
        except EOFError:
            return
        if req is None:
            return
        if req[1] == "/health":
            s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        with self.lock:
            n = len(self.got)
            self.got.append(req[0])
            self.at.append(time.monotonic())
        out = self.answer(n)
        if callable(out):
            out(s)
        else:
            s.sendall(out)


def edge_for(backends, retry_on, *extra):
    return Edge("--backends", ",".join(b.url for b in backends), "--strategy", "round-robin",
                "--health-interval", "30", "--admin", "127.0.0.1:0", "--retry-on", retry_on,
                "--eject-after", "0", *extra)     # passive health would take the sick one out mid-test


UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nConnection: close\r\n\r\nbusy"


def served(e, n=4):
    return [(r.status, r.body) for r in (request(e.port, "GET", f"/r{i}") for i in range(n))]


@pytest.fixture
def ok():
    b = RecordingBackend()
    yield b
    b.close()


def test_a_get_answered_503_is_retried_on_the_other_backend_but_a_post_is_not(ok):
    sick = Scripted(lambda n: UNAVAILABLE)
    e = edge_for([sick, ok], "503")
    try:
        got = served(e)
        assert [s for s, _ in got] == [200] * 4, got
        assert sick.got, "the sick backend was never asked"
        wait_until(lambda: metric(e, 'lb_retries_by_condition_total{condition="503"}') == len(sick.got),
                   what="the retries counted by condition")
        assert metric(e, f'lb_retries_total{{backend="{sick.url}"}}') == len(sick.got)
        retries = json.loads(admin(e, "GET", "/status")[1])["retries"]
        assert retries["on"] == ["503"] and retries["by_condition"]["503"] == len(sick.got)
        assert retries["by_condition"]["connect"] == 0                 # every condition there from the start
        posts = [request(e.port, "POST", f"/p{i}", body=b"x") for i in range(4)]
        assert 503 in [r.status for r in posts]                         # the backend's own 503, relayed
        assert [r.body for r in posts if r.status == 503][0] == b"busy"
        assert sick.got.count("POST") == [r.status for r in posts].count(503)
    finally:
        e.stop()
        sick.close()


def test_a_reset_inside_the_response_head_is_retried_for_a_get_with_reset(ok):
    def cut(s):
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-")
        s.shutdown(socket.SHUT_RDWR)
    sick = Scripted(lambda n: cut)
    e = edge_for([sick, ok], "reset")
    try:
        got = served(e)
        assert [s for s, _ in got] == [200] * 4 and sick.got, got
        assert metric(e, 'lb_retries_by_condition_total{condition="reset"}') == len(sick.got)
        r = [request(e.port, "POST", f"/p{i}", body=b"x").status for i in range(2)]
        assert 502 in r                                                  # a POST is answered, not retried
    finally:
        e.stop()
        sick.close()


def test_a_try_with_no_head_within_the_per_try_timeout_is_retried_with_timeout(ok):
    release = threading.Event()

    def hang(s):
        release.wait(10)
    slow = Scripted(lambda n: hang)
    e = edge_for([slow, ok], "timeout", "--per-try-timeout", "0.3", "--read-timeout", "20")
    try:
        t0 = time.monotonic()
        got = served(e)
        assert [s for s, _ in got] == [200] * 4 and slow.got, got
        assert time.monotonic() - t0 < 8                  # the 20 s read timeout never ran out
        assert metric(e, 'lb_retries_by_condition_total{condition="timeout"}') == len(slow.got)
        assert "per-try timeout" in e.log()
    finally:
        release.set()
        e.stop()
        slow.close()


def test_nothing_is_retried_once_a_byte_of_the_response_reached_the_client(ok):
    def truncated(s):
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n" + b"x" * 1000)
        time.sleep(0.2)
        s.shutdown(socket.SHUT_RDWR)
    sick = Scripted(lambda n: truncated)
    e = edge_for([sick, ok], "connect,reset,timeout,5xx")
    try:
        import http.client
        failed = 0
        for i in range(4):
            try:
                r = request(e.port, "GET", f"/t{i}")
                assert r.status == 200 and r.body.startswith(b"target=")
            except http.client.IncompleteRead:
                failed += 1
        assert failed == len(sick.got) >= 1
        sent = [r for r in ok.take() if r[1].startswith("/t")]
        assert len(sent) == 4 - failed                      # the truncated ones were never sent again
        assert metric(e, "lb_retries_by_condition_total") == 0
    finally:
        e.stop()
        sick.close()


def test_a_retry_after_on_a_503_keeps_the_backend_out_of_the_rotation_that_long(ok):
    once = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 5\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    fine = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\nrest"
    tired = Scripted(lambda n: once if n == 0 else fine)
    e = edge_for([tired, ok], "503")
    try:
        wait_until(lambda: request(e.port, "GET", "/a").status == 200 and tired.got, what="a 503 from it")
        rested = tired.at[0]
        st = json.loads(admin(e, "GET", "/status")[1])["backends"]
        assert 0 < [b for b in st if b["url"] == tired.url][0]["resting_for"] <= 5
        # Every request goes to the other backend until the 5 s are up; then it is picked again.
        wait_until(lambda: request(e.port, "GET", "/b").body == b"rest", timeout=15, interval=0.1,
                   what="the rested backend back in rotation")
        assert tired.at[1] - rested >= 4.5, tired.at[1] - rested
        assert "Retry-After: 5" in e.log()
    finally:
        e.stop()
        tired.close()


def test_a_streamed_request_body_is_not_retried_on_a_503(ok):
    sick = Scripted(lambda n: UNAVAILABLE)
    e = edge_for([sick, ok], "503", "--request-buffering", "off")
    try:
        got = [request(e.port, "PUT", f"/s{i}", body=b"x" * 200_000).status for i in range(4)]
        assert got.count(503) == len(sick.got) >= 1, got                # a body never held whole: not replayed
        assert metric(e, "lb_retries_by_condition_total") == 0
        assert [request(e.port, "GET", f"/g{i}").status for i in range(4)] == [200] * 4   # no body: retried
    finally:
        e.stop()
        sick.close()
