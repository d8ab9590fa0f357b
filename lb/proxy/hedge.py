"""Hedged requests (--hedge-after S, Envoy's hedge_policy, "The Tail at Scale"): a try with no response
head after S seconds is also sent to another backend; the first complete head wins and the other exchange
is abandoned -- its connection closed, never pooled with a response still on it.

Only what may safely arrive twice is hedged: an idempotent method (lb/upstream/retrypolicy.py's), a body
the edge holds whole in memory (none, or a small one), no upgrade, on the request's first try, before any
byte of the response reached the client (nothing has: the race is over before relay() begins). A hedge is
a retry for the pool's accounting: it takes a slot of the retry budget (lb/upstream/retrybudget.py), so an
overloaded pool is not doubled, and a place under the circuit breaker's max_requests; both are given back
as soon as the loser's connection is closed. A pool with nobody else in rotation, or whose other pick has
every connection busy, is not hedged.

How the race runs without a thread per request: lb/proxy/tries.py's attempt() calls `wait(ur)` after the request was
sent and before it reads the head. The request's own thread polls its backend socket for S; a head that
starts arriving in time ends the wait (the common case costs one poll). Past S the hedge's try runs on a
thread of its own (the same attempt(), on the other backend), and both sides read their socket into its
buffer until a whole head is there; the first to have one claims the race, and a byte on a pipe both
watch tells the other to give up (an UpstreamError of kind "hedged" out of its wait: attempt() closes its
connection as for any failure). Neither thread ever touches the other's socket.

Accounting, exact on every path: the request's own in-flight count (x.counted, lb/proxy/forward.py) moves
to the hedge's backend when the hedge wins; a hedge that loses or fails gives back its own count, budget
slot and breaker place on its thread. Metrics: lb_hedges_total{result="won|lost|failed"} (sent = their
sum), lb_hedges_skipped_total{reason="budget|max_requests"}; the abandoned exchange counts as a request to
its backend (lb_requests_total), a failed one also as its error. The access log line ends with
`hedge=won|lost|failed other=URL` (JSON: "hedge": {"result", "other"}): won -- the hedge's backend (the
line's upstream) answered; lost -- the first backend answered and the hedge to `other` was abandoned.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
from time import monotonic
from typing import TYPE_CHECKING, Any

from lb.http.framing import UpstreamError
from lb.logs import ClientFaults
from lb.proxy.tries import attempt as try_once
from lb.upstream.retrypolicy import REPLAYABLE_METHODS

if TYPE_CHECKING:
    from lb.upstream.backends import Backend
    from lb.upstream.breaker import Breaker

log = logging.getLogger("edge")
hedge_log = ClientFaults(log, what="hedge failures")  # one WARNING per window under an outage, then a count

RESULTS = ("won", "lost", "failed")


def eligible(x, body) -> bool:
    """May this request be hedged at all (the configuration aside)? bytes: the body is small and whole
    (lb/proxy/edge.py reads a large one into a SpooledBody, or streams it). A request without Host
    (HTTP/1.0) would need another head per backend: not hedged."""
    req = x.req
    return type(body) is bytes and req.method in REPLAYABLE_METHODS and x.upgrade is None and bool(req.host)


def attempt(fw, x, backend, head: bytes | bytearray, body: bytes):
    """tries.attempt(cfg, x, backend, head, body), hedged after cfg.hedge_after: (conn, rh, ur, backend that
    answered). Raises UpstreamFailed as attempt() does when no side got a head (the first backend's
    failure, so forward()'s retry policy sees the try it made)."""
    race = Race(fw, x, backend, head, body, fw.edge.cfg.hedge_after)
    try:
        return race.run()
    except BaseException:
        race.abandon()  # whatever ended the first try, a hedge still out must not win for nobody
        raise
    finally:
        race.leave()


class _Try:
    """What attempt() reads and writes of an Exchange, for the hedge's try: the request, and its own
    upstream_status (the request's is the winner's, set once the race is decided)."""

    __slots__ = ("req", "upstream_status", "upstream_sock", "abandoned")

    def __init__(self, req):
        self.req, self.upstream_status = req, None
        self.upstream_sock, self.abandoned = None, False  # a reset frees the first try's backend only


class _Failed:
    """A hedge's failure that was no UpstreamFailed (a bug's exception): what hedge_over() reads."""

    def __init__(self, kind: str, detail: str):
        self.kind, self.detail = kind, detail


class Race:
    def __init__(self, fw, x, backend, head, body, after: float):
        self.fw, self.x, self.first, self.head, self.body = fw, x, backend, head, body
        self.after = after
        # What fire() makes is None until then: once self.fired, other, done, lock and pipe are set.
        self.started: float | None = None  # when the first try's request was sent (its first wait)
        self.fired = False  # the hedge was sent
        self.other: Backend | None = None  # the hedge's backend
        self.winner: str | None = None  # "first" | "hedge", once a side claimed the race
        self.result: tuple | None = None  # the hedge's (conn, rh, ur) when it won
        self.failure: Any = None  # the hedge's UpstreamFailed (or _Failed), when it failed: .kind, .detail
        self.done: threading.Event | None = None  # the hedge's thread is over (made when it starts)
        self.lock: threading.Lock | None = None  # made with the hedge: a request never hedged pays for neither
        self.pipe: tuple[int, int] | None = None  # (r, w): a byte on it once somebody claimed the race
        self.users = 1  # who still needs the pipe (this request; the hedge's thread)
        self.slot = False  # a retry budget slot and a breaker place are held for the hedge
        self.breaker: Breaker | None = None
        self.taken = False  # the hedge's winning exchange became the request's (hedge_won)

    # -- the request's own thread -------------------------------------------------------------------

    def run(self):
        fw, x = self.fw, self.x
        try:
            conn, rh, ur = try_once(fw.edge.cfg, x, self.first, self.head, self.body, wait=self.wait_first)
        except Exception as f:  # UpstreamFailed (forward's); anything else is not ours to judge
            if not self.fired or getattr(f, "kind", None) is None:
                raise
            if f.kind != "hedged":
                self.done.wait()  # the first failed: the hedge may still answer (its own timeouts bound it)
                if self.winner != "hedge":
                    x.hedge = ("failed", self.other.url)
                    f.also_tried = (self.other,)  # a retry (--retry-on) goes to a third backend
                    raise  # both failed: forward() answers (or retries) the first's failure
            self.first_abandoned(None if f.kind == "hedged" else f)
            return self.hedge_won()
        if self.fired:
            if not self.claim("first"):
                # The hedge's head came complete in the moment between ours and this claim: it wins.
                self.first.pool.release(conn, False)
                self.first_abandoned(None)
                return self.hedge_won()
            # The hedge's thread counts itself and gives its slot back once its connection is closed.
            x.hedge = ("failed" if self.failure is not None else "lost", self.other.url)
        return conn, rh, ur, self.first

    def wait_first(self, ur) -> None:
        """attempt()'s wait on the first backend: S for a head to begin, then the hedge, then the race."""
        now = monotonic()
        if self.started is None:
            self.started = now
        if not self.fired:
            if ur.buf or _pending(ur.sock):
                return
            left = self.started + self.after - now
            if ur.timeout is not None and ur.timeout <= left:
                return  # a per-try (or read) timeout shorter than the hedge's delay decides first
            if left > 0 and _poll_one(ur.sock, left):
                return  # the head is arriving: no hedge (the common case)
            if not self.fire():
                return
        self.race(ur, "first", self.started)

    def hedge_won(self):
        """The hedge's exchange is the request's now: its in-flight count, its backend, its status."""
        x, other = self.x, self.other
        self.taken = True
        # The request's in-flight count moves (forward.py's uncount() takes back x.counted's at the end):
        # the first's back now, the one the hedge's thread took for the other becomes the request's.
        first, x.counted = x.counted, other
        if first is not None:
            with first.lock:
                first.inflight -= 1
        x.backend = other
        if x.set_cookie:  # sticky: the client is pinned to whoever answers, as after a retry
            x.set_cookie = b"Set-Cookie: route=" + other.route.encode() + b"; Path=/; HttpOnly\r\n"
        conn, rh, ur = self.result
        x.upstream_status = rh.status
        x.hedge = ("won", self.first.url)
        self.fw.edge.metrics.inc("lb_hedges_total", result="won")
        self.give_back()  # the first's connection is closed: the pool carries one again
        return conn, rh, ur, other

    def abandon(self) -> None:
        """The request gives up on the race (its first try raised): a hedge still out loses now and
        cleans up on its thread; one that had won but was not taken is closed and given back here."""
        if not self.fired or self.claim("nobody"):
            return
        if self.winner == "hedge" and not self.taken:
            other, result = self.other, self.result
            assert other is not None and result is not None  # fired, then the hedge's claim() set its result
            self.taken = True
            other.pool.release(result[0], False)
            with other.lock:
                other.inflight -= 1
            self.give_back()

    def first_abandoned(self, failure) -> None:
        """The first try lost the race (its connection already closed): a request its backend got;
        if it had failed on its own, passive health and the error counters hear of it too."""
        m = self.fw.edge.metrics
        if failure is None:
            m.inc("lb_requests_total", backend=self.first.url)
            return
        if failure.kind not in ("pool", "gone"):
            self.fw.observe(self.first, False, failure.detail)
        m.inc("lb_requests_total", backend=self.first.url)
        m.inc("lb_upstream_errors_total", backend=self.first.url, kind=failure.kind)

    # -- sending the hedge --------------------------------------------------------------------------

    def fire(self) -> bool:
        """Pick another backend and send it the request on a thread of its own: False when the pool
        has nobody else to ask, or the retry budget or the breaker says no."""
        edge = self.fw.edge
        pool = self.first.cluster or edge.pool  # the hedge stays in the first try's pool (lb/upstream/pools.py)
        budget, breaker = edge.retry_budget, pool.breaker
        # The caps first (a look, no lock): a hedge they refuse takes nobody's round-robin turn.
        if budget.retrying >= budget.allowed():
            edge.metrics.inc("lb_hedges_skipped_total", reason="budget")
            return False
        if breaker.max_requests and breaker.requests >= breaker.max_requests:
            edge.metrics.inc("lb_hedges_skipped_total", reason="max_requests")
            return False
        other = pool.balancer.pick(exclude=[self.first], turn=False)
        if other is None or other is self.first or other.pool_full():
            return False
        try:
            pipe = os.pipe()
        except OSError:  # out of descriptors: the first try goes on alone (never its failure)
            return False
        if breaker.max_requests:
            if not breaker.enter(count=False):
                edge.metrics.inc("lb_hedges_skipped_total", reason="max_requests")
                _close(pipe)
                return False
            self.breaker = breaker
        if not budget.try_retry(False):  # taken by another request since the look above
            if self.breaker is not None:
                self.breaker.leave()
                self.breaker = None
            edge.metrics.inc("lb_hedges_skipped_total", reason="budget")
            _close(pipe)
            return False
        self.slot = True
        self.lock = threading.Lock()
        self.done = threading.Event()
        os.set_blocking(pipe[1], False)
        self.pipe = pipe
        self.other = other
        self.fired = True
        with other.lock:
            other.inflight += 1  # the hedge loads its backend (least-request, the drain) from now
        self.users += 1
        try:
            threading.Thread(target=self._hedge, daemon=True, name="hedge").start()
        except RuntimeError:  # no thread to be had: the first try goes on alone
            self.users -= 1
            self.fired = False
            with other.lock:
                other.inflight -= 1
            self.give_back()
            return False
        return True

    def _hedge(self) -> None:
        other, done, won = self.other, self.done, False
        assert other is not None and done is not None  # this thread is fire()'s, started once both were set
        t = _Try(self.x.req)
        try:
            conn, rh, ur = try_once(self.fw.edge.cfg, t, other, self.head, self.body, wait=self.wait_hedge)
        except Exception as f:  # forward.py's UpstreamFailed (kind, detail); never a dead thread
            kind = getattr(f, "kind", None)  # with the accounting held
            if kind is None:
                log.error("hedge to backend %s: %r", other.url, f)
                self.failure = _Failed("protocol", repr(f))
            elif kind != "hedged":
                self.failure = f
        else:
            if self.claim("hedge", (conn, rh, ur)):
                won = True
            else:
                other.pool.release(conn, False)  # lost by a hair: closed, its response never read
        finally:
            try:
                if not won:
                    self.hedge_over()
            finally:
                done.set()
                self.leave()

    def wait_hedge(self, ur) -> None:
        self.race(ur, "hedge", monotonic())

    def hedge_over(self) -> None:
        """The hedge lost or failed: its count, its budget slot and breaker place back; counted."""
        other, m, f = self.other, self.fw.edge.metrics, self.failure
        assert other is not None  # only a hedge that was sent is over
        with other.lock:
            other.inflight -= 1
        self.give_back()
        m.inc("lb_requests_total", backend=other.url)
        if f is None:
            m.inc("lb_hedges_total", result="lost")
            return
        m.inc("lb_hedges_total", result="failed")
        if f.kind not in ("pool", "gone"):
            self.fw.observe(other, False, f.detail)
            m.inc("lb_upstream_errors_total", backend=other.url, kind=f.kind)
        hedge_log(
            "hedge to backend %s %s: %s %s (%s)",
            other.url,
            f.kind,
            self.x.req.method.decode(),
            self.x.req.target[:200].decode("latin-1"),
            f.detail,
        )

    # -- the race -----------------------------------------------------------------------------------

    def race(self, ur, me: str, sent: float) -> None:
        """Read this side's backend into ur.buf until a whole head is there (then attempt() parses it
        without waiting) or the other side claimed the race (raise: attempt() closes this connection).
        Bounded by ur.timeout from when this side's request was sent (so a per-try timeout means the
        same hedged or not) and by ur.deadline."""
        sock = ur.sock
        assert self.pipe is not None  # a race is run only once fire() sent the hedge
        wake = self.pipe[0]
        p = select.poll()
        p.register(sock, select.POLLIN)
        p.register(wake, select.POLLIN)
        limit = sent + (ur.timeout if ur.timeout is not None else 3600.0)
        if ur.deadline is not None and ur.deadline < limit:
            limit = ur.deadline
        while True:
            if self.winner is not None and self.winner != me:
                raise UpstreamError("hedged", "the other backend answered first")
            if ur.buf.find(b"\r\n\r\n") >= 0:
                return
            if _pending(sock):
                if not ur.fill():
                    return  # closed: attempt() sees what it sees (a reset)
                continue
            left = limit - monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            readable = False
            for fd, _ in p.poll(left * 1000):
                if fd != wake:
                    readable = True
            if readable and not ur.fill():
                return

    def claim(self, me: str, result=None) -> bool:
        """The first to claim wins; the other side is woken to give up."""
        lock, pipe = self.lock, self.pipe
        assert lock is not None and pipe is not None  # claimed only once the hedge was sent
        with lock:
            if self.winner is not None:
                return False
            self.winner = me
            self.result = result
            try:
                os.write(pipe[1], b"x")
            except OSError:
                pass
            return True

    def give_back(self) -> None:
        """The loser's connection is closed: the budget slot and the breaker place go back, once."""
        assert self.lock is not None  # given back only once the hedge was sent
        with self.lock:
            if not self.slot:
                return
            self.slot = False
            breaker, self.breaker = self.breaker, None
        self.fw.edge.retry_budget.give_back()
        if breaker is not None:
            breaker.leave()

    def leave(self) -> None:
        if self.lock is None:
            return  # never hedged: nothing to close
        with self.lock:
            self.users -= 1
            close = self.users == 0 and self.pipe is not None
        if close:
            _close(self.pipe)


def _close(pipe) -> None:
    os.close(pipe[0])
    os.close(pipe[1])


def _pending(sock) -> bool:
    """A TLS record already decrypted is readable though poll() says nothing."""
    pending = getattr(sock, "pending", None)
    return bool(pending and pending())


def _poll_one(sock, seconds: float) -> bool:
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(seconds * 1000))


def status(cfg, metrics) -> dict:
    """/status: the setting and this process's hedges by result (sent = their sum), and those skipped."""
    results = metrics.by_label("lb_hedges_total", "result")
    by = {r: results.get(r, 0) for r in RESULTS}
    return {
        "after": cfg.hedge_after,
        "sent": sum(by.values()),
        "won": by["won"],
        "by_result": by,
        "skipped": metrics.by_label("lb_hedges_skipped_total", "reason"),
    }
