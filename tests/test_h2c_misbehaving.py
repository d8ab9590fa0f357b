"""h2c:// backends that do what gRPC libraries rarely do (tests/h2server.py, scripted): the edge's side of
each backend stream must still end, or the backend's stream limit fills with streams nobody uses."""

import pytest

from tests.h2client import H2Client
from tests.h2server import H2Server
from tests.support import Edge, wait_until

pytestmark = pytest.mark.integration


def test_a_backend_answering_before_the_body_ended_gets_its_stream_cancelled():
    srv = H2Server(max_streams=2)
    e = Edge("--backends", srv.url, "--health-interval", "30")
    try:
        c = H2Client(e.port)
        for _ in range(6):      # three times the backend's stream limit, one connection
            sid = c.request("/early", method="POST", body=b"part", end=False)
            r = c.response(sid)
            assert r["headers"][b":status"] == b"200" and r["data"] == b"ok"
        wait_until(lambda: not srv.open_streams(), 10, what="the backend's streams closed by the edge")
        assert srv.connections == 2             # the health check's, and one for every call
        c.close()
    finally:
        e.stop()
        srv.close()


def test_a_call_the_backend_goaway_says_it_never_processed_is_tried_again_on_a_new_connection():
    srv = H2Server()
    e = Edge("--backends", srv.url, "--health-interval", "30")
    try:
        c = H2Client(e.port)
        for path in ("/a", "/goaway", "/b"):
            r = c.response(c.request(path))
            assert (path, r["headers"][b":status"], r["data"]) == (path, b"200", b"ok")
        assert srv.went_away
        assert srv.connections == 3             # the health check's, the one that went away, the new one
        c.close()
    finally:
        e.stop()
        srv.close()
