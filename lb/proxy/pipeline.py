"""The stages every request goes through, whatever protocol brought it (Envoy's filter chain, in order):

    identify   the request id, the client's address (X-Forwarded-For from a trusted proxy), the size cap
    limit      the rate-limit stage (lb/limiting/stage.py): a verdict, its headers, delay mode's hold
    choose     the pool's circuit breaker, then a backend (sticky route, round robin, max_conns)
    forward    the body (read only now), then lb/proxy/forward.py: tries, retries, the response relayed
    record     the access-log line and the counts (Edge.record, once per request)

Pipeline.run(x, conn, down, body) runs them for an Exchange x (x.req: an lb.http.framing.Request) on a
client connection (lb/proxy/conn.py) whose responses go to `down` (lb/proxy/downstream.py). HTTP/1.1's
connection loop (Edge) and HTTP/2's stream workers both call it; each stage is one method, so a new one
(routes, hedging) is one call here.

Stage order (and why): a bad frame spends no token; a rejected request costs no backend capacity and
takes no round-robin turn; a request that finds nobody healthy has still spent its token, so hammering a
failing pool is not free.
"""

from __future__ import annotations

import math
import os
import random
import re
from time import monotonic

from lb.errors import ClientGone, HttpError
from lb.limiting.identity import Identifier
from lb.limiting.stage import release as release_slots
from lb.logs import client_fault
from lb.proxy import tunnel
from lb.proxy.downstream import NotBuffered
from lb.proxy.spool import SpooledBody


