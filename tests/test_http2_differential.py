"""HTTP/2 in, HTTP/1.1 out: the edge against nginx (`listen ... http2`, a proxy no one here wrote), the
same HTTP/2 streams through both to a recording backend (tests/rawserver.py), compared by what each
backend received -- the idea of tests/test_nginx_differential.py carried to HTTP/2.

The corpus is what an HTTP/2-to-HTTP/1.1 translation can get wrong (RFC 9113 8.2-8.3): field values
with CR, LF or NUL (a header injected into the HTTP/1.1 head), connection-specific fields, a
Content-Length the DATA contradicts, :authority against Host, split cookies, bodies with and without a
length. For every entry the edge forwards what nginx forwards -- the same method, target and body -- or
refuses it (listed in STRICTER with why); never forwards what nginx refuses.
"""

from __future__ import annotations

import socket

import h2.exceptions
import pytest

from tests.h2client import H2Client
from tests.rawserver import RecordingBackend
from tests.support import Edge, wait_until
from wrk.nginx_target import find_nginx, run_nginx


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# name -> (method, path, extra fields, body or None, whether to send a body without END_STREAM on HEADERS)
CORPUS = {
    "get": ("GET", "/a?b=c", [], None),
    "get-many-fields": ("GET", "/m", [("accept", "*/*"), ("x-one", "1"), ("x-two", "2")], None),
    "post-length": ("POST", "/p", [("content-length", "5")], b"hello"),
    "post-no-length": ("POST", "/p", [], b"hello"),
    "post-big-no-length": ("POST", "/p", [], b"z" * 100000),
    "post-empty": ("POST", "/p", [("content-length", "0")], b""),
    "cookies-split": ("GET", "/c", [("cookie", "a=1"), ("cookie", "b=2")], None),
    "host-agrees": ("GET", "/h", [("host", "127.0.0.1")], None),
    "value-crlf": ("GET", "/v", [("x-inject", "a\r\nx-evil: 1")], None),
    "value-lf": ("GET", "/v", [("x-inject", "a\nx-evil: 1")], None),
    "value-nul": ("GET", "/v", [("x-inject", "a\x00b")], None),
    "name-colon": ("GET", "/v", [("x:y", "1")], None),
    "name-space": ("GET", "/v", [("x y", "1")], None),
    "connection-field": ("GET", "/v", [("connection", "close")], None),
    "transfer-encoding": ("POST", "/v", [("transfer-encoding", "chunked")], b"0\r\n\r\n"),
    "te-gzip": ("GET", "/v", [("te", "gzip")], None),
    "cl-too-short": ("POST", "/v", [("content-length", "3")], b"hello"),
    "cl-too-long": ("POST", "/v", [("content-length", "9")], b"hello"),
    "cl-not-a-number": ("POST", "/v", [("content-length", "5x")], b"hello"),
    "path-space": ("GET", "/a b", [], None),
    "path-not-origin": ("GET", "a", [], None),
    "method-lower": ("get", "/v", [], None),
    "upgrade-field": ("GET", "/v", [("upgrade", "websocket")], None),
}

# The edge refuses these and nginx forwards them (why):
STRICTER = {
    name: "a connection-specific field makes an HTTP/2 request malformed (RFC 9113 8.2.2: it MUST be "
          "treated as such; h2 refuses the stream); nginx 1.22 drops the field and forwards the rest"
    for name in ("connection-field", "transfer-encoding", "te-gzip", "upgrade-field")
}


def one(port: int, backend: RecordingBackend, name: str):
    """'forwarded' with what the backend got (method, target, body), or 'refused'."""
    method, path, extra, body = CORPUS[name]
    c = H2Client(port)
    c.h2.config.validate_outbound_headers = False       # the point is to send what h2 would not
    c.h2.config.normalize_outbound_headers = False
    try:
        try:
            sid = c.request(path, method, headers=extra, end=body is None)
            if body is not None:
                c.send_body(sid, body)
            c.wait(lambda: c.responses[sid]["ended"] or c.responses[sid]["reset"] is not None or c.closed
                   or c.goaway is not None, timeout=15, what=name)
            r = c.responses[sid]
        except (AssertionError, OSError, h2.exceptions.ProtocolError):
            r = None
        got = [req for req in backend.take() if req[1] != "/health"]
        status = r["headers"][b":status"] if r and r.get("headers") else None
        if got and status == b"200":
            m, t, _, b = got[0]
            return "forwarded", (m, t, b)
        return "refused", None
    finally:
        c.close()


@pytest.fixture(scope="module")
def nginx():
    if not find_nginx():
        pytest.fail("nginx not installed (./run-tests installs nginx-light)")
    backend = RecordingBackend()
    h2port = _port()
    server = ("server { listen 127.0.0.1:%d http2; client_max_body_size 1m; client_body_buffer_size 2m; "
              "location / { proxy_pass http://backend; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
              % h2port)
    with run_nginx(proxy_to=backend.port, http_extra=server):
        wait_until(lambda: socket.create_connection(("127.0.0.1", h2port), timeout=1).close() or True,
                   what="nginx's HTTP/2 port")
        yield h2port, backend
    backend.close()


@pytest.fixture(scope="module")
def edge():
    backend = RecordingBackend()
    e = Edge("--backends", backend.url, "--health-interval", "30", "--max-body-size", "1048576")
    yield e.port, backend
    e.stop()
    backend.close()


def test_the_edge_forwards_what_nginx_forwards_over_http2_or_refuses_more(nginx, edge):
    diffs = []
    for name in CORPUS:
        theirs = one(nginx[0], nginx[1], name)
        ours = one(edge[0], edge[1], name)
        if theirs[0] == "refused" and ours[0] == "forwarded":
            diffs.append(f"{name}: nginx refuses, the edge forwards {ours[1]!r}")
        elif theirs[0] == "forwarded" and ours[0] == "refused" and name not in STRICTER:
            diffs.append(f"{name}: nginx forwards {theirs[1]!r}, the edge refuses")
        elif theirs[0] == ours[0] == "forwarded" and theirs[1] != ours[1]:
            diffs.append(f"{name}: nginx forwards {theirs[1]!r}, the edge {ours[1]!r}")
        elif name in STRICTER and not (theirs[0] == "forwarded" and ours[0] == "refused"):
            diffs.append(f"{name}: listed in STRICTER, but nginx {theirs[0]}, the edge {ours[0]}")
    assert not diffs, "\n".join(diffs)
