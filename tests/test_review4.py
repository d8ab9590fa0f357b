"""Review 4: attacks on two merged changes.

1. RedisLink._alone (d26c7bb): a decision with nobody queued makes its round trip without a Call. Each
   attack below hits that path (one caller at a time, or a pool of 1) with a failure -- the server
   killed mid-call, a connection killed between calls, SCRIPT FLUSH, an OOM or WRONGTYPE error reply, a
   server that answers only after the timeout -- and then checks that the decision and the breaker are
   what they must be, that concurrent callers are still served exactly, and that no flight leaked
   (batcher._out back to 0).
2. Request.sent (62b761f, e10bf7c): the upstream head's first part kept with a client connection's head
   memo. Each attack sends the same head bytes twice on one connection with something in between that a
   fresh build would see (a reload, another backend, a body) and compares what the backend received
   with what the same request on a new connection (no memo) gets, byte for byte.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from limiter import build
from tests.redis_server import RedisServer
from tests.support import wait_until

_ids = itertools.count()


def fresh(prefix="r4"):
    return f"{prefix}{next(_ids)}:{time.monotonic_ns()}:"


def _is_decision(d) -> bool:
    return type(d).__name__ == "Decision"


def _still_serves(lim, threads: int = 8, each: int = 4) -> None:
    """Concurrent callers on their own keys all get exact answers from Redis, and no flight leaked."""
    go = threading.Barrier(threads)
    out: list[list] = [[] for _ in range(threads)]
    tag = fresh("after")

    def run(i):
        go.wait()
        for _ in range(each):
            out[i].append(lim.allow(f"{tag}{i}", 100.0))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts)
    for ds in out:
        assert all(_is_decision(d) and d.allowed for d in ds), ds
        first = ds[0].remaining
        assert [d.remaining for d in ds] == list(range(first, first - each, -1)), ds
    b = lim.link.batcher
    assert b._out == 0 and not b._queue, (b._out, b._queue)


# ----------------------------------------------------------------------------------- 1. RedisLink._alone


def test_alone_uses_the_fast_path_for_a_lone_caller(redis_server):
    """The attacks below are on _alone: a lone caller's decisions go through it (a call counted, no Call)."""
    from limiter.redis import link as link_mod

    lim = build("fixed-window", 100, 60.0, store=redis_server.url, prefix=fresh(), timeout=2.0, deny_cache=0)
    assert lim.allow("warm", 100.0).allowed  # connects and loads the script (through _flight)
    seen = []
    real = lim.link._alone

    def spy(script, cmd):
        r = real(script, cmd)
        seen.append(r is not link_mod.NOT_SENT)
        return r

    lim.link.batcher._alone = spy
    for _ in range(5):
        assert lim.allow("c", 100.0).allowed
    assert seen == [True] * 5


def test_alone_redis_killed_mid_call_fails_that_call_then_a_restart_serves(own_redis):
    """The server is SIGSTOPped with our lone call sent (so the call is in the air), then SIGKILLed: the
    call fails (ConnectionError: the breaker, the failure policy), returns promptly; a server restarted on
    the same port serves again and the flight count is back to 0."""
    lim = build("fixed-window", 100, 60.0, store=own_redis.url, prefix=fresh(), timeout=1.0,
                retry_interval=0.05, on_error="fail-closed", deny_cache=0)
    assert lim.allow("c", 100.0).allowed
    assert lim.allow("c", 100.0).allowed  # through _alone now
    own_redis.pause()
    result = []
    t = threading.Thread(target=lambda: result.append(lim.allow("c", 100.0)))
    t.start()
    time.sleep(0.2)  # the call is sent and waiting on the stopped server
    own_redis.kill()
    t.join(5)
    assert not t.is_alive()
    assert result and result[0].unavailable and not result[0].allowed
    assert lim.failures == 1 and not lim.link.up
    assert lim.link.batcher._out == 0
    own_redis.start()
    wait_until(lambda: lim.allow("c", 100.0).allowed and lim.link.up, timeout=5, what="recovery")
    _still_serves(lim)


def test_alone_client_kill_between_calls_reconnects_without_a_failure_or_a_double_count(redis_server):
    """Every connection of ours killed between two lone calls: the next one sees EOF before sending,
    goes to _flight (reconnects) and is counted once."""
    lim = build("fixed-window", 10, 60.0, store=redis_server.url, prefix=fresh(), timeout=2.0, deny_cache=0)
    assert lim.allow("c", 100.0).remaining == 9
    assert lim.allow("c", 100.0).remaining == 8
    for n in range(3):
        assert redis_server.client().client_kill_filter(_type="normal", skipme=True) >= 1
        time.sleep(0.05)
        d = lim.allow("c", 100.0)
        assert _is_decision(d) and d.remaining == 7 - n
    assert lim.failures == 0 and lim.degraded == 0 and lim.link.batcher._out == 0
    _still_serves(lim)


