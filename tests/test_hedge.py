"""Hedged requests (--hedge-after, lb/proxy/hedge.py): through real edges and raw keep-alive backends."""

from __future__ import annotations

import json
import select
import threading
import time

import pytest

from tests.rawserver import ConnReader, RawServer, read_request
from tests.support import Edge, request, wait_until
from tests.test_failover import admin, metric


class Delayed(RawServer):
    """A keep-alive backend answering each request after delay(n) seconds (n: 0, 1, ... of those it
    got), with a body naming itself. While it waits it watches the connection: a close by the edge
    before the answer is counted in `abandoned` (the hedge's loser must be closed, not kept)."""

    def __init__(self, name: str, delay, close_instead: bool = False):
        self.name, self.delay, self.close_instead = name, delay, close_instead
        self.got: list[str] = []
        self.abandoned = 0
        self.answered = 0
        super().__init__(self._serve)

    def _serve(self, s, _server):
        r = ConnReader(s)
        while True:
            try:
                req = read_request(r)
            except EOFError:
                return
            if req is None:
                return
            if req[1] == "/health":
                s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                continue
            with self.lock:
                n = len(self.got)
                self.got.append(req[0])
            wait = self.delay(n)
            if wait and select.select([s], [], [], wait)[0]:
                if not s.recv(1, 2):         # MSG_PEEK: the edge closed the connection while we worked
                    with self.lock:
                        self.abandoned += 1
                    return
            if self.close_instead:          # a backend that dies on the request: the edge sees a reset
                return
            body = f"{self.name} {req[1]}".encode()     # names the request: a stale answer shows
            try:
                s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                return
            with self.lock:
                self.answered += 1


def edge_for(backends, *extra, log=None):
    args = ["--backends", ",".join(b.url for b in backends), "--strategy", "round-robin",
            "--health-interval", "30", "--admin", "127.0.0.1:0", "--eject-after", "0", *extra]
    if log is not None:
        args += ["--access-log", str(log)]
    return Edge(*args)


def timed(e, method="GET", path="/", body=None):
    """(response, seconds); the response's body is the name of the backend that answered, checked to be
    the answer to this request."""
    t0 = time.monotonic()
    r = request(e.port, method, path, body=body)
    took = time.monotonic() - t0
    if r.status == 200:
        name, _, target = r.body.partition(b" ")
        assert target == path.encode(), (path, r.body)
        r.body = name
    return r, took


def status(e) -> dict:
    return json.loads(admin(e, "GET", "/status")[1])


def settled(e) -> dict:
    """/status once every hedge's thread has given back what it held."""
    def quiet():
        s = status(e)
        return s if s["retries"]["in_flight"] == 0 and all(b["inflight"] == 0 for b in s["backends"]) else None
    return wait_until(quiet, timeout=10, what="no request, retry slot or hedge in flight")


@pytest.fixture
def pair():
    slow = Delayed("slow", lambda n: 1.0)
    fast = Delayed("fast", lambda n: 0.0)
    yield slow, fast
    slow.close()
    fast.close()


def test_a_slow_backend_is_hedged_and_every_response_comes_in_under_half_a_second(pair, tmp_path):
    slow, fast = pair
    log = tmp_path / "access.log"
    e = edge_for([slow, fast], "--hedge-after", "0.05", log=log)
    try:
        got = [timed(e, path=f"/r{i}") for i in range(8)]
        assert all(r.status == 200 and r.body == b"fast" for r, _ in got), [(r.status, r.body) for r, _ in got]
        assert max(t for _, t in got) < 0.5, [round(t, 3) for _, t in got]
        assert len(slow.got) >= 3                     # round-robin sent it its share first
        hedged = len(slow.got)
        wait_until(lambda: metric(e, 'lb_hedges_total{result="won"}') == hedged, what="the hedges counted as won")
        # The slow backend's exchanges were abandoned: each connection closed before it answered.
        wait_until(lambda: slow.abandoned == hedged, timeout=5, what="every losing connection closed")
        assert slow.answered == 0
        s = settled(e)
        assert s["hedge"]["after"] == 0.05 and s["hedge"]["won"] == hedged and s["hedge"]["sent"] == hedged
        assert s["retries"]["in_flight"] == 0          # the budget slots went back
        assert metric(e, f'lb_requests_total{{backend="{slow.url}"}}') == hedged   # both exchanges counted
        lines = wait_until(lambda: (lambda t: t if t.count("\n") >= 8 else None)(log.read_text() if log.exists()
                                                                                  else ""), what="8 log lines")
        won = [ln for ln in lines.splitlines() if " hedge=won " in ln + " "]
        assert len(won) == hedged, lines
        assert all(fast.url in ln and f"other={slow.url}" in ln for ln in won), won
    finally:
        e.stop()


