"""HTTP/2 from clients (lb/http2/) against real processes: curl in cleartext (prior knowledge) and over TLS
(ALPN), h2load, the edge's own answers (a 429, gRPC's trailers-only), and HTTP/2's known attacks, each
ending the offending stream or connection with the right code while the edge keeps serving."""

import json
import re
from collections import deque
import shutil
import socket
import ssl
import subprocess
import time

import pytest
from h2.errors import ErrorCodes
from h2.events import DataReceived
from h2.settings import SettingCodes
from hpack import Encoder
from hyperframe.frame import ContinuationFrame, GoAwayFrame, HeadersFrame

from tests.h2client import H2Client
from tests.support import Backend, Edge, request, wait_until

trustme = pytest.importorskip("trustme", reason="trustme (requirements-dev.txt) makes the test certificates")
CURL = shutil.which("curl")


@pytest.fixture(scope="module")
def backend():
    b = Backend("h2b")
    yield b
    b.stop()


@pytest.fixture(scope="module")
def edge(backend, tmp_path_factory):
    log = tmp_path_factory.mktemp("h2log") / "access.log"
    e = Edge("--backends", backend.url, "--health-interval", "30", "--admin", "127.0.0.1:0",
             "--access-log", str(log), "--send-timeout", "2")
    e.access_path = log
    yield e
    e.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki2")
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    files = {"ca": d / "ca.pem", "cert": d / "cert.pem", "key": d / "key.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    leaf.cert_chain_pems[0].write_to_path(str(files["cert"]))
    leaf.private_key_pem.write_to_path(str(files["key"]))
    return {k: str(v) for k, v in files.items()}


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CURL, "-sS", "--max-time", "20", *args], capture_output=True, timeout=30)


def echo_headers(body: bytes) -> dict:
    return {k.lower(): v for k, v in json.loads(body)["headers"]}


# ------------------------------------------------------------------------------------------- the path

@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_curl_prior_knowledge_get_and_post_reach_an_http11_backend(edge):
    p = curl("--http2-prior-knowledge", "-i", f"http://127.0.0.1:{edge.port}/echo/a?b=1")
    out = p.stdout.decode()
    assert out.startswith("HTTP/2 200"), (out, p.stderr)
    info = json.loads(out.split("\r\n\r\n", 1)[1])
    assert info["version"] == "HTTP/1.1" and info["target"] == "/echo/a?b=1"
    hdrs = echo_headers(out.split("\r\n\r\n", 1)[1])
    assert hdrs["host"] == f"127.0.0.1:{edge.port}" and hdrs["x-forwarded-proto"] == "http"
    assert hdrs["x-forwarded-for"] == "127.0.0.1"
    p = curl("--http2-prior-knowledge", "--data-binary", "x" * 100000, f"http://127.0.0.1:{edge.port}/echo")
    assert json.loads(p.stdout)["body_len"] == 100000
    # HTTP/1.1 on the same port as before
    assert request(edge.port, "GET", "/echo").status == 200


def test_a_body_without_length_goes_chunked_and_a_big_response_streams_with_flow_control(edge):
    c = H2Client(edge.port)
    try:
        sid = c.request("/echo", "POST", body=b"a" * 5000, end=False)
        c.send_body(sid, b"b" * 70000)          # past the stream's first window: the edge's reads open it
        r = c.response(sid)
        info = json.loads(r["data"])
        assert r["headers"][b":status"] == b"200" and info["body_len"] == 75000
        # read whole first (request buffering, as a chunked HTTP/1.1 body is), then sent with its length
        assert echo_headers(r["data"]).get("content-length") == "75000"
        sid = c.request("/big?bytes=3000000")
        r = c.response(sid, timeout=30)
        assert r["headers"][b":status"] == b"200" and len(r["data"]) == 3000000
        assert r["headers"][b"content-length"] == b"3000000"
        sid = c.request("/chunked")
        r = c.response(sid)
        assert r["headers"][b":status"] == b"200" and r["data"] and b"transfer-encoding" not in r["headers"]
        sid = c.request("/echo", "HEAD")
        r = c.response(sid)
        assert r["headers"][b":status"] == b"200" and r["data"] == b""
    finally:
        c.close()