@pytest.mark.parametrize("algorithm", ["fixed-window", "sliding-log", "token-bucket", "sliding-counter"])
def test_alone_script_flush_between_lone_calls_runs_the_script_once(redis_server, algorithm):
    """SCRIPT FLUSH: the lone call gets NOSCRIPT (not run), _flight loads and runs it: counted once."""
    lim = build(algorithm, 5, 60.0, store=redis_server.url, prefix=fresh(), timeout=2.0, deny_cache=0)
    rems = [lim.allow("c", 100.0).remaining]
    for _ in range(4):
        redis_server.client().script_flush()
        d = lim.allow("c", 100.0)
        assert _is_decision(d)
        rems.append(d.remaining)
    assert rems == [4, 3, 2, 1, 0], rems
    assert not lim.allow("c", 100.0).allowed
    assert lim.failures == 0 and lim.degraded == 0 and lim.link.batcher._out == 0


@pytest.mark.parametrize("threads", [2, 8, 32])
def test_alone_a_pool_of_one_with_concurrent_callers_each_exact(redis_server, threads):
    """pool_size=1 (one flight): concurrent callers, each on its own key (limit 5, 8 tries), each gets
    exactly 5 admissions counting down; nobody reaches the policy; nothing leaked."""
    lim = build("fixed-window", 5, 60.0, store=redis_server.url, prefix=fresh(), timeout=2.0, pool_size=1,
                deny_cache=0)
    assert lim.link.batcher.flights == 1
    go = threading.Barrier(threads)
    out: list[list] = [[] for _ in range(threads)]

    def run(i):
        go.wait()
        for _ in range(8):
            out[i].append(lim.allow(f"k{i}", 100.0))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    for ds in out:
        assert [d.allowed for d in ds] == [True] * 5 + [False] * 3
        assert [d.remaining for d in ds[:5]] == [4, 3, 2, 1, 0]
    assert lim.failures == 0 and lim.degraded == 0
    assert lim.link.batcher._out == 0 and not lim.link.batcher._queue


def test_alone_two_lone_callers_on_a_pool_with_one_connection_made(redis_server):
    """pool_size 4, two flights, but one connection ever made (all traffic serial so far): two callers at
    once both find it idle or not -- neither may fail (the second makes a connection through _flight)."""
    import sys

    lim = build("fixed-window", 10**6, 60.0, store=redis_server.url, prefix=fresh(), timeout=2.0, pool_size=4,
                deny_cache=0)
    assert lim.allow("c", 100.0).allowed
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # as many thread switches as the interpreter allows
    try:
        for _ in range(20):
            errors = []

            def run(i):
                try:
                    for _ in range(20):
                        assert _is_decision(lim.allow(f"k{i}", 100.0))
                except BaseException as e:  # noqa: BLE001 (recorded, asserted below)
                    errors.append(e)  # noqa: B023 (joined within the iteration)

            ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            assert not errors, errors
    finally:
        sys.setswitchinterval(old)
    assert lim.failures == 0 and lim.degraded == 0 and lim.link.batcher._out == 0


def test_alone_oom_error_reply_fails_that_call_keeps_the_breaker_and_the_connection_in_step(own_redis):
    """maxmemory 1 + noeviction: the script's write gets an OOM error reply. That call's policy decides
    (fail-closed: unavailable), the breaker stays closed (call_errors, not failures), and once memory is
    back the same connection answers the next call with its own reply (in step)."""
    lim = build("fixed-window", 10, 60.0, store=own_redis.url, prefix=fresh(), timeout=2.0,
                on_error="fail-closed", deny_cache=0)
    assert lim.allow("c", 100.0).remaining == 9
    assert lim.allow("c", 100.0).remaining == 8
    conns = list(lim.link.pool._idle)
    socks = [s.sock for s in conns]
    r = own_redis.client()
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", "1")
    try:
        for _ in range(3):
            d = lim.allow("new-key", 100.0)  # a new key: the write needs memory
            assert d.unavailable and not d.allowed, d
        assert lim.link.call_errors >= 3 and lim.failures == 0 and lim.link.up
        assert lim.link.batcher._out == 0
    finally:
        r.config_set("maxmemory", "0")
    d = lim.allow("c", 100.0)
    assert _is_decision(d) and d.remaining == 7
    assert [s.sock for s in lim.link.pool._idle] == socks  # the same connection: it stayed in step
    d = lim.allow("new-key", 100.0)
    assert _is_decision(d) and d.remaining == 9  # the refused calls counted nothing
    _still_serves(lim)