def test_round_robin_still_alternates_first_tries_when_every_try_on_one_backend_is_hedged(pair):
    """A hedge is a second opinion, not a turn: with round robin over [slow, fast], the hedge to fast must
    not take fast's turn, or the next request's first try goes to slow again -- every request paying the
    hedge delay (8 of 8 first tries on the slow backend before lb/upstream/balancer.pick's turn=False)."""
    slow, fast = pair
    e = edge_for([slow, fast], "--hedge-after", "0.05")
    try:
        got = [timed(e, path=f"/a{i}") for i in range(8)]
        assert all(r.status == 200 and r.body == b"fast" for r, _ in got), [(r.status, r.body) for r, _ in got]
        assert len(slow.got) <= 5, f"{len(slow.got)} of 8 first tries on the slow backend (its share: 4)"
        settled(e)
    finally:
        e.stop()


def test_a_post_is_never_hedged(pair):
    slow, fast = pair
    e = edge_for([slow, fast], "--hedge-after", "0.05")
    try:
        got = [timed(e, "POST", f"/p{i}", body=b"x") for i in range(2)]
        assert sorted(r.body for r, _ in got) == [b"fast", b"slow"]
        assert [t for r, t in got if r.body == b"slow"][0] >= 0.9     # it waited for the slow one
        assert fast.got == ["POST"] and slow.got == ["POST"]          # nobody got it twice
        assert status(e)["hedge"]["sent"] == 0
    finally:
        e.stop()


def test_no_hedge_once_the_retry_budget_is_spent(pair):
    slow, fast = pair
    e = edge_for([slow, fast], "--hedge-after", "0.05", "--retry-budget-min", "0", "--retry-budget-percent", "0")
    try:
        got = [timed(e, path=f"/r{i}") for i in range(2)]
        assert sorted(r.body for r, _ in got) == [b"fast", b"slow"]
        assert [t for r, t in got if r.body == b"slow"][0] >= 0.9
        assert fast.got == ["GET"]                                    # no second copy of the slow one's
        assert metric(e, 'lb_hedges_skipped_total{reason="budget"}') == 1
        assert status(e)["hedge"]["sent"] == 0
    finally:
        e.stop()


def test_when_both_are_slow_the_first_head_wins_and_the_hedge_is_closed():
    a = Delayed("a", lambda n: 0.6)
    b = Delayed("b", lambda n: 0.6)     # the hedge, sent 0.3 s later, would answer 0.3 s after the first
    e = edge_for([a, b], "--hedge-after", "0.3", "--max-requests", "10")
    try:
        r, t = timed(e, path="/one")
        assert r.status == 200 and r.body in (b"a", b"b")
        first, second = (a, b) if r.body == b"a" else (b, a)
        assert second.got == ["GET"]                                  # the hedge was sent ...
        wait_until(lambda: second.abandoned == 1, timeout=5, what="the hedge's connection closed")
        assert second.answered == 0                                   # ... and closed before it answered
        wait_until(lambda: metric(e, 'lb_hedges_total{result="lost"}') == 1, what="the hedge counted as lost")
        s = settled(e)
        assert s["breaker"]["in_flight"] == 0                         # the hedge's place under max_requests back
        # The first's connection was kept (a clean exchange) and serves the next request; the hedge's is gone.
        r2, _ = timed(e, path="/two")
        assert r2.status == 200
    finally:
        e.stop()
        a.close()
        b.close()


def test_the_losers_response_never_reaches_another_request():
    """A loser that does answer (it ignores the close) is never read as someone else's response."""
    calls = {"n": 0}
    lock = threading.Lock()

    def slow_first(n):
        with lock:
            calls["n"] += 1
        return 0.3 if n == 0 else 0.0
    a = Delayed("a", slow_first)
    b = Delayed("b", lambda n: 0.0)
    e = edge_for([a, b], "--hedge-after", "0.05")
    try:
        r, t = timed(e, path="/x")
        assert r.body == b"b"                       # the hedge answered: a was still working
        wait_until(lambda: a.abandoned == 1, timeout=5, what="the loser's connection closed")
        # Later requests to a: fresh connections, each answered with a's own body, in order.
        bodies = [timed(e, path=f"/n{i}")[0].body for i in range(6)]
        assert sorted(set(bodies)) == [b"a", b"b"] and bodies.count(b"a") == 3
        settled(e)
    finally:
        e.stop()
        a.close()
        b.close()


def test_a_first_try_that_fails_after_the_hedge_went_leaves_the_answer_to_the_hedge():
    dying = Delayed("dying", lambda n: 0.2, close_instead=True)
    late = Delayed("late", lambda n: 0.4)
    e = edge_for([dying, late], "--hedge-after", "0.05", "--max-requests", "10")
    try:
        r, t = timed(e, path="/d")          # round-robin: the dying one first
        assert r.status == 200 and r.body == b"late", (r.status, r.body)
        assert metric(e, 'lb_hedges_total{result="won"}') == 1
        assert metric(e, f'lb_upstream_errors_total{{backend="{dying.url}",kind="reset"}}') == 1
        s = settled(e)
        assert s["breaker"]["in_flight"] == 0
    finally:
        e.stop()
        dying.close()
        late.close()


