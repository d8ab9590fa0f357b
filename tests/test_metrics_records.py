"""Metrics.backend_done keeps its counts in per-(backend, status, version) records, added to the counters when
they are read (snapshot, by_label) and a histogram's count is its buckets' sum: the numbers /metrics shows must
be the ones the per-call counters gave, whichever path counted them."""

import re

from lb.ops.metrics import Metrics


def _value(text: str, series: str) -> float:
    m = re.search(r"^" + re.escape(series) + r" (\S+)$", text, re.M)
    assert m, series
    return float(m.group(1))


def test_records_and_the_other_paths_add_up_in_every_family():
    m = Metrics()
    m.declare_backends(["http://a", "http://b"])
    for _ in range(3):
        m.backend_done("http://a", 200, 0.002, 0.001, b"HTTP/1.1")  # relayed: protocol counted with it
    m.backend_done("http://a", 204, 0.003, 0.002, b"HTTP/1.0")
    m.backend_done("http://a", 503, 0.2, 0.1, b"HTTP/1.1")
    m.backend_done("http://b", 101, 0.004)  # a tunnel's handshake: its protocol counted by answered()
    m.answered(b"HTTP/1.1")
    m.upstream_error("http://a", "reset", 502, 0.05)  # the same families, through _inc and _observe
    m.try_failed("http://b", "connect")
    m.client_failed("http://a", 499, 0.01)
    m.answered(b"HTTP/1.1")
    m.answered(b"HTTP/1.1")
    text = m.render()
    assert _value(text, 'lb_requests_total{backend="http://a"}') == 3 + 1 + 1 + 1 + 1
    assert _value(text, 'lb_requests_total{backend="http://b"}') == 1 + 1
    assert _value(text, 'lb_backend_responses_total{backend="http://a",code="2xx"}') == 4
    assert _value(text, 'lb_backend_responses_total{backend="http://a",code="5xx"}') == 1
    assert _value(text, 'lb_backend_responses_total{backend="http://b",code="1xx"}') == 1
    assert _value(text, 'lb_requests_by_protocol_total{protocol="HTTP/1.1"}') == 3 + 1 + 3
    assert _value(text, 'lb_requests_by_protocol_total{protocol="HTTP/1.0"}') == 1
    assert _value(text, 'lb_request_duration_seconds_count{code="2xx"}') == 4
    assert _value(text, 'lb_request_duration_seconds_count{code="5xx"}') == 2  # the 503 and the 502
    assert _value(text, 'lb_request_duration_seconds_bucket{code="5xx",le="0.25"}') == 2
    assert _value(text, 'lb_request_duration_seconds_bucket{code="5xx",le="0.1"}') == 1
    assert _value(text, 'lb_request_duration_seconds_sum{code="2xx"}') == 0.009
    assert _value(text, 'lb_upstream_duration_seconds_count{backend="http://a"}') == 5
    assert _value(text, 'lb_upstream_duration_seconds_count{backend="http://b"}') == 1  # seconds stood in
    assert _value(text, 'lb_upstream_duration_seconds_sum{backend="http://b"}') == 0.004
    assert m.by_label("lb_backend_responses_total", "code")["1xx"] == 1
    snap = m.snapshot(worker=0)
    assert snap["served"] == 4 + 2 + 1 + 1  # every lb_request_duration_seconds count: 2xx, 5xx, 1xx, 4xx