def test_bad_fields_are_refused_on_their_stream_and_the_connection_serves_on(edge):
    c = H2Client(edge.port)
    try:
        c.h2.config.validate_outbound_headers = False
        sid = c.request("/", headers=[("x-api-key", "a"), ("x-api-key", "b")])
        assert c.response(sid)["headers"][b":status"] == b"400"
        sid = c.request("/", "TRACE")
        assert c.response(sid)["headers"][b":status"] == b"405"
        sid = c.request("/echo", "POST", headers=[("content-length", "10")])    # END_STREAM on HEADERS
        r = c.response(sid)
        assert (r["headers"][b":status"], r["data"]) == (b"400", b"Content-Length but the stream ended without a body\n")
        sid = c.request("/echo")
        assert c.response(sid)["headers"][b":status"] == b"200"
    finally:
        c.close()


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_tls_alpn_offers_h2_then_http11_and_http2_off_turns_both_off(backend, pki):
    e = Edge("--backends", backend.url, "--health-interval", "30", "--tls-cert", pki["cert"], "--tls-key", pki["key"])
    off = Edge("--backends", backend.url, "--health-interval", "30", "--tls-cert", pki["cert"], "--tls-key",
               pki["key"], "--http2", "off")
    plain_off = Edge("--backends", backend.url, "--health-interval", "30", "--http2", "off")
    try:
        p = curl("--http2", "--cacert", pki["ca"], "-w", "%{http_version}", "-o", "/dev/null",
                 f"https://127.0.0.1:{e.port}/echo")
        assert p.stdout == b"2", p.stderr
        p = curl("--http2", "--cacert", pki["ca"], f"https://127.0.0.1:{e.port}/echo")
        assert echo_headers(p.stdout)["x-forwarded-proto"] == "https"
        p = curl("--http1.1", "--cacert", pki["ca"], "-w", "%{http_version}", "-o", "/dev/null",
                 f"https://127.0.0.1:{e.port}/echo")
        assert p.stdout == b"1.1", p.stderr
        p = curl("--http2", "--cacert", pki["ca"], "-w", "%{http_version}", "-o", "/dev/null",
                 f"https://127.0.0.1:{off.port}/echo")
        assert p.stdout == b"1.1", p.stderr
        ctx = ssl.create_default_context(cafile=pki["ca"])
        ctx.set_alpn_protocols(["h2"])
        with socket.create_connection(("127.0.0.1", off.port), timeout=10) as s:
            with ctx.wrap_socket(s, server_hostname="127.0.0.1") as t:
                assert t.selected_alpn_protocol() is None      # never claimed with http2 off
        p = curl("--http2-prior-knowledge", f"http://127.0.0.1:{plain_off.port}/echo")
        assert p.returncode != 0 or b"505" in p.stdout or not p.stdout.startswith(b"{")
    finally:
        e.stop()
        off.stop()
        plain_off.stop()


@pytest.mark.skipif(shutil.which("h2load") is None, reason="h2load (nghttp2-client) is not installed")
def test_h2load_3000_requests_4_connections_10_streams_each_none_fail(edge):
    p = subprocess.run(["h2load", "-n", "3000", "-c", "4", "-m", "10", f"http://127.0.0.1:{edge.port}/echo"],
                       capture_output=True, timeout=180)
    out = p.stdout.decode()
    assert "3000 succeeded, 0 failed, 0 errored, 0 timeout" in out, out
    assert "3000 2xx" in out, out


def test_access_log_and_metrics_say_http2(edge):
    c = H2Client(edge.port)
    try:
        sid = c.request("/echo/logged-h2")
        assert c.response(sid)["headers"][b":status"] == b"200"
    finally:
        c.close()
    line = wait_until(lambda: [ln for ln in edge.access_path.read_text().splitlines() if "/echo/logged-h2" in ln],
                      what="the access-log line")[0]
    assert line.endswith(" proto=HTTP/2") and " 200 " in line
    assert request(edge.port, "GET", "/echo/logged-h1").status == 200
    line = wait_until(lambda: [ln for ln in edge.access_path.read_text().splitlines() if "/echo/logged-h1" in ln],
                      what="the HTTP/1.1 line")[0]
    assert " proto=" not in line            # HTTP/1.1 lines are as they were
    m = request(edge.admin_port, "GET", "/metrics").body.decode()
    assert 'lb_http2_streams_total{outcome="served"}' in m and "lb_http2_connections_total" in m


