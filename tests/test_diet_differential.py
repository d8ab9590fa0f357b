"""Issue 31's "behaviour unchanged", checked from outside: the same bytes through an edge from a reference
checkout and one from this tree, each a real process, and what the client and the backend receive
compared byte for byte (with the access log's lines and /metrics' counters after the same sequence).

The reference is $EDGE_REFERENCE_DIR: a checkout of main before the diet, best the commit the tree was
made from (`git worktree add --detach /tmp/base <it>`). Without one (CI, or EDGE_REFERENCE_DIR=-) the tree is compared against the bytes recorded from main in tests/data/diet_differential.json;
EDGE_DIET_RECORD=1 with a reference rewrites that file. Masked: only what must differ between two runs
(Date, request ids, times, the rate limiter's seconds-until-reset).
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest

from tests.rawserver import ConnReader, RawServer, Unparseable, read_request
from tests.support import Edge, free_port, raw

pytestmark = pytest.mark.integration

DATA = Path(__file__).parent / "data" / "diet_differential.json"
# Only a reference named on purpose: a stray checkout left in /tmp is no reference (its age is unknown).
REFERENCE = os.environ.get("EDGE_REFERENCE_DIR", "")
REFERENCE = "" if REFERENCE == "-" else REFERENCE

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
# What the backend answers, by request target (anything else: OK). "CLOSE" after the bytes: close.
RESPONSES: dict[str, list] = {
    "/r/cl": [OK],
    "/r/cl-lower": [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-thing: v\r\n\r\nok"],
    "/r/cl-slow": [b"HTTP/1.1 200 OK\r\nContent-Length:2\r\nX-Pad:   v  \r\n\r\nok"],
    "/r/cl-zeros": [b"HTTP/1.1 200 OK\r\nContent-Length: 002\r\n\r\nok"],
    "/r/cl-dup": [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: 1\r\nContent-Length: 2\r\n\r\nok"],
    "/r/cl-list": [b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok"],
    "/r/cl-conflict": [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok!"],
    "/r/chunked": [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n3;x=y\r\nabc\r\n0\r\nT: 1\r\n\r\n"
    ],
    "/r/te-cl": [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n"],
    "/r/eof": [b"HTTP/1.1 200 OK\r\nX-A: b\r\n\r\nuntil the close", "CLOSE"],
    "/r/http10": [b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"],
    "/r/http10-eof": [b"HTTP/1.0 200 OK\r\n\r\nuntil the close", "CLOSE"],
    "/r/204": [b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nX-A: b\r\n\r\n"],
    "/r/204-cl": [b"HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n"],
    "/r/304": [b'HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\nETag: "x"\r\n\r\n'],
    "/r/head": [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"],
    "/r/hop": [
        b"HTTP/1.1 200 OK\r\nConnection: X-Hop, Keep-Alive\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\n\r\nok"
    ],
    "/r/hop-unknown": [
        b"HTTP/1.1 200 OK\r\nConnection: x-unknown-name\r\nX-Unknown-Name: 1\r\nContent-Length: 2\r\n\r\nok"
    ],
    "/r/close": [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", "CLOSE"],
    "/r/keepalive": [b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"],
    "/r/ratelimit": [
        b"HTTP/1.1 200 OK\r\nX-RateLimit-Limit: 99\r\nRateLimit: r=1\r\nX-Request-Id: theirs\r\nContent-Length: 2\r\n\r\nok"
    ],
    "/r/stray": [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA-BYTES"],
    "/r/short": [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "CLOSE"],
    "/r/mid-head": [b"HTTP/1.1 200 OK\r\nContent-Le", "CLOSE"],
    "/r/nothing": ["CLOSE"],
    "/r/bare-lf": [b"HTTP/1.1 200 OK\nContent-Length: 2\r\n\r\nok"],
    "/r/100": [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"],
    "/r/500": [b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 3\r\n\r\nbad"],
    "/r/503": [b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n"],
    "/r/cookies": [
        b"HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nVary: x\r\nVary: y\r\nContent-Length: 2\r\n\r\nok"
    ],
    "/r/big-head": [
        b"HTTP/1.1 200 OK\r\n"
        + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 90) for i in range(60))
        + b"Content-Length: 2\r\n\r\nok"
    ],
    "/r/long-line": [b"HTTP/1.1 200 OK\r\nX-Long: " + b"L" * 9000 + b"\r\nContent-Length: 2\r\n\r\nok"],
    "/r/fold": [b"HTTP/1.1 200 OK\r\nX-F: a\r\n b\r\nContent-Length: 2\r\n\r\nok"],
    "/r/status-only": [b"HTTP/1.1 200 OK\r\n\r\n", "CLOSE"],
    "/r/no-reason": [b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\nok"],
    "/r/101": [b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n", "CLOSE"],
}


def _get(target: str, *fields: str, version: str = "HTTP/1.1", method: str = "GET", close: bool = True) -> bytes:
    lines = [f"{method} {target} {version}", *fields]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


H = "Host: t"
# (name, client bytes). Every case runs on a fresh client connection, in this order.
REQUESTS: list[tuple[str, bytes]] = [
    *[(f"resp{t[2:].replace('/', '-')}", _get(t, H)) for t in RESPONSES],
    ("resp-head-method", _get("/r/head", H, method="HEAD")),
    ("resp-head-chunked", _get("/r/chunked", H, method="HEAD")),
    ("req-fast-keepalive-eof", _get("/a", H, "User-Agent: x", "Accept: */*", close=False)),
    ("req-slow-blanks", b"GET /a HTTP/1.1\r\nhost:   t  \r\nX-A:b\r\nConnection: close\r\n\r\n"),
    ("req-repeated", _get("/a", H, "X-Dup: 1", "X-Dup: 2", "Accept: a", "accept: b")),
    ("req-obs-fold", b"GET /a HTTP/1.1\r\nHost: t\r\nX-F: a\r\n b\r\nConnection: close\r\n\r\n"),
    ("req-huge-value", _get("/a", H, "X-Big: " + "b" * 7000)),
    ("req-many-fields", _get("/a", H, *[f"X-N{i}: {i}" for i in range(90)])),
    ("req-too-many-fields", _get("/a", H, *[f"X-N{i}: {i}" for i in range(200)])),
    ("req-head-too-large", _get("/a", H, *[f"X-N{i}: {'v' * 900}" for i in range(80)])),
    ("req-line-too-long", _get("/" + "p" * 9000, H)),
    ("req-pipelined", _get("/p1", H, close=False) + _get("/p2", H, "X-B: 2")),
    ("req-pipelined-post", _get("/p1", H, "Content-Length: 3", close=False) + b"abc" + _get("/p2", H)),
    ("req-post-length", _get("/post", H, "Content-Length: 5", "Content-Type: x") + b"hello"),
    ("req-post-length-zeros", _get("/post", H, "Content-Length: 005") + b"hello"),
    ("req-post-length-dup", _get("/post", H, "Content-Length: 5", "Content-Length: 5") + b"hello"),
    ("req-post-length-list", _get("/post", H, "Content-Length: 5, 5") + b"hello"),
    ("req-post-length-conflict", _get("/post", H, "Content-Length: 5", "Content-Length: 6") + b"hello!"),
    ("req-post-length-bad", _get("/post", H, "Content-Length: +5") + b"hello"),
    ("req-post-chunked", _get("/post", H, "Transfer-Encoding: chunked") + b"5\r\nhello\r\n0\r\n\r\n"),
    ("req-post-te-cl", _get("/post", H, "Transfer-Encoding: chunked", "Content-Length: 5") + b"0\r\n\r\n"),
    ("req-post-te-gzip", _get("/post", H, "Transfer-Encoding: gzip") + b"x"),
    ("req-expect", _get("/post", H, "Expect: 100-continue", "Content-Length: 5") + b"hello"),
    ("req-http10", _get("/a", version="HTTP/1.0", close=False)),
    ("req-http10-host", _get("/a", H, version="HTTP/1.0", close=False)),
    ("req-http10-keepalive-eof", _get("/a", H, "Connection: keep-alive", version="HTTP/1.0", close=False)),
    ("req-keepalive-eof", _get("/a", H, "Connection: keep-alive", close=False)),
    ("req-conn-token", _get("/a", H, "X-Hop: 1", "Connection: close, X-Hop", close=False)),
    ("req-conn-token-known", _get("/a", H, "Cookie: c=1", "Connection: close, cookie", close=False)),
    ("req-conn-te", _get("/a", H, "TE: trailers", "Connection: TE, close", close=False)),
    ("req-underscore", _get("/a", H, "X_Under: 1", "X-Fine: 2")),
    ("req-underscore-value", _get("/a", H, "X-Fine: a_b")),
    ("req-xff", _get("/a", H, "X-Forwarded-For: 10.0.0.1", "X-Forwarded-Proto: https", "X-Forwarded-Host: h")),
    ("req-request-id", _get("/a", H, "X-Request-Id: client-id-1")),
    ("req-absolute", _get("http://t/a", H)),
    ("req-absolute-other", _get("http://other/a", H)),
    ("req-trace", _get("/a", H, method="TRACE")),
    ("req-options-star", _get("*", H, method="OPTIONS")),
    ("req-lower-method", _get("/a", H, method="get")),
    ("req-odd-method", _get("/a", H, method="PURGE")),
    ("req-dup-host", _get("/a", H, "Host: u")),
    ("req-no-host", _get("/a")),
    ("req-bad-host", _get("/a", "Host: a/b")),
    ("req-bare-lf", b"GET /a HTTP/1.1\nHost: t\r\nConnection: close\r\n\r\n"),
    ("req-bare-cr", b"GET /a HTTP/1.1\r\nHost: t\rX: y\r\nConnection: close\r\n\r\n"),
    ("req-ctl-byte", _get("/a", H, "X-C: a\x01b")),
    ("req-high-bytes", _get("/a\xe9", H, "X-U: caf\xe9")),
    ("req-tab-value", _get("/a", H, "X-T: a\tb")),
    ("req-empty-value", _get("/a", H, "X-E:")),
    ("req-space-before-colon", _get("/a", H, "X-S : v")),
    ("req-http11-version-odd", _get("/a", H, version="HTTP/1.2")),
    ("req-http09", b"GET /a\r\n\r\n"),
    ("req-leading-crlf", b"\r\n" + _get("/a", H)),
    ("req-cookie-api-key", _get("/a", H, "Cookie: a=1", "Cookie: b=2", "X-Api-Key: k1")),
    ("req-upgrade", _get("/a", H, "Upgrade: websocket", "Connection: Upgrade", close=False)),
    ("req-route-edit", _get("/r/cl", H, "Cookie: a=1", "X-Remove-Me: 1", "X-Dup: c", "X-Keep: 1")),
    ("req-route-edit-slow", _get("/r/cl-slow", H, "cookie:a=1", "x-remove-me:  1", "X-Keep: 1")),
    ("req-route-edit-lower", _get("/r/cl-lower", H, "x-dup: c", "x-remove-me: 1")),
    ("req-head-then-get", _get("/r/head", H, method="HEAD", close=False) + _get("/p2", H)),
]

# The edges compared: (name, edge arguments beyond --backends); "{log}" is the access log's path.
GROUPS: dict[str, list[str]] = {
    "plain": ["--retries", "0", "--access-log", "{log}", "--admin", "127.0.0.1:0"],
    "limit": ["--limit", "30/h", "--retries", "0", "--access-log", "{log}", "--admin", "127.0.0.1:0"],
    "limit-keys": ["--limit", "4/h", "--retries", "0", "--access-log", "{log}", "--admin", "127.0.0.1:0"],
    **{
        f"limit-keys-{a}": ["--limit", "4/h", "--algorithm", a, "--access-log", "{log}", "--admin", "127.0.0.1:0"]
        for a in ("fixed-window", "sliding-log", "sliding-counter")
    },
    # Not the one-limit configuration: overrides, an in-flight cap, another status (the limiter's long way).
    "limit-keys-overrides": [
        *("--limit", "4/h", "--key-limit", "key:k2=1/h", "--key-limit", "127.0.0.2=2/h", "--max-in-flight", "5"),
        *("--limit-status", "503", "--access-log", "{log}", "--admin", "127.0.0.1:0"),
    ],
    # A route's header edits (request: set and remove; response: set and remove): the plan's slow way.
    "routes": ["--config", "{conf}", "--retries", "0", "--access-log", "{log}", "--admin", "127.0.0.1:0"],
    "retries-rid": ["--retries", "2", "--request-id-response", "--access-log", "{log}"],
}
ROUTES = """
[[routes]]
name = "edit"
match = { path_prefix = "/r/" }
pool = "default"
request_headers = { set = { "X-Seen-Host" = "$host", "X-Dup" = "s" }, remove = ["Cookie", "X-Remove-Me"] }
response_headers = { set = { "X-Added" = "1" }, remove = ["X-Thing", "Set-Cookie", "X-A"] }