def test_alone_wrongtype_script_error_is_that_calls_alone(redis_server):
    """A script error (the key replaced by a list: WRONGTYPE inside the script) on the lone path: that
    key's decision is the policy's, the breaker stays closed, another key is served on the same
    connection right after, in step."""
    prefix = fresh()
    lim = build("fixed-window", 10, 60.0, store=redis_server.url, prefix=prefix, timeout=2.0,
                on_error="fail-open", deny_cache=0)
    assert lim.allow("bad", 100.0).allowed
    assert lim.allow("good", 100.0).allowed
    r = redis_server.client()
    keys = [k for k in r.scan_iter(match=f"{prefix}*") if b"bad" in k]
    assert keys
    for k in keys:
        r.delete(k)
        r.rpush(k, "x")
    for _ in range(3):
        d = lim.allow("bad", 100.0)
        assert not _is_decision(d) and d.allowed  # fail-open's answer
        d = lim.allow("good", 100.0)
        assert _is_decision(d)
    assert lim.allow("good", 100.0).remaining == 10 - 5
    assert lim.failures == 0 and lim.link.up and lim.link.call_errors >= 3
    assert lim.link.batcher._out == 0
    _still_serves(lim)


def test_alone_a_reply_after_the_timeout_is_never_taken_for_the_next_calls(own_redis):
    """The server answers the lone call after the timeout (SIGSTOP longer than it, then SIGCONT): the call
    times out (the breaker opens), its connection is closed -- so the late reply (remaining 8) can never
    be read as a later call's. After the retry interval the next calls get their own replies."""
    lim = build("fixed-window", 10, 60.0, store=own_redis.url, prefix=fresh(), timeout=0.2,
                retry_interval=0.05, on_error="fail-closed", deny_cache=0)
    wait_until(lambda: lim.allow("warm", 100.0).allowed and lim.link.up, timeout=10, what="a first answer")
    assert lim.allow("c", 100.0).remaining == 9
    own_redis.pause()
    try:
        d = lim.allow("c", 100.0)
        assert d.unavailable and lim.failures == 1
    finally:
        own_redis.resume()
    time.sleep(0.1)
    wait_until(lambda: _is_decision(lim.allow("other", 100.0)) and lim.link.up, timeout=5, what="recovery")
    # the timed-out call ran on the server when it resumed (remaining 8): the next is 7, its own
    d = lim.allow("c", 100.0)
    assert _is_decision(d) and d.remaining == 7, d
    d = lim.allow("other2", 100.0)
    assert _is_decision(d) and d.remaining == 9, d
    assert lim.link.batcher._out == 0
    _still_serves(lim)


def test_alone_debug_sleep_past_the_timeout(tmp_path):
    """DEBUG SLEEP 1.5 s (the server busy, not stopped) past the 0.2 s timeout, from another client while our lone
    call waits: as above, with the server itself blocking."""
    server = RedisServer(extra=("--enable-debug-command", "yes")).start()
    try:
        lim = build("fixed-window", 10, 60.0, store=server.url, prefix=fresh(), timeout=0.2,
                    retry_interval=0.05, on_error="fail-open", deny_cache=0)
        wait_until(lambda: _is_decision(lim.allow("warm", 100.0)), timeout=10, what="a first answer")
        assert lim.allow("c", 100.0).remaining == 9
        sleeper = threading.Thread(target=lambda: server.client().execute_command("DEBUG", "SLEEP", "1.5"))
        sleeper.start()
        time.sleep(0.1)
        t = time.monotonic()
        d = lim.allow("c", 100.0)
        assert time.monotonic() - t < 1.0  # the timeout (0.2 s), not the sleep (1.4 s more)
        assert not _is_decision(d) and d.allowed and lim.failures == 1
        assert lim.link.batcher._out == 0
        sleeper.join(5)
        wait_until(lambda: _is_decision(lim.allow("other", 100.0)), timeout=5, what="recovery")
        d = lim.allow("c", 100.0)
        assert _is_decision(d) and d.remaining == 7, d
        _still_serves(lim)
    finally:
        server.stop()