def test_requests_are_counted_by_protocol_from_zero(backend):
    e = Edge("--backends", backend.url, "--health-interval", "30", "--admin", "127.0.0.1:0")

    def count(protocol: str) -> float:
        m = request(e.admin_port, "GET", "/metrics").body.decode()
        return float(re.search(r'^lb_requests_by_protocol_total\{protocol="%s"\} (\S+)$' % protocol, m, re.M)[1])

    try:
        assert count("HTTP/1.1") == 0 and count("HTTP/2") == 0 and count("HTTP/1.0") == 0
        for _ in range(3):
            assert request(e.port, "GET", "/echo").status == 200
        c = H2Client(e.port)
        try:
            for _ in range(2):
                assert c.response(c.request("/echo"))["headers"][b":status"] == b"200"
            assert c.response(c.request("/nowhere", "BREW"))["headers"][b":status"]    # the edge's own answer too
        finally:
            c.close()
        assert wait_until(lambda: count("HTTP/2") == 3, what="3 HTTP/2 requests counted")
        assert count("HTTP/1.1") == 3 and count("HTTP/1.0") == 0
    finally:
        e.stop()


# ------------------------------------------------------------------------- the edge's own answers

def test_a_limit_over_http2_is_429_with_its_headers_and_grpc_gets_resource_exhausted(backend):
    e = Edge("--backends", backend.url, "--health-interval", "30", "--limit", "2/m")
    c = H2Client(e.port)
    try:
        for _ in range(2):
            assert c.response(c.request("/echo", headers=[("x-api-key", "k1")]))["headers"][b":status"] == b"200"
        r = c.response(c.request("/echo", headers=[("x-api-key", "k1")]))
        h = r["headers"]
        assert h[b":status"] == b"429" and h[b"x-ratelimit-remaining"] == b"0" and int(h[b"retry-after"]) > 0
        g = c.response(c.request("/pkg.Svc/Call", "POST", headers=[("x-api-key", "k1"),
                                 ("content-type", "application/grpc"), ("te", "trailers")], body=b"\0\0\0\0\0"))
        h = g["headers"]
        # trailers-only: one HEADERS with END_STREAM, HTTP 200, the gRPC status, the limit's metadata kept
        assert h[b":status"] == b"200" and h[b"grpc-status"] == b"8" and g["data"] == b"" and g["ended"]
        assert h[b"content-type"] == b"application/grpc" and h[b"grpc-message"] == b"rate limit exceeded"
        assert h[b"x-ratelimit-limit"] == b"2" and int(h[b"retry-after"]) > 0
    finally:
        c.close()
        e.stop()


