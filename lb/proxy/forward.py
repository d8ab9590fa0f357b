"""The forwarding stage: one request to the backends, tries and retries, and the exact answer when they fail.

  Forwarder.forward()  tries (lb/proxy/tries.py: attempt) until one gets a response head or the retry
                       policy (lb/upstream/retrypolicy.py) and budget say stop; the head then goes to the
                       tunnel (a 101 to an upgrade: lb/proxy/tunnel.py) or is relayed (lb/proxy/relay.py)
  after_failure(), after_status()   what a failed try or a 5xx the policy names leads to: another backend
                       or the answer
  failed(), client_failed()         the edge's own answers (lb/proxy/replies.py through the downstream)

Who is blamed when something breaks is decided here; the byte-level rules are lb/http/framing.py's.
"""

from __future__ import annotations

import logging
from time import monotonic, sleep

from lb.errors import ClientGone, HttpError
from lb.logs import ClientFaults, client_fault
from lb.proxy import hedge, tunnel
from lb.proxy.pipeline import route_set_cookie
from lb.proxy.relay import Relay, uncount
from lb.proxy.spool import SpooledBody
from lb.proxy.tries import UpstreamFailed, attempt, upstream_head
from lb.upstream.backends import Backend
from lb.upstream.failures import NOT_THE_BACKENDS, Failure
from lb.upstream.retrypolicy import RetryPolicy, retry_after

log = logging.getLogger("edge")
retry_log = ClientFaults(log, what="retries")  # retries past connect: one WARNING per window, then a count