def test_alone_an_exception_out_of_alone_lands_the_flight(redis_server):
    """Whatever _alone raises (here a non-Redis error injected), the flight is landed: _out back to 0 and
    queued callers are not stranded."""
    lim = build("fixed-window", 10**6, 60.0, store=redis_server.url, prefix=fresh(), timeout=2.0, deny_cache=0)
    assert lim.allow("warm", 100.0).allowed
    b = lim.link.batcher
    real = b._alone
    calls = [0]

    def boom(script, cmd):
        calls[0] += 1
        if calls[0] <= 3:
            raise KeyError("injected")
        return real(script, cmd)

    b._alone = boom
    for _ in range(3):
        with pytest.raises(KeyError):
            b.call(None, b"")
        assert b._out == 0
    b._alone = real
    _still_serves(lim)


def test_alone_the_timed_out_calls_late_reply_is_not_read_by_the_probe_right_after_a_resume(own_redis):
    """As above, but the probe is sent the moment the server resumes (before the late reply can show in a
    poll): only the closing of the timed-out connection keeps the probe from reading that reply (for
    another key: remaining 8) as its own (remaining 9)."""
    lim = build("fixed-window", 10, 60.0, store=own_redis.url, prefix=fresh(), timeout=0.2,
                retry_interval=0.05, on_error="fail-closed", deny_cache=0)
    wait_until(lambda: lim.allow("warm", 100.0).allowed and lim.link.up, timeout=10, what="a first answer")
    for i in range(5):
        assert lim.allow(f"c{i}", 100.0).remaining == 9
        assert lim.allow(f"c{i}", 100.0).remaining == 8  # (through _alone)
        own_redis.pause()
        try:
            assert lim.allow(f"c{i}", 100.0).unavailable
            time.sleep(0.1)  # past retry_interval: the next call is the probe
        finally:
            own_redis.resume()
        d = lim.allow(f"other{i}", 100.0)
        assert not _is_decision(d) or d.remaining == 9, d
        wait_until(lambda: _is_decision(lim.allow("warm", 100.0)) and lim.link.up, timeout=5, what="recovery")
    assert lim.link.batcher._out == 0
    _still_serves(lim)


# ----------------------------------------------------------------------------------- 2. Request.sent

import re  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402

from tests.support import Edge  # noqa: E402
from tests.test_memo_review import Recorder, responses  # noqa: E402

_RID = re.compile(rb"(\r\nX-R(?:equest-)?id: )[0-9a-f]{16,}", re.I)  # (X-Rid: a route's $request_id)


def _norm(head: bytes) -> bytes:
    """A recorded head with the edge's generated request id (its own per request) masked."""
    return _RID.sub(rb"\1<generated>", head)


def _exchange(s: socket.socket, req: bytes) -> tuple[bytes, bytes]:
    """One request on s, its response; with Expect: 100-continue as a client does it: the head, the 100,
    then the body."""
    if b"\r\nExpect: 100-continue" not in req:
        s.sendall(req)
        return responses(s, 1)[0]
    head, body = req.split(b"\r\n\r\n", 1)
    s.sendall(head + b"\r\n\r\n")
    buf = b""
    while not buf.endswith(b"\r\n\r\n"):
        d = s.recv(1)
        assert d, buf
        buf += d
    assert buf.startswith(b"HTTP/1.1 100 "), buf
    s.sendall(body)
    return responses(s, 1)[0]


def _on_new_connection(e: Edge, b: Recorder, req: bytes, body_len: int = 0) -> bytes:
    """What the backend gets for `req` sent alone on a new client connection (no memo: a fresh build)."""
    n = len(b.seen)
    with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
        _exchange(s, req)
    wait_until(lambda n=n: len(b.seen) > n, timeout=5, what="the request at the backend")
    return b.seen[-1][0]


def _twice_then_fresh(e, b, req, between=None, times=3):
    """`req` `times` times on one connection (the memo keeps a parse from the second, the first part is
    written to it then and reused from the third), `between()`, `times` more; then the same on a new
    connection: the last one on the kept connection and the fresh one must be the same bytes."""
    with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
        for i in range(2 * times):
            if i == times and between is not None:
                between()
            n = len(b.seen)
            s.sendall(req)
            responses(s, 1)
            wait_until(lambda n=n: len(b.seen) > n, timeout=5, what="the request at the backend")
        kept = b.seen[-1]
        fresh_head = _on_new_connection(e, b, req)
    return kept, fresh_head