def test_grpc_gets_unavailable_when_no_backend_answers(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    e = Edge("--backends", f"http://127.0.0.1:{dead}", "--health-interval", "30")
    c = H2Client(e.port)
    try:
        g = c.response(c.request("/pkg.Svc/Call", "POST", headers=[("content-type", "application/grpc+proto")],
                                 body=b"\0\0\0\0\0"))
        assert g["headers"][b":status"] == b"200" and g["headers"][b"grpc-status"] == b"14"
        plain = c.response(c.request("/x"))
        assert plain["headers"][b":status"] == b"502"
    finally:
        c.close()
        e.stop()


# ------------------------------------------------------------------------------------ the attacks

def still_serves(edge) -> None:
    c = H2Client(edge.port)
    try:
        assert c.response(c.request("/echo"))["headers"][b":status"] == b"200"
    finally:
        c.close()


def test_rapid_reset_gets_goaway_enhance_your_calm_and_starts_bounded_work(edge, backend):
    before = backend.stats()["count"]
    c = H2Client(edge.port)
    try:
        for _ in range(1000):
            try:
                sid = c.request("/slow?ms=200")
                c.h2.reset_stream(sid, ErrorCodes.CANCEL)
                c.flush()
            except OSError:
                break
        c.until_closed()
        assert c.goaway is not None and c.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    finally:
        c.close()
    still_serves(edge)
    # Never more backend requests than the resets allowed, however many streams were opened.
    assert backend.stats()["count"] - before <= 400


@pytest.mark.parametrize("flood", ["ping", "settings", "priority", "window_update"])
def test_control_frame_floods_get_goaway_enhance_your_calm(edge, flood):
    c = H2Client(edge.port)
    try:
        for i in range(20000 if flood in ("priority", "window_update") else 2000):
            if flood == "ping":
                c.h2.ping(b"%08d" % i)
            elif flood == "settings":
                c.h2.update_settings({})
            elif flood == "priority":
                c.h2.prioritize(1 + 2 * (i % 1000), weight=16)    # idle streams too: no stream is opened
            else:
                c.h2.increment_flow_control_window(1)
            try:
                c.flush()
            except OSError:
                break
        c.until_closed()
        assert c.goaway is not None and c.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    finally:
        c.close()
    still_serves(edge)
    if flood in ("priority", "window_update"):
        m = request(edge.admin_port, "GET", "/metrics").body.decode()
        assert 'lb_http2_goaways_total{reason="too many PRIORITY/WINDOW_UPDATE frames"}' in m


def test_a_browser_s_priority_frames_and_a_window_update_per_data_frame_are_not_a_flood(edge):
    """As Firefox: PRIORITY frames with each request; as a strict client: WINDOW_UPDATE for the stream and
    the connection after every DATA frame of a download far larger than any burst."""
    c = H2Client(edge.port)
    try:
        for _ in range(300):
            sid = c.request("/echo")
            for dep in range(5):
                c.h2.prioritize(sid, weight=16 + dep, depends_on=0)
            c.flush()
            assert c.response(sid)["headers"][b":status"] == b"200"
        sid = c.request("/big?bytes=4000000")
        frames = 0
        r = c.responses[sid]
        end = time.monotonic() + 30
        while not r["ended"] and time.monotonic() < end:
            seen = len(c.events)
            assert c.pump(ack=False), f"connection ended (goaway: {c.goaway})"
            for ev in c.events[seen:]:
                if isinstance(ev, DataReceived) and ev.flow_controlled_length:
                    frames += 1
                    if not r["ended"]:
                        c.h2.increment_flow_control_window(ev.flow_controlled_length, stream_id=sid)
                    c.h2.increment_flow_control_window(ev.flow_controlled_length)
            c.flush()
        assert r["ended"] and len(r["data"]) == 4000000 and c.goaway is None
        assert frames > 200          # past the frames' own burst: their DATA is what kept them allowed
    finally:
        c.close()
    still_serves(edge)


def test_continuation_flood_ends_the_connection(edge):
    c = H2Client(edge.port)
    try:
        block = Encoder().encode([(b":method", b"GET"), (b":path", b"/"), (b":scheme", b"http"),
                                  (b":authority", b"x")])
        f = HeadersFrame(1)
        f.data = block
        out = f.serialize()
        cont = ContinuationFrame(1)
        cont.data = b"\x40\x01a\x01b" * 300        # literal fields, never an END_HEADERS
        piece = cont.serialize()
        try:
            c.sock.sendall(out)
            for _ in range(2000):
                c.sock.sendall(piece)
        except OSError:
            pass
        c.until_closed()
    finally:
        c.close()
    still_serves(edge)


def test_a_client_allowing_a_huge_hpack_table_does_not_make_the_edge_keep_every_response_field(backend):
    e = Edge("--backends", backend.url, "--health-interval", "30", "--request-id-response")
    c = H2Client(e.port, settings={SettingCodes.HEADER_TABLE_SIZE: 1 << 30})
    try:
        for _ in range(200):                 # each answer has an X-Request-Id of its own
            r = c.response(c.request("/"))
            assert r["headers"][b":status"] == b"200"
        # The client's decoder holds what the edge's encoder indexed: at most the edge's own 4 KB.
        assert c.h2.decoder.header_table._current_size <= 4096
    finally:
        c.close()
        e.stop()


def test_a_client_goaway_ends_the_connection_after_its_streams_are_answered(edge):
    c = H2Client(edge.port)
    try:
        sid = c.request("/slow?ms=300")
        bye = GoAwayFrame(0)                   # by hand: h2 receives nothing after its own GOAWAY
        bye.last_stream_id = 0
        c.sock.sendall(bye.serialize())
        r = c.response(sid)
        assert (r["headers"][b":status"], r["reset"]) == (b"200", None)
        c.until_closed()                       # and then the edge closes it
    finally:
        c.close()


def test_hpack_bomb_is_refused(edge):
    c = H2Client(edge.port)
    try:
        # One 4 KB field in the dynamic table, then named 100 times by its index: 400 KB decoded from ~4 KB.
        big = [(b"x-bomb", b"a" * 4000)]
        sid = c.request("/echo", headers=big * 100)
        c.wait(lambda: c.closed or c.goaway is not None or c.responses[sid]["reset"] is not None or
               (c.responses[sid]["headers"] or {}).get(b":status") == b"431", what="the bomb refused")
        r = c.responses[sid]
        assert c.goaway is not None or c.closed or r["reset"] is not None or r["headers"][b":status"] == b"431"
    finally:
        c.close()
    still_serves(edge)


def test_streams_past_max_concurrent_streams_are_refused_alone(backend):
    e = Edge("--backends", backend.url, "--health-interval", "30", "--pool-maxsize", "128")
    c = H2Client(e.port)
    try:
        c.wait(lambda: c.h2.remote_settings.max_concurrent_streams == 100, what="the edge's SETTINGS")
        sids = [c.request("/slow?ms=1500") for _ in range(100)]
        # A misbehaving client: it ignores the advertised limit (h2 would stop at 100).
        c.h2.remote_settings._settings[SettingCodes.MAX_CONCURRENT_STREAMS] = deque([1000])
        extra = c.request("/echo")
        r = c.response(extra)
        assert r["reset"] == ErrorCodes.REFUSED_STREAM
        done = [c.response(s, timeout=30) for s in sids]
        assert all(d["headers"][b":status"] == b"200" for d in done)
        assert not c.closed
        assert c.response(c.request("/echo"))["headers"][b":status"] == b"200"   # the same connection serves on
    finally:
        c.close()
        e.stop()


def test_a_stream_whose_window_stays_shut_is_reset_and_holds_up_no_other(edge):
    # Every stream's window starts at 0: the client opens only the second stream's.
    c = H2Client(edge.port, settings={3: 100, 4: 0})      # MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE
    try:
        c.wait(lambda: any(type(ev).__name__ == "SettingsAcknowledged" for ev in c.events), what="ACK")
        stuck = c.request("/big?bytes=2000000")
        ok = c.request("/echo/other")
        c.wait(lambda: c.responses[ok]["headers"] is not None, what="the second stream's head")
        c.h2.increment_flow_control_window(1 << 20, stream_id=ok)
        c.flush()
        r = c.response(ok)
        assert r["headers"][b":status"] == b"200" and json.loads(r["data"])["target"] == "/echo/other"
        # the shut one: reset after send_timeout (2 s here) without progress
        r = c.response(stuck, timeout=20)
        assert r["reset"] == ErrorCodes.CANCEL and r["data"] == b""
    finally:
        c.close()
    still_serves(edge)


def test_an_idle_http2_connection_makes_room_at_max_connections(backend):
    e = Edge("--backends", backend.url, "--health-interval", "30", "--max-connections", "1")
    c = H2Client(e.port)
    try:
        assert c.response(c.request("/echo"))["headers"][b":status"] == b"200"
        # the one slot is the idle HTTP/2 connection's: a new client takes it, as from an idle HTTP/1.1 one
        assert wait_until(lambda: request(e.port, "GET", "/echo").status == 200, what="the new connection served")
        c.until_closed()
    finally:
        c.close()
        e.stop()