class Pipeline:
    """The stages over one Edge (its configuration, balancer, limiter, metrics: read per call, so a reload
    applies from the next request on)."""

    def __init__(self, edge):
        self.edge = edge

    def run(self, x, conn, down, body=None) -> bool:
        """Serve x; True when the client connection may carry another (HTTP/2 ignores it).
        body: the request body when the codec has it already (bytes, SpooledBody or an iterator of
        pieces); None: the downstream reads it (down.read_body) once a backend is chosen."""
        edge = self.edge
        req = x.req
        has_body = req.chunked or bool(req.content_length)
        # After an early answer, an unread body would be read as the next request: close instead.
        keep = req.keep_alive and not has_body
        try:
            answer = self.identify(x, conn)
            if answer is None:
                answer = self.limit(x, down, keep)
                if answer is None:
                    answer = self.choose(x, keep)
                    if answer is None:
                        return self.forward(x, conn, down, body, has_body)
            status, reason, keep, counters = answer
            return self.reply(x, down, status, reason, keep, **counters)
        except ClientGone:
            if x.status is None:  # the client left before its answer was complete: nginx's 499
                edge.metrics.edge_answered(499, monotonic() - x.start)
                edge.record(x, 499)
            raise
        finally:
            if x.slots is not None:  # in-flight slots (--max-in-flight): given back on every path, here only
                release_slots(x.slots)
            if x.admitted is not None:  # the pool's circuit breaker, likewise
                x.admitted.leave()

    def reply(self, x, down, status: int, reason: str, keep: bool, **counters) -> bool:
        """An answer of the edge's own (413, 429, 503, ...): counted, then built by lb/proxy/replies.py and
        sent by the downstream. Closing while the request's body may still be arriving is a lingering close."""
        edge = self.edge
        keep = keep and not edge.closing
        edge.metrics.edge_answered(status, monotonic() - x.start, **counters)
        req = x.req
        return down.local_reply(x, status, reason, keep, linger=bool(req.chunked or req.content_length))

    # -- the stages: each returns None to go on, or (status, reason, keep, counters) to answer -------

    def identify(self, x, conn):
        """The request id (the client's when well formed, else ours: sent on to the backend, logged, and
        back to the client only when asked -- --request-id-response), and who the client is: every
        access-log line has the client, a 413 too."""
        edge = self.edge
        cfg = edge.cfg
        req = x.req
        rid = req.request_id
        if rid is None or not _REQUEST_ID.fullmatch(rid):
            x.rid_sent = rid = new_request_id()  # replaces whatever the client sent
        x.request_id = rid
        if cfg.request_id_response:
            x.rid_header = b"X-Request-Id: " + rid + b"\r\n"
        peer_ip = conn.peer_ip
        x.client_ip = edge.identifier.client_ip(peer_ip, True, req.xff) if conn.peer_trusted else peer_ip
        if req.content_length is not None and req.content_length > cfg.max_body_size:
            return 413, "request body too large", False, _NONE
        # The route (lb/proxy/routes.py), and its allow/deny here: after identify (it is the client IP as
        # identified, trusted proxies honoured), before the limit (a refused request spends no token) and
        # the choice (it takes no turn of a split or a balancer, and reaches no backend).
        router = edge.router
        if router is not None:
            route = x.route = router.match(req)
            if route is not None and route.acl and not route.admits(x.client_ip):
                edge.metrics.inc("lb_route_denied_total", route=route.name)
                return (
                    403,
                    f"forbidden (route {route.name})",
                    req.keep_alive and not (req.chunked or req.content_length),
                    _NONE,
                )
        return None

    def limit(self, x, down, keep: bool):
        """The rate-limit stage's verdict (lb/limiting/stage.py: the rules, the verdict, the headers)."""
        edge = self.edge
        limiter = edge.limiter
        if limiter is None:
            try:
                x.key = Identifier.label(x.req.api_key, x.client_ip)
            except ValueError as e:
                return 400, str(e), False, _NONE
            return None
        v = limiter.admit(x.req, x.client_ip, None, x.route.name if x.route is not None else None)
        if type(v) is tuple:  # the common verdict: (label, headers), admitted by the one limit
            x.key, x.rl = v
            edge.metrics.admitted()  # the built-in rule's
            return None
        x.key, x.key_name, x.rl, x.limited_by = v.label, v.key_name, v.headers, v.limited_by
        metrics = edge.metrics
        if v.degraded:  # the store was unreachable: its failure policy decided
            metrics.limiter_error()
        if v.rejected or v.dry or v.exempt:
            metrics.limit_outcome(v.rejected, v.dry, v.exempt, v.admitted, v.label)
        elif v.admitted:
            metrics.admitted(v.admitted)
        if v.status:
            return v.status, v.reason, keep and v.status != 400, _NONE
        x.slots = v.slots
        if v.delay and not edge.holds.hold(v.delay, limiter.max_delayed, metrics, down.hold):
            x.rl += b"Retry-After: %d\r\n" % math.ceil(v.delay)  # held requests at their cap
            return limiter.status_code, "too many requests held", keep, _NONE
        return None

    def choose(self, x, keep: bool):
        """A backend for x (a sticky route takes no round-robin turn). The pool's circuit breaker first
        (Envoy checks it as the request is about to use the cluster): a shed request takes nobody's
        round-robin turn, but has spent its token, as a 503 for "nobody healthy" has."""
        edge = self.edge
        cfg = edge.cfg
        req = x.req
        # The pool: the route's (its split's turn, lb/proxy/routes.py), else the default.
        sticky = route_cookie(req.cookie) if cfg.sticky and req.cookie else None
        route = x.route
        pool = x.pool = edge.pool if route is None else route.choose(sticky)
        if pool is None:  # none of this route's pools has anyone in rotation: this route only
            edge.metrics.inc("lb_route_unavailable_total", route=route.name)
            return 503, f"no healthy backend (route {route.name})", keep, _UNAVAILABLE
        if route is not None:
            edge.metrics.route_chosen(route.name, pool.name)
        breaker = pool.breaker
        if breaker.max_requests:
            if not breaker.enter():
                return (
                    503,
                    f"overflow: {breaker.max_requests} requests in flight to the pool (max_requests)",
                    keep,
                    _NONE,
                )
            x.admitted = breaker
        if pool.ejector.ejected:
            pool.sweep_ejections(edge.metrics)
        balancer = pool.balancer
        backend = None
        if sticky:
            backend = balancer.by_route(sticky)
        if backend is None:
            backend = balancer.pick()
            if backend is not None and backend.pool_full():
                # nginx's max_conns: a backend with every connection busy is passed over for one with a
                # free connection; when all are full the request waits in its pick's line (pool_timeout).
                # Every full one is excluded at once, so a pick that finds none takes nobody's turn (one
                # "other" at a time took the turn of one as full, and the rotation stopped rotating).
                other = balancer.pick(exclude=[b for b in balancer.backends if b.pool_full()])
                if other is not None:
                    backend = other
            if backend is not None and cfg.sticky:
                x.set_cookie = route_set_cookie(backend)
        if backend is None:
            if route is not None:
                edge.metrics.inc("lb_route_unavailable_total", route=route.name)
            return 503, "no healthy backend", keep, _UNAVAILABLE
        x.backend = backend
        x.tries = 1
        return None

    def forward(self, x, conn, down, body, has_body: bool) -> bool:
        """The body -- only now is the client invited to send it: a small one is read (and a chunked one
        validated) whole before any backend connection is taken; a larger one streams -- then the
        forwarder (lb/proxy/forward.py). An allowed upgrade (WebSocket) is forwarded with its Upgrade
        header; a 101 makes it a tunnel."""
        edge = self.edge
        req = x.req
        if req.conn_tokens and not has_body:
            x.upgrade = tunnel.requested(req, edge.cfg.upgrades)
            if x.upgrade is not None:
                return edge.forwarder.forward(x, x.backend, b"", conn, down)
        if x.backend.h2 is not None:  # an h2c:// backend: the body streams with the call (lb/http2/h2c.py)
            from lb.http2.h2c import forward as forward_h2c

            return forward_h2c(edge, x, x.backend, conn, down)
        if body is None:
            body = b""
            if has_body:
                try:
                    body = down.read_body(x)
                except NotBuffered as e:  # our disk, not the client: logged where it failed
                    return self.reply(x, down, e.status, e.reason, False)
                except HttpError as e:
                    client_fault("client %s: %d %s", conn.peer_ip, e.status, e.reason)
                    return self.reply(x, down, e.status, e.reason, False)
                except ClientGone:
                    edge.client_closed(x, reached=False)
                    raise
        if type(body) is not SpooledBody:
            return edge.forwarder.forward(x, x.backend, body, conn, down)
        try:
            return edge.forwarder.forward(x, x.backend, body, conn, down)
        finally:
            body.close()  # its memory back to the budget, its temp file gone: on every path


_NONE: dict = {}
_UNAVAILABLE = {"unavailable": True}

# A client's X-Request-Id is kept when it looks like an id (no spaces, quotes or controls; <= 128).
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:@/+=-]{1,128}")

# Request ids correlate log lines; they are no secret and guard nothing, so a per-process Mersenne
# Twister seeded from the kernel (reseeded in every forked worker) is enough. os.urandom per request was
# a getrandom() system call, which gives the GIL away: one of the ~5 system calls on the request path
# (docs/latency.md), and the only one that moved no byte.
_ids = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))


def new_request_id() -> bytes:
    return b"%032x" % _ids.getrandbits(128)


def route_cookie(cookie: bytes) -> str | None:
    """The value of the `route` cookie (sticky sessions), if the client sent one."""
    for part in cookie.split(b";"):
        name, eq, value = part.strip().partition(b"=")
        if eq and name == b"route":
            return value.decode("latin-1")
    return None


def route_set_cookie(backend) -> bytes:
    """The Set-Cookie line that pins the client to `backend` (sticky sessions): one place writes it."""
    return b"Set-Cookie: route=" + backend.route.encode() + b"; Path=/; HttpOnly\r\n"
