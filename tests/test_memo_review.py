"""Review of branch cost (Reader.memo): identical head bytes on one connection, results that must differ.

A raw backend answers every request with the same head bytes (so the edge's backend-side memo hits), and
the client sends the same request head bytes again and again on one keep-alive connection (so the
client-side memo hits): whatever changes between two such requests (the limiter's count, the request id,
a rule's choice, the method, the body framing) must still show.
"""

from __future__ import annotations

import re
import socket
import threading

from tests.rawserver import RawServer
from tests.support import Edge

FIXED = (
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-RateLimit-Remaining: 7\r\nX-RateLimit-Limit: 8\r\n"
    b"X-Request-Id: backend-id\r\nX-Seen: fixed\r\n\r\n"
)


class Recorder:
    """A backend answering every request with FIXED (+ 'ok' unless HEAD); records each request's head
    and body as it parsed them (Content-Length or chunked)."""

    def __init__(self, answer: bytes = FIXED):
        self.answer = answer
        self.seen: list[tuple[bytes, bytes]] = []
        self.socks: set[int] = set()  # the connections the recorded requests came on
        self.lock = threading.Lock()
        self.server = RawServer(self.handle)
        self.url = self.server.url

    def handle(self, s: socket.socket, _server) -> None:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                d = s.recv(65536)
                if not d:
                    return
                buf += d
            head, buf = buf.split(b"\r\n\r\n", 1)
            m = re.search(rb"\r\ncontent-length: *(\d+)", head, re.I)
            body = b""
            if m:
                n = int(m.group(1))
                while len(buf) < n:
                    d = s.recv(65536)
                    if not d:
                        return
                    buf += d
                body, buf = buf[:n], buf[n:]
            elif re.search(rb"\r\ntransfer-encoding: *chunked", head, re.I):
                while not buf.endswith(b"0\r\n\r\n"):  # (the tests' bodies: one chunk, then the last)
                    d = s.recv(65536)
                    if not d:
                        return
                    buf += d
                body, buf = buf, b""
            if not head.startswith(b"GET /health "):  # (the edge's health checks are not the tests')
                with self.lock:
                    self.seen.append((head, body))
                    self.socks.add(id(s))
            s.sendall(self.answer if head.startswith(b"HEAD ") else self.answer + b"ok")

    def close(self) -> None:
        self.server.close()


def responses(sock: socket.socket, n: int, heads: list[bool] | None = None) -> list[tuple[bytes, bytes]]:
    """n responses (head, body) from sock, each with a Content-Length (none read after a HEAD's)."""
    out = []
    buf = b""
    for i in range(n):
        while b"\r\n\r\n" not in buf:
            d = sock.recv(65536)
            assert d, (out, buf)
            buf += d
        head, buf = buf.split(b"\r\n\r\n", 1)
        m = re.search(rb"\r\ncontent-length: *(\d+)", head, re.I)
        k = int(m.group(1)) if m and not (heads and heads[i]) else 0
        while len(buf) < k:
            d = sock.recv(65536)
            assert d
            buf += d
        out.append((head, buf[:k]))
        buf = buf[k:]
    return out


def field(head: bytes, name: bytes) -> list[bytes]:
    return re.findall(rb"\r\n" + name + rb": *([^\r]*)", head, re.I)


def test_identical_requests_get_their_own_limiter_count_request_id_and_finally_429(tmp_path):
    b = Recorder()
    e = Edge("--backends", b.url, "--health-interval", "30", "--limit", "3/m", "--request-id-response")
    try:
        req = b"GET /same HTTP/1.1\r\nHost: h\r\nX-Api-Key: k1\r\n\r\n"
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            got = []
            for _ in range(5):  # one at a time: each response before the next identical request
                s.sendall(req)
                got += responses(s, 1)
        statuses = [int(h[9:12]) for h, _ in got]
        assert statuses == [200, 200, 200, 429, 429]
        assert [field(h, b"x-ratelimit-remaining") for h, _ in got] == [[b"2"], [b"1"], [b"0"], [b"0"], [b"0"]]
        assert all(field(h, b"x-ratelimit-limit") == [b"3"] for h, _ in got)  # never the backend's 8
        ids = [field(h, b"x-request-id") for h, _ in got]
        assert all(len(i) == 1 and i[0] != b"backend-id" for i in ids), ids
        assert len({i[0] for i in ids}) == 5, ids  # each its own
        sent = [field(h, b"x-request-id") for h, _ in b.seen]
        assert len(b.seen) == 3 and len({i[0] for i in sent}) == 3 and {i[0] for i in sent} <= {i[0] for i in ids}
    finally:
        e.stop()
        b.close()


