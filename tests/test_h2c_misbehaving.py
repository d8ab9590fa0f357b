"""h2c:// backends that do what gRPC libraries rarely do (tests/h2server.py, scripted): the edge's side of
each backend stream must still end, or the backend's stream limit fills with streams nobody uses."""

import pytest
from h2.events import SettingsAcknowledged
from h2.settings import SettingCodes

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


def test_calls_cancelled_mid_answer_give_the_backend_connection_its_window_back():
    srv = H2Server()
    e = Edge("--backends", srv.url, "--health-interval", "30", "--read-timeout", "5")
    try:
        c = H2Client(e.port, settings={SettingCodes.INITIAL_WINDOW_SIZE: 0})    # reads nothing of any answer
        c.wait(lambda: any(isinstance(ev, SettingsAcknowledged) for ev in c.events), 5, "SETTINGS ACK")
        # Each call's backend stream fills its 1 MB window (the edge relays none of it), then the client
        # cancels: 30 of them are more than the backend connection's 16 MB window.
        for _ in range(30):
            before = sum(srv.sent.values())
            sid = c.request("/big")
            wait_until(lambda b=before: sum(srv.sent.values()) - b >= 1 << 20, 10, what="the call's window used")
            c.h2.reset_stream(sid)
            c.flush()
        assert srv.connections == 2
        other = H2Client(e.port)
        r = other.response(other.request("/a"), 15)
        assert (r["headers"][b":status"], r["data"]) == (b"200", b"ok")
        assert srv.connections == 2             # on the same backend connection
        other.close()
        c.close()
    finally:
        e.stop()
        srv.close()


def test_a_backend_allowing_a_huge_hpack_table_does_not_make_the_edge_keep_every_request_field():
    srv = H2Server(header_table=1 << 30)
    e = Edge("--backends", srv.url, "--health-interval", "30")
    try:
        c = H2Client(e.port)
        for _ in range(200):                 # each call has an X-Request-Id of its own
            r = c.response(c.request("/a"))
            assert r["headers"][b":status"] == b"200"
        assert srv.connections == 2
        assert srv.decoders[1].header_table._current_size <= 4096
        c.close()
    finally:
        e.stop()
        srv.close()


def test_a_backend_connection_that_went_away_is_closed_once_its_calls_are_done():
    srv = H2Server()
    e = Edge("--backends", srv.url, "--health-interval", "30")
    try:
        c = H2Client(e.port)
        for path in ("/a", "/bye", "/b"):
            r = c.response(c.request(path))
            assert (path, r["headers"][b":status"]) == (path, b"200")
        assert srv.connections == 3             # the health check's, the one that went away, the new one
        # The backend left the GOAWAY'd connection open: the edge, its client, closes it (or its socket
        # and reader thread stay for the process's life, one more at each GOAWAY).
        wait_until(lambda: srv.closed_by_peer >= 2, 10, what="the connection that went away closed")
        c.close()
    finally:
        e.stop()
        srv.close()