def _reload(e, conf, text):
    conf.write_text(text)
    e.signal(signal.SIGHUP)
    e.wait_log(r"reloaded")


_REQS = [
    b"GET /a HTTP/1.1\r\nHost: h\r\nX-Forwarded-For: 1.2.3.4\r\nX-Forwarded-Proto: https\r\n"
    b"X-Forwarded-Host: outer\r\nX-Request-Id: client-id-0001\r\nX_Under: 1\r\nX-A: a\r\n\r\n",
    b"GET /b HTTP/1.1\r\nHost: h\r\nX-Request-Id: bad id!\r\n\r\n",  # not well formed: the edge's id
    b"GET /c HTTP/1.1\r\nHost: h\r\n\r\n",
]


@pytest.mark.parametrize("req", _REQS, ids=["forwarded", "bad-id", "plain"])
@pytest.mark.parametrize(
    "before,after",
    [
        ("", "[limits]\ntrusted_proxies = [\"127.0.0.1/32\"]\n"),
        ("[limits]\ntrusted_proxies = [\"127.0.0.1/32\"]\n", ""),
        ("[server]\nallow_underscores = false\n", "[server]\nallow_underscores = true\n"),
        ("[server]\nallow_underscores = true\n", "[server]\nallow_underscores = false\n"),
        ("", "ROUTE"),
        ("ROUTE", ""),
    ],
    ids=["trust-on", "trust-off", "underscores-on", "underscores-off", "route-added", "route-removed"],
)
def test_sent_a_reload_between_identical_requests_sends_what_a_fresh_build_sends(tmp_path, req, before, after):
    """A reload between two identical heads on one connection (trusted proxies, underscores, a route with
    request header edits added or removed): the second is sent as the same request on a new connection is."""
    b = Recorder()
    route = (f'[[backends]]\nurl = "{b.url}"\n[[routes]]\nname = "r"\nmatch = {{ path_prefix = "/" }}\npool = "default"\n'
             'request_headers = { set = { "X-Client" = "$remote_addr", "X-Rid" = "$request_id" }, remove = ["X-A"] }\n')

    def text(t):
        return route if t == "ROUTE" else t + f'[[backends]]\nurl = "{b.url}"\n'

    conf = tmp_path / "e.toml"
    conf.write_text(text(before))
    e = Edge("--config", str(conf), "--health-interval", "30")
    try:
        (kept, _), fresh_head = _twice_then_fresh(e, b, req, lambda: _reload(e, conf, text(after)))
        if after == "ROUTE":
            assert b"\r\nX-Client: " in fresh_head
        assert _norm(kept) == _norm(fresh_head)
    finally:
        e.stop()
        b.close()


def test_sent_http10_without_host_gets_each_backends_own_host(tmp_path):
    """HTTP/1.0 without Host, kept alive, on two backends in turn: each gets Host: its own address (the
    line is the backend's, never a remembered one)."""
    b1, b2 = Recorder(), Recorder()
    e = Edge("--backends", f"{b1.url},{b2.url}", "--health-interval", "30", "--strategy", "round-robin")
    try:
        req = b"GET /old HTTP/1.0\r\nConnection: keep-alive\r\nUser-Agent: u\r\n\r\n"
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            for _ in range(6):
                s.sendall(req)
                responses(s, 1)
        for rec in (b1, b2):
            assert rec.seen
            hostport = rec.url.split("//", 1)[1].rstrip("/").encode()
            for head, _ in rec.seen:
                assert re.findall(rb"\r\nHost: ([^\r]*)", head) == [hostport], head
    finally:
        e.stop()
        b1.close()
        b2.close()


@pytest.mark.parametrize(
    "req",
    [
        b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello",
        b"POST /p HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"POST /p HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello",
        b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        b"GET /c HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, X-A\r\nX-A: 1\r\nX-B: 2\r\n\r\n",
        b"GET /n HTTP/1.1\r\nhost:h\r\nX-A:   spaced \r\nX-Forwarded-Client-Cert: forged\r\n\r\n",
        b"GET /z HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n",
        b"GET /v10 HTTP/1.0\r\nHost: h\r\nConnection: keep-alive\r\n\r\n",
    ],
    ids=["length", "chunked", "expect", "upgrade", "connection-tokens", "non-canonical", "length-0", "http10-host"],
)
def test_sent_identical_heads_with_bodies_and_framing_send_what_a_fresh_build_sends(tmp_path, req):
    b = Recorder()
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            got = []
            for _ in range(3):
                n = len(b.seen)
                got.append(_exchange(s, req))
                assert got[-1][0].startswith(b"HTTP/1.1 200"), got
                wait_until(lambda n=n: len(b.seen) > n, timeout=5, what="the request at the backend")
        kept = [(_norm(h), body) for h, body in b.seen]
        fresh_head = _on_new_connection(e, b, req)
        assert all(k == kept[0] for k in kept), kept
        assert kept[0][0] == _norm(fresh_head)
    finally:
        e.stop()
        b.close()