def test_one_backend_connection_serves_limited_and_unlimited_requests_each_their_own_fields(tmp_path):
    """The backend answers the same head bytes to both; its X-RateLimit-* passes only where the edge
    writes none (limiting False), and never where it writes its own: the relayed-head memo is keyed so."""
    b = Recorder()
    conf = tmp_path / "e.toml"
    conf.write_text('[[rules]]\nname = "lim"\nkey = "ip"\nlimit = "100/m"\nmatch = { path_prefix = "/lim" }\n')
    e = Edge("--config", str(conf), "--backends", b.url, "--health-interval", "30")
    try:
        free = b"GET /free HTTP/1.1\r\nHost: h\r\n\r\n"
        lim = b"GET /lim HTTP/1.1\r\nHost: h\r\n\r\n"
        order = [free, lim, lim, free, free, lim, free]
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            got = []
            for r in order:
                s.sendall(r)
                got += responses(s, 1)
        for r, (h, body) in zip(order, got):
            assert h[9:12] == b"200" and body == b"ok"
            if r is free:
                assert field(h, b"x-ratelimit-remaining") == [b"7"], h
                assert field(h, b"x-ratelimit-limit") == [b"8"], h
            else:
                assert field(h, b"x-ratelimit-limit") == [b"100"], h
                assert b"7" not in field(h, b"x-ratelimit-remaining"), h
        rem = [int(field(h, b"x-ratelimit-remaining")[0]) for r, (h, _) in zip(order, got) if r is lim]
        assert rem == [99, 98, 97]
        assert len(b.socks) == 1  # (one backend connection: its memo served every answer)
    finally:
        e.stop()
        b.close()


def test_head_then_get_with_the_same_response_head_bytes(tmp_path):
    """HEAD and GET answered with the same head bytes on one backend connection: no body after the HEAD's,
    the GET's body after its own; the next response on the client connection starts where it should."""
    b = Recorder()
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        get = b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n"
        head = b"HEAD /x HTTP/1.1\r\nHost: h\r\n\r\n"
        order = [get, head, get, head, head, get]
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            got = []
            for r in order:
                s.sendall(r)
                got += responses(s, 1, [r is head])
            s.settimeout(0.3)
            try:
                extra = s.recv(100)
            except socket.timeout:
                extra = b""
        assert extra == b""
        for r, (h, body) in zip(order, got):
            assert h.startswith(b"HTTP/1.1 200") and field(h, b"content-length") == [b"2"]
            assert body == (b"" if r is head else b"ok")
    finally:
        e.stop()
        b.close()


def test_pipelined_identical_heads_with_bodies_that_look_like_requests_smuggle_nothing(tmp_path):
    b = Recorder()
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        inner = b"GET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n"
        h = b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % len(inner)
        c = b"POST /p HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunked_body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(inner), inner)
        data = h + inner + h + inner + c + chunked_body + c + chunked_body + h + inner
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            s.sendall(data)
            got = responses(s, 5)
        assert [x[0][9:12] for x in got] == [b"200"] * 5
        assert len(b.seen) == 5
        assert all(head.startswith(b"POST /p ") for head, _ in b.seen), b.seen
        assert not any(head.startswith(b"GET /smuggled") for head, _ in b.seen)
        assert all(inner in body for _, body in b.seen)
    finally:
        e.stop()
        b.close()


def test_the_same_head_with_expect_100_continue_twice(tmp_path):
    b = Recorder()
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        h = b"POST /e HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            for _ in range(3):
                s.sendall(h)
                buf = b""
                while b"\r\n\r\n" not in buf:
                    buf += s.recv(65536)
                assert buf.startswith(b"HTTP/1.1 100"), buf
                s.sendall(b"abc")
                (head, body), = responses(s, 1)
                assert head.startswith(b"HTTP/1.1 200") and body == b"ok"
        assert [body for _, body in b.seen] == [b"abc"] * 3
    finally:
        e.stop()
        b.close()