[[routes]]
name = "rest"
match = { path_prefix = "/" }
pool = "default"
"""
# The limit group sends each case three times as often as the limit allows in all: 429s and their fields.
LIMIT_CASES = ["resp-cl", "resp-ratelimit", "req-fast-keepalive-eof", "req-pipelined", "req-post-chunked"] * 8
# Keys and addresses (127.0.0.2 is another client): an unknown X-Api-Key is its own limit, whatever the
# address; no key, the address's; a key too long, a 400. Each: (name, source address, client bytes).
KEY_CASES = [
    *[(f"key-k1-{i}", "127.0.0.1", _get("/a", H, "X-Api-Key: k1")) for i in range(3)],
    *[(f"key-k1-other-ip-{i}", "127.0.0.2", _get("/a", H, "X-Api-Key: k1")) for i in range(3)],
    *[
        (f"key-k2-{i}", "127.0.0.2", _get("/a", H, "X-Api-Key: k2", close=False) + _get("/b", H, "X-Api-Key: k2"))
        for i in range(2)
    ],
    *[(f"key-none-{i}", "127.0.0.2", _get("/a", H)) for i in range(5)],
    *[(f"key-none-ip1-{i}", "127.0.0.1", _get("/a", H)) for i in range(5)],
    ("key-too-long", "127.0.0.1", _get("/a", H, "X-Api-Key: " + "k" * 300)),
    ("key-empty", "127.0.0.1", _get("/a", H, "X-Api-Key:")),
    ("key-two", "127.0.0.1", _get("/a", H, "X-Api-Key: k3", "X-Api-Key: k4")),
    *[(f"key-k1-again-{i}", "127.0.0.1", _get("/a", H, "X-Api-Key: k1")) for i in range(2)],
]


class ScriptedBackend(RawServer):
    """Records the bytes each connection brings, in arrival order, and answers by RESPONSES."""

    def __init__(self):
        self.received: list[bytes] = []
        super().__init__(self._serve)

    def take(self) -> list[bytes]:
        with self.lock:
            out, self.received = self.received, []
        return out

    def _serve(self, s, _server):
        r = _Recording(s, self)
        while True:
            r.start()
            try:
                req = read_request(r)
            except (Unparseable, EOFError) as e:
                r.stop(f"<{type(e).__name__}>")
                return
            if req is None:
                return
            r.stop()
            for step in RESPONSES.get(req[1], [OK]):
                if step == "CLOSE":
                    return
                s.sendall(step)


class _Recording(ConnReader):
    def __init__(self, s, server: ScriptedBackend):
        super().__init__(s)
        self.server = server
        self.got = b""

    def fill(self) -> bool:
        d = self.s.recv(65536)
        self.got += d
        self.buf += d
        return bool(d)

    def start(self):
        self.got = self.buf  # what an earlier read brought beyond the last request

    def stop(self, note: str = ""):
        used = self.got[: len(self.got) - len(self.buf)] if not note else self.got
        with self.server.lock:
            self.server.received.append(used + note.encode())


_MASKS = [
    (re.compile(rb"(?im)^(date|x-request-id|retry-after|x-ratelimit-reset|ratelimit-reset): [^\r\n]*"), rb"\1: *"),
    (re.compile(rb"(?i)(ratelimit: [^\r\n]*?t=)\d+"), rb"\1*"),
    (re.compile(rb"(?i)(ratelimit-policy|ratelimit): ([^\r\n]*)"), rb"\1: \2"),
]


def mask(b: bytes) -> str:
    b = re.sub(rb"127\.0\.0\.1:\d+", b"B", b)  # the backend's port
    for rx, sub in _MASKS:
        b = rx.sub(sub, b)
    return b.decode("latin-1")


def _exchange(port: int, data: bytes, source: str = "127.0.0.1") -> bytes:
    """Send, half-close (a keep-alive case ends at its EOF), read to the edge's close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0)) as s:
        s.sendall(data)
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (socket.timeout, ConnectionResetError):
            out += b"<timeout-or-reset>"
        return out