def test_sent_pipelined_identical_requests_each_sent_as_a_fresh_build(tmp_path):
    b = Recorder()
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        req = b"POST /p HTTP/1.1\r\nHost: h\r\nX-Forwarded-For: 9.9.9.9\r\nContent-Length: 3\r\n\r\nabc"
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            s.sendall(req * 6)
            responses(s, 6)
        fresh_head = _on_new_connection(e, b, req)
        assert len(b.seen) == 7
        assert all(_norm(h) == _norm(fresh_head) and body == b"abc" for h, body in b.seen), b.seen
    finally:
        e.stop()
        b.close()


def test_sent_a_retry_to_another_backend_and_back_sends_what_a_fresh_build_sends(tmp_path):
    """Backend A refuses connections (nothing listens), so tries move to B: the kept first part (written
    for the try on A) is what B gets, the same as a fresh build."""
    b = Recorder()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()
    log = tmp_path / "access.log"
    e = Edge("--backends", f"{dead_url},{b.url}", "--health-interval", "30", "--strategy", "round-robin",
             "--retries", "2", "--access-log", str(log))
    try:
        req = b"GET /r HTTP/1.1\r\nHost: h\r\nX-Forwarded-Proto: https\r\n\r\n"
        (kept, _), fresh_head = _twice_then_fresh(e, b, req, times=4)
        assert _norm(kept) == _norm(fresh_head)
        wait_until(lambda: log.exists() and " tries=2 " in log.read_text(), timeout=5, what="a retried request")
    finally:
        e.stop()
        b.close()


@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_sent_the_same_head_with_bodies_of_other_lengths_gets_each_its_own_framing(tmp_path, framing):
    """The same chunked head with a body of another size each time (the edge may count it: a length of its
    own), or the same Content-Length head: each request's framing line says its own body."""
    b = Recorder()
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        bodies = [b"a" * n for n in (3, 10, 3, 1, 10, 0)] if framing == "chunked" else [b"abcde"] * 3
        with socket.create_connection(("127.0.0.1", e.port), timeout=5) as s:
            for body in bodies:
                if framing == "chunked":
                    chunks = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
                    s.sendall(b"POST /p HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
                else:
                    s.sendall(b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\n" + body)
                assert responses(s, 1)[0][0].startswith(b"HTTP/1.1 200")
        wait_until(lambda: len(b.seen) == len(bodies), timeout=5, what="every request at the backend")
        for (head, got), body in zip(b.seen, bodies):
            cl = re.findall(rb"\r\nContent-Length: *(\d+)", head, re.I)
            te = re.findall(rb"\r\nTransfer-Encoding: *([^\r]*)", head, re.I)
            assert len(cl) + len(te) == 1, head
            if cl:
                assert int(cl[0]) == len(body) and got == body, (head, got)
            else:
                assert te == [b"chunked"]
    finally:
        e.stop()
        b.close()


def test_sent_identical_http2_streams_each_sent_as_on_a_new_connection(tmp_path):
    """HTTP/2 streams with the same fields on one connection (a Request from fields: no memo, sent None),
    then on a new connection: the backend gets the same bytes each time."""
    from tests.h2client import H2Client

    b = Recorder()
    e = Edge("--backends", b.url, "--health-interval", "30")
    try:
        hdrs = [("x-forwarded-for", "5.6.7.8"), ("x-a", "1"), ("x-request-id", "client-id-0002")]
        for _ in range(2):
            c = H2Client(e.port)
            try:
                for _ in range(3):
                    sid = c.request("/h2", "GET", headers=hdrs)
                    assert c.response(sid)["headers"][b":status"] == b"200"
            finally:
                c.close()
        wait_until(lambda: len(b.seen) == 6, timeout=5, what="six requests at the backend")
        heads = [_norm(h) for h, _ in b.seen]
        assert all(h == heads[0] for h in heads), heads
        assert b"\r\nX-Forwarded-For: 5.6.7.8, 127.0.0.1\r\n" in heads[0]
    finally:
        e.stop()
        b.close()