def test_a_refused_head_then_the_same_bytes_on_a_new_connection_are_refused_again(tmp_path):
    b = Recorder()
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        ok = b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n"
        bad = b"GET /a HTTP/1.1\r\nHost: h\r\nHost: i\r\n\r\n"
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            s.sendall(ok)
            responses(s, 1)
            s.sendall(bad)
            (head, _), = responses(s, 1)
            assert head.startswith(b"HTTP/1.1 400")
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            s.sendall(ok + ok)
            assert [x[0][9:12] for x in responses(s, 2)] == [b"200", b"200"]
        assert len(b.seen) == 3
    finally:
        e.stop()
        b.close()


def test_a_reload_between_two_identical_requests_applies_to_the_second(tmp_path):
    """The memo remembers a parse, which reads only the bytes: what the configuration decides from it (a
    name with '_' forwarded or not, the request id answered or not) follows a reload on the same connection."""
    import signal

    b = Recorder()
    conf = tmp_path / "e.toml"
    conf.write_text("[server]\nallow_underscores = false\nrequest_id_response = false\n")
    e = Edge("--config", str(conf), "--backends", b.url, "--health-interval", "30")
    try:
        req = b"GET /u HTTP/1.1\r\nHost: h\r\nX_Under: 1\r\nX-Request-Id: client-id\r\n\r\n"
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            s.sendall(req)
            (h1, _), = responses(s, 1)
            conf.write_text("[server]\nallow_underscores = true\nrequest_id_response = true\n")
            e.signal(signal.SIGHUP)
            e.wait_log(r"reloaded")
            s.sendall(req)
            (h2, _), = responses(s, 1)
        (b1, _), (b2, _) = b.seen
        assert b"X_Under" not in b1 and b"\r\nX_Under: 1" in b2
        assert field(h1, b"x-request-id") == [b"backend-id"]  # off: the backend's passes
        assert field(h2, b"x-request-id") and field(h2, b"x-request-id") != [b"backend-id"]  # on: the edge's
    finally:
        e.stop()
        b.close()


# -- the memo against a fresh parse, on generated heads (seeded): the same fields, the same relayed head ------

_NAMES = [b"Host", b"host", b"Content-Length", b"Transfer-Encoding", b"Connection", b"connection", b"Expect",
          b"X-Api-Key", b"X-Request-Id", b"X-Forwarded-For", b"X-Forwarded-Proto", b"X-Forwarded-Host", b"Cookie",
          b"X_U", b"Upgrade", b"Keep-Alive", b"TE", b"Trailer", b"X-A", b"Server", b"RateLimit",
          b"RateLimit-Policy", b"X-RateLimit-Remaining", b"x-ratelimit-limit", b"Proxy-Authenticate"]
_VALUES = [b"h", b"2", b"0", b"5, 5", b"chunked", b"gzip, chunked", b"gzip", b"close", b"keep-alive",
           b"upgrade, x-a", b"x-a", b"server", b"te", b"100-continue", b"k", b"1.2.3.4", b"a=b", b""]


def _fields(r, names) -> list:
    return [(f, getattr(r, f, "<unset>")) for f in names]


def _generated(rnd, request: bool) -> bytes:
    fields = b"".join(b"\r\n" + rnd.choice(_NAMES) + b": " + rnd.choice(_VALUES) for _ in range(rnd.randint(0, 6)))
    if request:
        method = rnd.choice([b"GET", b"POST", b"HEAD", b"OPTIONS", b"TRACE", b"CONNECT"])
        return method + b" /" + rnd.choice([b"", b"a", b"x?y"]) + b" " + rnd.choice([b"HTTP/1.1", b"HTTP/1.0"]) + fields
    status = rnd.choice([b"200 OK", b"204 No Content", b"101 Switching", b"304 NM", b"503 x", b"200"])
    return b"HTTP/1." + rnd.choice([b"1", b"0"]) + b" " + status + fields


