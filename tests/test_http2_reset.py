"""A client's RST_STREAM frees the HTTP/1.1 backend at once (nginx on a client abort): the try waiting on
a slow backend is ended, its in-flight slot given back, the connection closed rather than pooled, the
request logged as the client's 499 -- no backend failure, no retry -- and the HTTP/2 connection serves on."""

import json

import pytest
from h2.errors import ErrorCodes

from tests.h2client import H2Client
from tests.support import Backend, Edge, request, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    b = Backend("h2reset")
    log = tmp_path_factory.mktemp("h2reset") / "access.log"
    e = Edge(
        "--backends",
        b.url,
        "--health-interval",
        "30",
        "--admin",
        "127.0.0.1:0",
        "--access-log",
        str(log),
        "--read-timeout",
        "60",
    )
    e.access_path = log
    yield e, b
    e.stop()
    b.stop()


def status(e) -> dict:
    return json.loads(request(e.admin_port, "GET", "/status").body)


def test_a_reset_stream_frees_the_backend_at_once_and_is_the_clients_499(setup):
    e, b = setup
    c = H2Client(e.port)
    try:
        sid = c.request("/slow?ms=30000")  # the backend would answer in 30 s
        wait_until(lambda: status(e)["backends"][0]["inflight"] == 1, what="the slow request at the backend")
        c.h2.reset_stream(sid, ErrorCodes.CANCEL)
        c.flush()
        # Freed well before the backend's answer (30 s): generous for a shared machine, far from 30.
        wait_until(lambda: status(e)["backends"][0]["inflight"] == 0, timeout=10, what="the in-flight slot back")
        wait_until(lambda: " 499 " in e.access_path.read_text(), timeout=10, what="the 499 in the access log")
        line = [ln for ln in e.access_path.read_text().splitlines() if "/slow" in ln][-1]
        assert " 499 " in line, line
        st = status(e)["backends"][0]
        assert st["state"] == "UP" and not st["ejected"] and st["times_ejected"] == 0, st
        metrics = request(e.admin_port, "GET", "/metrics").body.decode()
        counted = [
            ln
            for ln in metrics.splitlines()
            if ln.startswith(("lb_upstream_errors_total{", "lb_retries_total{")) and not ln.endswith(" 0")
        ]
        assert not counted, counted  # no backend failure, no retry: the client's going
        # The same HTTP/2 connection serves on.
        r = c.response(c.request("/echo"))
        assert r["headers"][b":status"] == b"200", r
    finally:
        c.close()


def test_a_closed_connection_frees_the_backend_of_its_streams(setup):
    e, b = setup
    c = H2Client(e.port)
    try:
        c.request("/slow?ms=30000")
        wait_until(lambda: status(e)["backends"][0]["inflight"] == 1, what="the slow request at the backend")
    finally:
        c.close()
    wait_until(lambda: status(e)["backends"][0]["inflight"] == 0, timeout=10, what="the in-flight slot back")
    assert status(e)["backends"][0]["times_ejected"] == 0