_LOG_TIME = re.compile(r"\[[^\]]*\]|\d+\.\d+|\b\d{4}-\d\d-\d\dT[^ ]*|[0-9a-f]{16,}")


def _log_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    text = re.sub(r"127\.0\.0\.1:\d+", "B", path.read_text(errors="replace"))
    # A key's label is a keyed hash whose secret each process draws: numbered in order of appearance.
    labels: dict[str, str] = {}
    text = re.sub(r"#[0-9a-f]{12}\b", lambda m: labels.setdefault(m[0], f"#label{len(labels)}"), text)
    # route=NAME: newer than /tmp/edge-main's copy of main (the route edits show in the backend's bytes).
    text = re.sub(r" route=\S+", "", text)
    return [_LOG_TIME.sub("*", line) for line in text.splitlines()]


def _counters(port: int | None) -> list[str]:
    if port is None:
        return []
    text = raw(port, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").decode("latin-1")
    keep = []
    for line in text.split("\r\n\r\n", 1)[-1].splitlines():
        name = line.split("{")[0].split(" ")[0]
        # (the health probes' count is the interval's, not the requests')
        if (
            (name.endswith("_total") or name.endswith("_count"))
            and name != "lb_health_probes_total"
            and not name.startswith("process_")
        ):
            keep.append(re.sub(r"127\.0\.0\.1:\d+", "B", line))
    return sorted(keep)


def run_group(cwd, group: str, tmp: Path) -> dict:
    """Every case through one edge (from checkout cwd) in front of its own scripted backend."""
    backend = ScriptedBackend()
    dead = f"http://127.0.0.1:{free_port()}"
    log = tmp / f"{group}-{abs(hash(str(cwd)))}.log"
    conf = tmp / f"{group}-{abs(hash(str(cwd)))}.toml"
    conf.write_text(ROUTES)
    args = [a.replace("{log}", str(log)).replace("{conf}", str(conf)) for a in GROUPS[group]]
    backends = backend.url + ("," + dead if group == "retries-rid" else "")
    edge = Edge("--backends", backends, *args, name=f"diet-{group}", cwd=cwd)
    out: dict = {"cases": []}
    try:
        table = {n: ("127.0.0.1", b) for n, b in REQUESTS}
        if group == "limit":
            cases = [(n, *table[n]) for n in LIMIT_CASES]
        elif group.startswith("limit-keys"):
            cases = KEY_CASES
        else:
            cases = [(n, *table[n]) for n, _ in REQUESTS]
        for name, source, data in cases:
            got = _exchange(edge.port, data, source)
            seen = [mask(b) for b in backend.take() if not b.startswith(b"GET /health ")]  # (probes: timing)
            out["cases"].append([name, mask(got), seen])
        metrics = _counters(edge.admin_port)
    finally:
        edge.stop()
        backend.close()
    if group != "retries-rid":  # which backend a retry went to first is the balancer's draw
        out["log"] = sorted(_log_lines(log))
        out["metrics"] = metrics
    return out


def _recorded() -> dict:
    return json.loads(DATA.read_text()) if DATA.exists() else {}


def _diff(expected: dict, got: dict) -> list[str]:
    out = []
    for (name, c1, b1), (_, c2, b2) in zip(expected["cases"], got["cases"]):
        if c1 != c2:
            out.append(f"{name}: client got\n  main: {c1!r}\n  tree: {c2!r}")
        if b1 != b2:
            out.append(f"{name}: backend got\n  main: {b1!r}\n  tree: {b2!r}")
    for k in ("log", "metrics"):
        e, g = expected.get(k) or [], got.get(k) or []
        if k == "log":  # bytes sent: the client's bytes are compared above, masked; this count is not
            e, g = _sent_masked(e), _sent_masked(g)
        if e != g:
            out.append(f"{k}: main-only {sorted(set(e) - set(g))!r}\n  tree-only {sorted(set(g) - set(e))!r}")
    return out


def _sent_masked(lines: list[str]) -> list[str]:
    """A line's bytes-sent count moves with the X-RateLimit-Reset and Retry-After values' digits (seconds to
    an hour window's end: 4 digits at ten past, 3 at five to), which the client comparison masks."""
    return sorted(re.sub(r'(" \d{3}) \d+ ', r"\1 * ", line) for line in lines)


@pytest.mark.parametrize("group", list(GROUPS))
def test_the_tree_answers_as_main_did(group, tmp_path):
    got = run_group(Path(__file__).resolve().parent.parent, group, tmp_path)
    if REFERENCE:
        expected = run_group(REFERENCE, group, tmp_path)
        if os.environ.get("EDGE_DIET_RECORD"):
            rec = _recorded()
            rec[group] = expected
            DATA.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
    else:
        expected = _recorded().get(group)
        if expected is None:
            pytest.skip(f"no reference checkout and nothing recorded for {group}")
    assert len(got["cases"]) == len(expected["cases"])
    problems = _diff(expected, got)
    assert not problems, "\n".join(problems)