def test_generated_heads_parse_from_the_memo_as_they_parse_fresh():
    import random

    from lb.errors import HttpError, UpstreamError
    from lb.http.framing import Request, ResponseHead, parse_request, parse_response

    def slots(cls) -> list[str]:  # every class's in its MRO (raw and spans are the shared base's)
        return [s for c in cls.__mro__ for s in getattr(c, "__slots__", ())]

    rq = [s for s in slots(Request) if s not in ("_headers", "sent")] + ["headers"]
    rs = [s for s in slots(ResponseHead) if s not in ("_headers", "relayed")] + ["headers"]
    assert "raw" in rq and "spans" in rs
    rnd = random.Random(7)
    hits = 0
    for _ in range(3000):
        request = rnd.random() < 0.5
        head = _generated(rnd, request)
        parse, error, names = (parse_request, HttpError, rq) if request else (parse_response, UpstreamError, rs)
        memo: list = [None, None]
        try:
            first = parse(head, memo)
        except error:
            assert memo[1] is None  # a refused head is never remembered
            continue
        again = parse(head, memo)  # its second time in a row: what it found is kept (a canonical head)
        third = parse(head, memo)  # ... and given from the memo
        hits += memo[1] is not None
        assert (_fields(first, names) == _fields(again, names) == _fields(third, names)
                == _fields(parse(head), names)), head
    assert hits > 1000  # (the memo was exercised, not only bypassed)


def test_generated_responses_relayed_through_the_memo_as_through_a_fresh_parse():
    import random

    from lb.errors import UpstreamError
    from lb.http.framing import not_relayed, parse_response
    from lb.http.plan import response_plan

    skips = [not_relayed(b""), not_relayed(b"", b"X-Request-Id: 1\r\n"), not_relayed(b"\r\nRateLimit: x"),
             not_relayed(b"\r\nRateLimit: x", b"x")]
    rnd = random.Random(3)
    for _ in range(1500):
        head = _generated(rnd, False)
        memo: list = [None, None]
        try:
            parse_response(head, memo)
        except UpstreamError:
            continue
        for _ in range(6):  # the same backend connection's next answers, each for another exchange
            skip = rnd.choice(skips + [skips[0] | frozenset({b"server"})])  # (a route's: a new set each time)
            args = (rnd.choice([b"GET", b"HEAD"]), rnd.random() < 0.2, rnd.random() < 0.8, skip,
                    rnd.random() < 0.5, b"X-RateLimit-Remaining: %d\r\n" % rnd.randint(0, 9), rnd.random() < 0.1)
            want = response_plan(parse_response(head), *args)
            got = response_plan(parse_response(head, memo), *args)
            assert (bytes(got[0]), got[1], got[2]) == (bytes(want[0]), want[1], want[2]), (head, args)
            got[0].extend(b"the caller's own")


def test_generated_requests_sent_upstream_through_the_memo_as_through_a_fresh_parse():
    """upstream_head keeps the head's first part (request line, client fields, X-Forwarded-*) with the memo
    (Request.sent): whatever the next request on the connection changes -- the client's address or trust
    after a reload, the scheme, an id the edge made up, the body's length, underscores, a route's edits,
    an upgrade -- the backend gets the bytes a fresh parse would give it."""
    import random
    from types import SimpleNamespace as NS

    from lb.errors import HttpError
    from lb.http.framing import parse_request
    from lb.proxy.routes import HeaderEdit
    from lb.proxy.tries import upstream_head

    backend = NS(spec=NS(host="10.0.0.9", port=8080))
    edit = HeaderEdit(NS(remove=["X-A"], set=[("X-Set", "v")]))
    rnd = random.Random(5)
    hits = 0
    for _ in range(1500):
        head = _generated(rnd, True)
        memo: list = [None, None]
        try:
            parse_request(head, memo)
        except HttpError:
            continue
        for _ in range(6):  # the same client connection's next requests, the same bytes
            r = parse_request(head, memo)
            route = NS(request_edit=edit) if rnd.random() < 0.15 else None
            x = NS(req=r, proto=rnd.choice([b"http", b"https"]), upgrade=rnd.choice([None, None, b"websocket"]),
                   rid_sent=rnd.choice([None, b"ab12"]), route=route)
            conn = NS(peer=rnd.choice([b"10.1.1.1", b"10.1.1.2"]), peer_trusted=rnd.random() < 0.3)
            cfg = NS(no_pool=rnd.random() < 0.2, allow_underscores=rnd.random() < 0.3)
            length = rnd.choice([None, 0, 5])
            hits += r.sent is not None and r.sent[0] is not None
            want = upstream_head(NS(**{**vars(x), "req": parse_request(head)}), backend, conn, cfg, length)
            assert bytes(upstream_head(x, backend, conn, cfg, length)) == bytes(want), (head, vars(x), vars(conn))
    assert hits > 300  # (the kept first part was exercised, not only bypassed)