def test_a_failed_hedge_is_counted_and_the_first_still_answers():
    slowish = Delayed("slowish", lambda n: 0.3)
    dying = Delayed("dying", lambda n: 0.0, close_instead=True)
    e = edge_for([slowish, dying], "--hedge-after", "0.05")
    try:
        r, _ = timed(e, path="/f")
        assert r.status == 200 and r.body == b"slowish"
        wait_until(lambda: metric(e, 'lb_hedges_total{result="failed"}') == 1, what="the failed hedge counted")
        assert metric(e, f'lb_upstream_errors_total{{backend="{dying.url}",kind="reset"}}') == 1
        settled(e)
    finally:
        e.stop()
        slowish.close()
        dying.close()


def test_when_both_fail_the_client_gets_the_first_ones_error_and_nothing_is_left_held():
    a = Delayed("a", lambda n: 0.2, close_instead=True)
    b = Delayed("b", lambda n: 0.1, close_instead=True)
    e = edge_for([a, b], "--hedge-after", "0.05", "--max-requests", "10", "--retry-on", "connect,reset")
    try:
        r, _ = timed(e, path="/both")
        assert r.status == 502
        assert metric(e, 'lb_hedges_total{result="failed"}') == 1
        assert a.got == ["GET"] and b.got == ["GET"]     # the hedge was a try: no retry on its backend
        s = settled(e)
        assert s["breaker"]["in_flight"] == 0
    finally:
        e.stop()
        a.close()
        b.close()


def test_under_concurrency_every_hedge_gives_back_what_it_held():
    """Races decided every way at once (either side first, by a hair, or both slow): afterwards no
    in-flight count, retry slot, breaker place or file descriptor is left held."""
    import random
    rng = random.Random(28)
    pool = [Delayed(f"b{k}", lambda n: rng.choice((0.0, 0.0, 0.0, 0.02, 0.03, 0.2))) for k in range(3)]
    e = edge_for(pool, "--hedge-after", "0.02", "--max-requests", "200", "--retry-budget-min", "50")
    try:
        bad = []

        def client(c, burst):
            for i in range(25):
                r, _ = timed(e, path=f"/c{burst}-{c}-{i}")   # each body checked to answer its own request
                if r.status != 200:
                    bad.append(r.status)

        def burst(n):
            ts = [threading.Thread(target=client, args=(c, n)) for c in range(12)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
            assert not bad, bad
            return settled(e)
        s = burst(1)
        assert s["breaker"]["in_flight"] == 0 and s["hedge"]["sent"] > 10, s["hedge"]
        fds = metric(e, "process_open_fds")      # the pool's idle connections are open now
        s = burst(2)
        assert s["breaker"]["in_flight"] == 0 and s["hedge"]["sent"] > 20, s["hedge"]
        # As many hedges again, and no descriptor more than the pool's connections grown by a new peak.
        assert metric(e, "process_open_fds") <= fds + 12, (fds, metric(e, "process_open_fds"))
    finally:
        e.stop()
        for b in pool:
            b.close()


def test_a_per_try_timeout_shorter_than_the_hedge_delay_decides_first(pair):
    _, fast = pair
    slow = Delayed("slow", lambda n: 4.0)     # far beyond both: a stalled machine cannot make it answer in time
    e = edge_for([slow, fast], "--hedge-after", "2", "--per-try-timeout", "0.3", "--retry-on", "timeout,connect")
    try:
        r, t = timed(e, path="/t")           # round-robin: the slow one first
        assert r.status == 200 and r.body == b"fast"
        assert status(e)["hedge"]["sent"] == 0                      # retried at 0.3 s, not hedged at 2 s
        assert metric(e, 'lb_retries_by_condition_total{condition="timeout"}') == 1
    finally:
        e.stop()
        slow.close()


def test_hedge_after_is_a_setting(tmp_path):
    from lb.config import load as config
    assert config.load(["--backends", "http://127.0.0.1:1"]).hedge_after == 0.0
    assert config.load(["--backends", "http://127.0.0.1:1", "--hedge-after", "0.05"]).hedge_after == 0.05
    f = tmp_path / "edge.toml"
    f.write_text('[[backends]]\nurl = "http://127.0.0.1:1"\n[upstream]\nhedge_after = 0.2\n')
    assert config.load(["--config", str(f)]).hedge_after == 0.2
    f.write_text('[[backends]]\nurl = "http://127.0.0.1:1"\n[upstream]\nhedge_after = -1\n')
    with pytest.raises(config.ConfigError, match="upstream.hedge_after"):
        config.load(["--config", str(f)])