class Forwarder:
    """The forwarding stage of one Edge (its cfg, metrics, access log and drain flag, read per call)."""

    def __init__(self, edge):
        self.edge = edge
        self._policy, self._policy_of = None, None
        self.relay = Relay(self).relay  # the response half: lb/proxy/relay.py

    # -- one request --------------------------------------------------------------------------------

    def forward(self, x, backend: Backend, body, conn, down) -> bool:
        """Forward x.req with its body (bytes, or an iterator when streamed) and relay the answer to `down`
        (lb/proxy/downstream.py) on the client connection `conn` (lb/proxy/conn.py).

        A try that failed to connect sent nothing, so it is retried -- any method -- on a backend in
        rotation this request has not tried, up to cfg.retries times and within the retry budget
        (lb/upstream/retrybudget.py). Any other failure is answered: a request is never sent twice once a byte
        of it was written (but for attempt()'s stale keep-alive retry, on the same backend).
        An allowed upgrade (x.upgrade, lb/proxy/tunnel.py) is forwarded with its Upgrade header; a 101 to it
        becomes a tunnel to the client (with any bytes it sent early, in conn.reader).
        True when the client connection may carry another request.
        """
        edge = self.edge
        req = x.req
        streamed = not isinstance(body, (bytes, SpooledBody))  # a spooled body is whole, like bytes
        if streamed:
            length = None if req.chunked else req.content_length
        else:
            length = len(body) if (req.chunked or req.content_length is not None) else None
        policy = self._policy if self._policy_of is edge.cfg else self.policy()
        budget = edge.retry_budget
        budget.start()
        t = None  # the tries so far (_Tries), made at the first failure
        if not backend.in_rotation:
            # Ejected (or out) since it was picked (in a burst, by the failures of those just before): pick again
            backend = self.repick(x, backend)
        x.upstream_start = monotonic()  # upstream_seconds: every try, up to the last response byte
        try:
            while True:
                cfg = edge.cfg
                head = upstream_head(x, backend, conn, cfg, length)  # this try's request head
                x.counted = backend  # uncount() takes back this count, whichever backend a retry names next
                backend.lock.acquire()  # (not `with`: half its cost; an int's increment cannot raise)
                backend.inflight += 1
                backend.lock.release()
                try:
                    try:
                        if t is None and cfg.hedge_after and hedge.eligible(x, body):
                            uc, rh, ur, backend = hedge.attempt(self, x, backend, head, body)  # lb/proxy/hedge.py
                        else:
                            uc, rh, ur = attempt(cfg, x, backend, head, body)
                    except UpstreamFailed as f:
                        t = t or _Tries()
                        nxt = self.after_failure(x, t, backend, f, policy, streamed)
                        if nxt is None:
                            # a streamed body may be half read: close, lingering
                            return self.failed(
                                down, x, f.kind, f.detail, req.keep_alive and not streamed, t.tried, linger=streamed
                            )
                        backend = nxt
                        continue
                    except HttpError as e:
                        return self.client_failed(down, x, e.status, e.reason)
                    if rh.status in policy.statuses and not rh.early:
                        t = t or _Tries()
                        nxt = self.after_status(x, t, backend, uc, rh, policy, streamed)
                        if nxt is not None:
                            backend = nxt
                            continue
                    if rh.status == 101 and x.upgrade:
                        self.observe(backend, True, "101 Switching Protocols")
                        # The handshake is over: a tunnel (open for hours) neither keeps the retry slot
                        # its handshake may hold nor counts as a request in the budget's percentage.
                        budget.end(t is not None and t.held)
                        t = _ENDED
                        return tunnel.take(edge, x, uc, rh, ur, conn, down)
                    # relay() tells passive health; an early answer to a body not sent whole leaves it half read
                    return self.relay(x, rh, ur, uc, down, not (rh.early and streamed))  # (in_sync)
                finally:
                    if x.counted is not None:  # (relay() took it back already, in the common case)
                        uncount(x)
        except ClientGone:
            if x.status is None:
                edge.client_closed(x, reached=True)
            raise
        finally:
            if t is None:
                budget.ended()  # (end(False))
            elif t is not _ENDED:
                budget.end(t.held)

    def after_failure(
        self, x, t: "_Tries", backend: Backend, f: UpstreamFailed, policy: RetryPolicy, streamed: bool
    ) -> Backend | None:
        """A try failed before a response head: the backend to try next, or None to answer f."""
        t.tried += [backend, *f.also_tried]
        kind = f.kind
        if kind is Failure.GONE and not t.regone:
            # A reload removed this backend between the pick and now: another, once (not a failure of
            # anyone's, so no retry or budget is spent on it).
            t.regone = self.balancer(backend).pick(exclude=t.tried)
            if t.regone is not None:
                x.backend = t.regone
                return t.regone
        if kind not in NOT_THE_BACKENDS:
            self.observe(backend, False, f.detail)
        # A "connect" after bytes were sent (a TLS failure past the handshake) is not one.
        if kind is Failure.CONNECT and f.sent:
            return None
        cond = policy.should_retry(kind, None, x.req.method, not streamed, False)
        if cond is None:
            return None
        nxt, budgeted, refused = self.next_try(backend, t.tried, t.held)
        f.detail += refused
        if nxt is None:
            return None
        t.held = t.held or budgeted
        self.retrying(x, backend, kind, f.detail, cond, nxt, len(t.tried))
        if cond != "connect":
            sleep(policy.backoff(len(t.tried) - 1))
        return nxt

    def after_status(
        self, x, t: "_Tries", backend: Backend, uc, rh, policy: RetryPolicy, streamed: bool
    ) -> Backend | None:
        """A 5xx the retry policy names: the head is ours alone so far (relay() has not begun), so it can
        still go elsewhere, its connection closed with the body unread. The backend to try next, or None
        to relay this answer."""
        if rh.status == 503:
            self.rest(backend, rh)
        cond = policy.should_retry("status", rh.status, x.req.method, not streamed, False)
        if cond is None:
            return None
        t.tried.append(backend)
        nxt, budgeted, _ = self.next_try(backend, t.tried, t.held)
        if nxt is None:
            return None
        backend.pool.release(uc, False)
        self.observe(backend, False, rh.status_line)
        t.held = t.held or budgeted
        self.retrying(x, backend, None, rh.status_line[9:].decode("latin-1"), cond, nxt, len(t.tried))
        sleep(policy.backoff(len(t.tried) - 1))
        return nxt

    def observe(self, backend: Backend, ok: bool, why) -> None:
        """Passive health: one request's outcome; an ejection it causes is one log line and one count.
        why: a string, or the response's status line (decoded only if it is logged)."""
        if ok and not backend.fail_run:
            return
        edge = self.edge
        pool = backend.cluster or edge.pool
        ej = pool.ejector
        duration = ej.observe(backend, ok, monotonic(), pool.balancer.backends)
        if duration:
            if isinstance(why, bytes):
                why = why[9:].decode("latin-1")
            log.warning(
                "backend %s EJECTED for %gs: %d consecutive failed requests (last: %s); ejection %d",
                backend.url,
                duration,
                ej.eject_after,
                why,
                backend.times_ejected,
            )
            edge.metrics.ejection(backend.url)

    def repick(self, x, backend: Backend) -> Backend:
        nxt = self.balancer(backend).pick()
        if nxt is None:
            return backend  # nobody else: try it anyway (it may be the one that answers)
        x.backend = nxt
        if x.set_cookie:
            x.set_cookie = route_set_cookie(nxt)
        return nxt

    def balancer(self, backend: Backend):
        """The balancer of the pool the backend is in (lb/upstream/pools.py): a retry stays in its pool."""
        return (backend.cluster or self.edge.pool).balancer

    def policy(self) -> RetryPolicy:
        """The retry policy of the current configuration (rebuilt after a reload changed it)."""
        cfg = self.edge.cfg
        if self._policy_of is not cfg:
            self._policy, self._policy_of = RetryPolicy(cfg.retry_on), cfg
        return self._policy

    def next_try(self, backend: Backend, tried: list, held: bool) -> tuple[Backend | None, bool, str]:
        """(the backend to retry on or None, whether the retry holds a budget slot, why not if refused)."""
        edge = self.edge
        if len(tried) > edge.cfg.retries:
            return None, False, ""
        nxt = self.balancer(backend).pick(exclude=tried)
        # A backend already out of rotation (ejected by this failure or by those of requests picked
        # with this one, DOWN, drained) takes no new requests: this one goes elsewhere as forward()'s
        # repick would have sent it, free of the budget. Only the requests in flight to it when it left
        # can take that path, once; a backend still in rotation pays for every retry.
        budgeted = nxt is not None and backend.in_rotation
        if budgeted and not edge.retry_budget.try_retry(held):
            b = edge.retry_budget
            return None, False, f"; retry budget exhausted: {b.retrying} retries in flight for {b.active} requests"
        return nxt, budgeted, ""

    def rest(self, backend: Backend, rh) -> None:
        """A 503 with Retry-After: the balancer leaves this backend alone that long (at most 300 s)."""
        for _, lname, value in rh.headers:
            if lname == b"retry-after":
                secs = retry_after(value)
                if secs:
                    self.balancer(backend).rest(backend, secs)
                    retry_log(
                        "backend %s answered 503 with Retry-After: %s: not picked for %gs",
                        backend.url,
                        value.decode("latin-1"),
                        secs,
                    )
                return

    def retrying(self, x, failed: Backend, kind: str | None, detail: str, cond: str, nxt: Backend, tries: int) -> None:
        """A failed try is retried elsewhere: logged and counted, not answered. kind: the failure's
        (None: the backend answered, with the status `detail` names)."""
        req = x.req
        x.tries = tries + 1
        if x.set_cookie:  # sticky: the client is pinned to whoever answers
            x.set_cookie = route_set_cookie(nxt)
        x.backend = nxt
        # A connect failure's line as always (one per request: passive health ejects the backend soon);
        # the other conditions can be every request of an outage: rate-limited, then one summary.
        say = log.warning if cond == "connect" else retry_log
        say(
            "backend %s %s: %s %s (%s); retrying on %s (try %d)",
            failed.url,
            kind or "answered",
            req.method.decode(),
            req.target[:200].decode("latin-1"),
            detail,
            nxt.url,
            tries + 1,
        )
        self.edge.metrics.try_failed(failed.url, kind, cond)

    def failed(self, down, x, kind: Failure, detail: str, keep: bool, tried=None, linger: bool = False) -> bool:
        """The backend failed before the client saw a byte: log, count, answer with kind's status (the
        edge's own reply, lb/proxy/replies.py). After retries, the line says how many tries and on which
        backends. linger: the rest of the request body may still be arriving."""
        req, backend = x.req, x.backend
        status = kind.status
        after = "" if not tried or len(tried) < 2 else f" after {len(tried)} tries: {', '.join(b.url for b in tried)}"
        log.warning(
            "backend %s %s: %s %s -> %d (%s)%s",
            backend.url,
            kind,
            req.method.decode(),
            req.target[:200].decode("latin-1"),
            status,
            detail,
            after,
        )
        self.edge.metrics.upstream_error(backend.url, kind, status, monotonic() - x.start)
        keep = keep and not self.edge.closing  # from SIGTERM on, as relay() and the pipeline say it
        return down.local_reply(x, status, kind.reason, keep, linger=linger)

    def client_failed(self, down, x, status: int, reason: str) -> bool:
        """The client's streamed body failed (bad framing, too large, too slow) after its head reached
        the backend (that connection is closed): answer, count it against the backend's requests."""
        client_fault("client %s: %d %s (request body to backend %s)", x.client_ip, status, reason, x.backend.url)
        self.edge.metrics.client_failed(x.backend.url, status, monotonic() - x.start)
        return down.local_reply(x, status, reason, False, linger=True)

    # -- relaying the response ------------------------------------------------------------------------


class _Tries:
    """One request's tries once one failed: the backends tried, whether it holds a retry slot of the
    budget, the backend picked again after a reload closed the first one's pool."""

    __slots__ = ("tried", "held", "regone")

    def __init__(self):
        self.tried: list = []
        self.held = False
        self.regone = None


_ENDED = _Tries()  # forward()'s mark: the budget was already told this request ended (a tunnel began)
