"""The proxy: a threaded server, one thread per client connection, HTTP/1.1 keep-alive on both sides.

Per request: read and check the head -> (identify, rate limit: the composed edge) -> choose a backend
-> read the body -> forward on a pooled connection and relay the response as it arrives (lb/proxy/forward.py)
-> record.

The per-request path is budgeted: the request head and a small body leave in one sendall, the response
head and a small body return in one sendall, and nothing is formatted for logging unless something
failed. Connections come from urllib3's pool (limits, connect timeout, idle expiry: lb/upstream/backends.py);
the bytes on them are ours (lb/http/framing.py), so nothing is added or reordered on the way.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import random
import re
import select
import socket
import tempfile
import ssl
import time
import socketserver
import threading
from itertools import chain
from time import monotonic

from lb import netaddr
from lb.http import gate, tls
from lb.proxy import tunnel
from lb.logs import client_fault
from lb.proxy.forward import SMALL_BODY, Forwarder
from lb.proxy.spool import Budget, Spool, SpooledBody
from lb.limiting.identity import Identifier
from lb.limiting.rules import configured_subjects
from lb.upstream.outlier import Ejector
from lb.limiting.stage import Holds
from lb.limiting.stage import release as release_slots
from lb.upstream.breaker import Breaker
from lb.upstream.retrybudget import RetryBudget
from lb.http.framing import (ClientGone, HttpError, Reader, Request, body_deadline, iter_chunked, iter_fixed, linger,
                     own_response, parse_request, send, send_timeout)

log = logging.getLogger("edge")

ACCEPT_BACKOFF = 0.1      # seconds between accepts while out of descriptors or memory
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


# ------------------------------------------------------------------------------------------- server

def _watch_while_held(sock: socket.socket, delay: float) -> None:
    """Delay mode's wait, watching the client (nginx's ngx_http_test_reading during limit_req's delay): a
    client that closes or resets while held raises ClientGone (a 499), so its request never reaches a
    backend. Bytes from it (a pipelined request, a TLS record) cannot say that: the rest is slept."""
    end = monotonic() + delay
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    while (left := end - monotonic()) > 0:
        if not poller.poll(left * 1000):
            return
        try:
            if socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                raise ClientGone()
        except BlockingIOError:
            continue
        except OSError:
            raise ClientGone() from None
        time.sleep(max(0.0, end - monotonic()))
        return


class EdgeServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """ThreadingHTTPServer's model (thread per connection, daemon threads) without http.server's parsing.

    Concurrent connections are capped. At the cap a new connection closes the longest-idle keep-alive
    one (between requests: nginx's "reusing connections") and takes its place; only when none is idle
    does it get a 503, closed at once, so an attack costs us a socket for a moment, never a thread.
    """

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    # The listen backlog (the kernel caps it at net.core.somaxconn): a burst of connections waits here for
    # the accept loop. A full queue drops the client's handshake ACK, and its request waits for a resend (1 s+).
    request_queue_size = 4096

    def __init__(self, addr, edge: "Edge"):
        self.edge = edge
        self.active = 0
        self._active_lock = threading.Lock()
        # Connections closed to make room whose threads have not ended yet: their slot is already the
        # new connection's, so the cap counts active - len(evicted) (shutdown_request removes them).
        self.evicted: set = set()
        self.address_family = netaddr.family(addr[0])
        self._fd_warned = 0.0
        n = getattr(edge.cfg, "running_threads", 0)
        gate.install(gate.Gate(n) if n > 0 else None)
        super().__init__(addr, None)

    def server_bind(self):
        netaddr.bind_options(self.socket, self.server_address[0])
        super().server_bind()

    def get_request(self):
        try:
            return self.socket.accept()
        except OSError as e:
            if e.errno in _OUT_OF_RESOURCES:
                # The listener stays readable while the backlog holds connections we cannot take:
                # without a pause serve_forever would spin on accept. Back off; they wait in the backlog.
                now = monotonic()
                if now - self._fd_warned > 10.0:
                    self._fd_warned = now
                    log.error("accept: %s; pausing accepts (%d connections open)", e.strerror, self.active)
                time.sleep(ACCEPT_BACKOFF)
            raise

    def process_request(self, request, client_address):
        with self._active_lock:
            full = self.active - len(self.evicted) >= self.edge.cfg.max_connections
            if full:
                victim = self.edge.evict_idle()
                if victim is not None:
                    self.evicted.add(victim)
                    self.edge.idle_closed += 1
                    full = False
            if not full:
                self.active += 1
        if full:
            self.edge.refused_connections += 1
            # Never block the accept loop: send what fits, half-close, drain what already arrived
            # (closing with unread bytes sends a RST that can overtake the 503), then close.
            try:
                request.setblocking(False)
                request.send(own_response(503, "too many connections", close=True))
                request.shutdown(socket.SHUT_WR)
                while request.recv(65536):
                    pass
            except OSError:
                pass
            request.close()
            return
        # A thread that cannot start raises here, and socketserver then calls shutdown_request(), which
        # takes the connection off the count: once, there.
        super().process_request(request, client_address)

    def finish_request(self, request, client_address):
        g = gate.current          # at most --running-threads connection threads at work at once (lb/http/gate.py)
        if g is not None:
            g.join()
        try:
            self.edge.serve_connection(request, client_address)
        finally:
            if g is not None:
                g.part()

    def shutdown_request(self, request):
        super().shutdown_request(request)
        with self._active_lock:
            self.active -= 1
            self.evicted.discard(request)

    def handle_error(self, request, client_address):
        log.exception("connection from %s: unexpected error", client_address[0])


# ------------------------------------------------------------------------------------------- the edge

class Edge:
    """The request pipeline over one configuration. serve_connection runs on each client's thread."""

    def __init__(self, cfg, balancer, metrics, limiter=None, identifier=None, access_log=None,
                 ejector=None, retry_budget=None, breaker=None):
        self.cfg = cfg
        self.balancer = balancer
        self.metrics = metrics
        self.limiter = limiter              # LimitStage, or None when limiting is off
        self.identifier = identifier or Identifier()
        self.access_log = access_log        # AccessLog, or None
        self.ejector = ejector or Ejector(0)          # passive health (lb/upstream/outlier.py)
        self.retry_budget = retry_budget or RetryBudget()
        self.breaker = breaker or Breaker()           # the pool's circuit breaker (lb/upstream/breaker.py)
        self.refused_connections = 0
        self.idle_closed = 0                # idle keep-alive connections closed to make room at the cap
        self.draining = False               # set after SIGTERM's grace: finish what is in flight, take nothing new
        self.closing = False                # set on SIGTERM itself: every response says Connection: close
        self.conns: dict[socket.socket, bool] = {}   # client socket -> inside a request (for the drain)
        # Keep-alive connections between requests (after one at least): socket -> (idle since, the
        # accepted socket EdgeServer counts), the ones a new connection at the cap may close.
        self.idle: dict[socket.socket, tuple[float, socket.socket]] = {}
        self.forwarder = Forwarder(self)     # the upstream half: lb/proxy/forward.py
        self.buffers = Budget()             # memory of every request and response buffer (lb/proxy/spool.py)
        self.tls = None                     # ssl.SSLContext when the listener speaks HTTPS (swapped on reload)
        self.tunnels: dict = {}             # client socket -> backend socket, while upgraded (for the drain)
        self.holds = Holds()                # requests held by delay mode (--max-delay) now

    # -- the connection loop ------------------------------------------------------------------------

    def serve_connection(self, sock: socket.socket, addr) -> None:
        cfg = self.cfg
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer_ip = netaddr.client_ip(addr[0])
        ctx = self.tls
        if ctx is None:
            return self._serve(sock, peer_ip, False)
        tsock, why = tls.accept(ctx, sock, monotonic() + cfg.header_timeout)
        if tsock is None:
            self.metrics.tls_failed()
            if why == "plain-http":
                # nginx's 497: plain HTTP on the HTTPS port gets a plain-text 400, then the close.
                self._refuse(sock, 400, "plain HTTP request sent to the HTTPS port", peer_ip)
                linger(sock, 1.0)
            else:
                client_fault("client %s: %s", peer_ip, why)
            return
        cert = tls.client_cert(tsock) if ctx.verify_mode != ssl.CERT_NONE else None
        if ctx.verify_mode != ssl.CERT_NONE:
            subject = cert.subject.lower() if cert is not None else None
            self.metrics.tls_client_cert(cert is not None,
                                         subject if subject in configured_subjects(cfg.rules) else None)
        try:
            self._serve(tsock, peer_ip, True, sock, cert)
        finally:
            tls.close(tsock)   # wrapping detached the TCP socket: closing it is ours now

    def _serve(self, sock: socket.socket, peer_ip: str, over_tls: bool, accepted=None, cert=None) -> None:
        send_timeout(sock, self.cfg.send_timeout)
        reader = Reader(sock, self.cfg.send_timeout)    # (the send bound matters to a TLS socket only)
        reader.new_work = True                          # (lb/http/gate.py: new requests wait behind those under way)
        peer = peer_ip.encode()
        identifier = None
        conns = self.conns
        # Busy until its first request is answered: a drain waits for a connection it accepted (the last of
        # its accept queue, say) rather than closing it under a client about to send (wake_idle)
        conns[sock] = True
        idle = self.idle
        accepted = accepted or sock
        # A new connection has header_timeout for its whole first head, silence included; a kept-alive
        # one may idle keepalive_timeout between requests.
        first = monotonic() + self.cfg.header_timeout
        check_tls = not over_tls
        try:
            while True:                        # from SIGTERM on, handle() says close after each response
                cfg = self.cfg                 # a reload applies from the next request on
                reader.deadline = first or None
                try:
                    if not reader.buf:
                        reader.timeout = None if first else cfg.keepalive_timeout
                        if not reader.fill():
                            return
                    if check_tls:
                        check_tls = False
                        if reader.buf[0] == tls.HANDSHAKE:
                            client_fault("client %s: TLS handshake sent to a plain-HTTP port; closed", peer_ip)
                            return
                    conns[sock] = True
                    idle.pop(sock, None)
                    reader.timeout = None
                    reader.deadline = first or monotonic() + cfg.header_timeout
                    first = 0.0
                    reader.mark = reader.got - len(reader.buf)   # where this request's bytes begin
                    head = reader.read_head()
                    if head is None:
                        return
                    req = parse_request(head)
                    req.client_cert = cert      # the connection's verified certificate (lb/http/tls.py), or None
                    if identifier is not self.identifier:   # trust: once per connection and per reload
                        identifier = self.identifier
                        peer_trusted = identifier.trusted(peer_ip)
                except HttpError as e:
                    self._refuse(sock, e.status, e.reason, peer_ip)
                    return
                except socket.timeout:
                    if reader.buf:
                        self._refuse(sock, 408, "request head not received in time", peer_ip)
                    return
                except OSError:
                    return
                try:
                    if not self.handle(req, reader, sock, peer, peer_trusted, peer_ip, over_tls):
                        return
                except ClientGone:
                    return
                conns[sock] = False
                idle[sock] = (monotonic(), accepted)
        finally:
            conns.pop(sock, None)
            idle.pop(sock, None)

    def sweep_ejections(self) -> None:
        """Ejected backends whose time is up return to the rotation: one log line and a count each."""
        for b in self.ejector.sweep(self.balancer.backends, monotonic()):
            log.warning("backend %s returns from ejection (ejected %d times)%s", b.url, b.times_ejected,
                        "" if b.in_rotation else f"; still out: {b.state}")
            self.metrics.ejection(b.url, returned=True)

    def wake_idle(self) -> int:
        """Draining: end the connections waiting between requests (a busy one ends after its response)."""
        n = 0
        for sock, busy in list(self.conns.items()):
            if not busy:
                try:
                    # the blocked recv returns b"" and the thread exits; socket.socket's own shutdown,
                    # because an SSLSocket's would drop its TLS state under the reading thread
                    socket.socket.shutdown(sock, socket.SHUT_RD)
                    n += 1
                except OSError:
                    pass
        return n

    def evict_idle(self):
        """At the connection cap: close the keep-alive connection idle longest (its thread, blocked in
        recv, sees EOF and ends, as in wake_idle) and return its accepted socket, or None if none is
        idle. A request that arrived just before is still read and answered, then the connection
        closes: the client sees a clean close, never half a response."""
        idle = self.idle
        while idle:
            try:
                sock, (_, accepted) = min(list(idle.items()), key=_since)
            except ValueError:        # emptied by the connections' own threads meanwhile
                return None
            if idle.pop(sock, None) is None:
                continue              # it went busy (or ended) just now: the next one
            try:
                socket.socket.shutdown(sock, socket.SHUT_RD)
            except OSError:
                continue              # already closed: its slot frees itself
            return accepted
        return None

    def busy(self) -> int:
        return sum(1 for b in list(self.conns.values()) if b)

    def _refuse(self, sock, status: int, reason: str, peer_ip: str) -> None:
        """Answer a request we could not read, then the caller closes: framing is lost."""
        client_fault("client %s: %d %s", peer_ip, status, reason)
        self.metrics.edge_answered(status, 0.0)
        rid = new_request_id()
        access_log = self.access_log       # once: a reload may turn it off between two reads
        if access_log is not None:
            access_log.refusal(peer_ip, status, reason, request_id=rid.decode())
        try:
            extra = b"X-Request-Id: " + rid + b"\r\n" if self.cfg.request_id_response else b""
            sock.sendall(own_response(status, reason, close=True, extra=extra))
        except OSError:
            pass

    # -- one request ----------------------------------------------------------------------------------

    def handle(self, req: Request, reader: Reader, sock: socket.socket, peer: bytes,
               peer_trusted: bool = False, peer_ip: str = "", over_tls: bool = False) -> bool:
        """Serve one request; True when the client connection may carry another.

        Stage order (and why): a bad frame spends no token; a rejected request costs no backend
        capacity and takes no round-robin turn; a request that finds nobody healthy has still spent
        its token, so hammering a failing pool is not free.
        """
        x = Exchange(req, monotonic(), b"https" if over_tls else b"http")
        x.reader = reader
        try:
            return self._handle(x, req, reader, sock, peer, peer_trusted, peer_ip)
        except ClientGone:
            if x.status is None:     # the client left before its answer was complete: nginx's 499
                self.metrics.edge_answered(499, monotonic() - x.start)
                self._done(x, 499)
            raise
        finally:
            if x.slots is not None:  # in-flight slots (--max-in-flight): given back on every path, here only
                release_slots(x.slots)
            if x.admitted is not None:   # the pool's circuit breaker, likewise
                x.admitted.leave()

    def _handle(self, x: "Exchange", req: Request, reader: Reader, sock: socket.socket, peer: bytes,
                peer_trusted: bool, peer_ip: str) -> bool:
        cfg = self.cfg
        # The request id: the client's when well formed, else ours; sent on to the backend, logged, and
        # back to the client only when asked (--request-id-response: the spec's transparency otherwise).
        rid = req.request_id
        if rid is None or not _REQUEST_ID.fullmatch(rid):
            x.rid_sent = rid = new_request_id()      # replaces whatever the client sent
        x.request_id = rid
        if cfg.request_id_response:
            x.rid_header = b"X-Request-Id: " + rid + b"\r\n"
        has_body = req.chunked or bool(req.content_length)
        # After an early answer, an unread body would be read as the next request: close instead.
        keep_if_early = req.keep_alive and not has_body

        # 1. identify (every access-log line has the client, a 413 too)
        peer_ip = peer_ip or peer.decode()
        ip = self.identifier.client_ip(peer_ip, peer_trusted, req.xff) if peer_trusted else peer_ip
        x.client_ip = ip

        if req.content_length is not None and req.content_length > cfg.max_body_size:
            return self._answer(sock, x, 413, "request body too large", False)

        # 2. rate limit (lb/limiting/stage.py: the rules, the verdict, the headers)
        if self.limiter is not None:
            v = self.limiter.check(req, ip)
            x.key, x.key_name, x.rl, x.limited_by = v.label, v.key_name, v.headers, v.limited_by
            if v.degraded:                   # the store was unreachable: its failure policy decided
                self.metrics.limiter_error()
            if v.rejected or v.dry or v.exempt:
                self.metrics.limit_outcome(v.rejected, v.dry, v.exempt, v.admitted, v.label)
            elif v.admitted:
                self.metrics.admitted(v.admitted)
            if v.status:
                return self._answer(sock, x, v.status, v.reason, keep_if_early and v.status != 400)
            x.slots = v.slots
            if v.delay and not self.holds.hold(v.delay, self.limiter.max_delayed, self.metrics,
                                               lambda d: _watch_while_held(sock, d)):
                x.rl += b"Retry-After: %d\r\n" % math.ceil(v.delay)   # held requests at their cap
                return self._answer(sock, x, self.limiter.status_code, "too many requests held", keep_if_early)
        else:
            try:
                x.key = Identifier.label(req.api_key, ip)
            except ValueError as e:
                return self._answer(sock, x, 400, str(e), False)

        # 3. choose a backend (a sticky route takes no round-robin turn). The pool's circuit breaker
        #    first (Envoy checks it as the request is about to use the cluster): a shed request takes
        #    nobody's round-robin turn, but has spent its token, as a 503 for "nobody healthy" has.
        breaker = self.breaker
        if breaker.max_requests:
            if not breaker.enter():
                return self._answer(sock, x, 503, f"overflow: {breaker.max_requests} requests in flight to the "
                                    "pool (max_requests)", keep_if_early)
            x.admitted = breaker
        if self.ejector.ejected:
            self.sweep_ejections()
        backend = None
        if cfg.sticky and req.cookie:
            backend = self.balancer.by_route(route_cookie(req.cookie))
        if backend is None:
            backend = self.balancer.pick()
            if backend is not None and backend.pool_full():
                # nginx's max_conns: a backend with every connection busy is passed over for one with a
                # free connection; when all are full the request waits in its pick's line (pool_timeout).
                # Every full one is excluded at once, so a pick that finds none takes nobody's turn (one
                # "other" at a time took the turn of one as full, and the rotation stopped rotating).
                other = self.balancer.pick(exclude=[b for b in self.balancer.backends if b.pool_full()])
                if other is not None:
                    backend = other
            if backend is not None and cfg.sticky:
                x.set_cookie = b"Set-Cookie: route=" + backend.route.encode() + b"; Path=/; HttpOnly\r\n"
        if backend is None:
            return self._answer(sock, x, 503, "no healthy backend", keep_if_early, unavailable=True)
        x.backend = backend
        x.tries = 1

        # An allowed upgrade (WebSocket): forwarded with its Upgrade header; a 101 makes it a tunnel.
        if req.conn_tokens and not has_body:
            x.upgrade = tunnel.requested(req, cfg.upgrades)
            if x.upgrade is not None:
                return self.forwarder.forward(x, backend, b"", sock, peer, peer_trusted, reader)

        # 4. the body: only now is the client invited to send it. A small one is read (and a chunked
        #    one validated) whole before any backend connection is taken; a larger one streams.
        body: bytes | object = b""
        if has_body:
            try:
                if req.expect_continue:
                    self._send(sock, b"HTTP/1.1 100 Continue\r\n\r\n")
                body = self._read_body(req, reader, cfg)
            except _NotBuffered as e:        # our disk, not the client: logged where it failed
                return self._answer(sock, x, e.status, e.reason, False)
            except HttpError as e:
                client_fault("client %s: %d %s", peer_ip, e.status, e.reason)
                return self._answer(sock, x, e.status, e.reason, False)
            except ClientGone:
                self.client_closed(x, reached=False)
                raise
        # 5. forward and relay (lb/proxy/forward.py)
        if type(body) is not SpooledBody:
            return self.forwarder.forward(x, backend, body, sock, peer, peer_trusted)
        try:
            return self.forwarder.forward(x, backend, body, sock, peer, peer_trusted)
        finally:
            body.close()         # its memory back to the budget, its temp file gone: on every path

    def _read_body(self, req: Request, reader: Reader, cfg):
        """The body as bytes when it is small; else (request buffering) a SpooledBody read whole, or
        (--request-buffering off) an iterator of its pieces (the first already read). A silence is 408,
        an end is ClientGone; bad framing and 413 are HttpError."""
        reader.timeout = cfg.body_timeout
        reader.deadline = None
        rate = cfg.body_min_rate
        try:
            if not req.chunked:
                n = req.content_length
                if n <= SMALL_BODY:
                    if rate:
                        body_deadline(reader, monotonic(), n, rate)   # the whole of it, at least at rate
                    return reader.read_exact(n)
                it = iter_fixed(reader, n, rate)
                return self._spool_body(it, cfg) if cfg.request_buffering else it
            it = iter_chunked(reader, cfg.max_body_size, rate)
            parts, n = [], 0
            for piece in it:
                parts.append(piece)
                n += len(piece)
                if n > SMALL_BODY:
                    if cfg.request_buffering:
                        return self._spool_body(chain(parts, it), cfg)
                    return chain(parts, it)   # too large to hold: stream the rest as it arrives
            return b"".join(parts)
        except socket.timeout:
            raise HttpError(408, "request body not received in time") from None
        except (EOFError, OSError):
            raise ClientGone() from None

    def _spool_body(self, pieces, cfg) -> SpooledBody:
        """nginx's proxy_request_buffering: the whole body, in memory then a temp file (up to
        max_body_size, which the framing already enforces), before any backend connection is taken.
        A temp file that cannot be written (a full disk) is a 503: the edge's trouble, worth a retry
        elsewhere or later, not a fault of the request (507 is WebDAV's, and says the request is too
        big to store, which it is not)."""
        spool = Spool(self.buffers, cfg.buffer_memory, cfg.max_body_size, cfg.temp_dir)
        try:
            for piece in pieces:
                if not spool.write(piece):
                    e = spool.error
                    why = (e.strerror or str(e)) if e is not None else "no room"
                    log.error("request buffer: temp file in %s failed (%s): 503",
                              cfg.temp_dir or tempfile.gettempdir(), why)
                    raise _NotBuffered(503, f"request body could not be buffered ({why})")
            return SpooledBody(spool)
        except BaseException:
            spool.close()
            raise

    def _answer(self, sock, x: "Exchange", status: int, reason: str, keep: bool, **counters) -> bool:
        """A response of the edge's own (413, 429, 503, ...), with the rate-limit headers. Closing
        while the request's body may still be arriving is a lingering close."""
        keep = keep and not self.closing
        self.metrics.edge_answered(status, monotonic() - x.start, **counters)
        data = own_response(status, reason, close=not keep, extra=x.extra_headers(),
                            head_only=x.req.method == b"HEAD")
        x.bytes_sent = len(data)
        self._done(x, status)
        self._send(sock, data)
        req = x.req
        if not keep and (req.chunked or req.content_length):
            linger(sock)     # the body may still be arriving: a lingering close, not a reset
        return keep

    def _done(self, x: "Exchange", status: int) -> None:
        """The request's outcome is known: the access-log line (once per request)."""
        x.status = status
        access_log = self.access_log       # once: a reload may turn it off between two reads
        if access_log is not None:
            r = x.reader
            if r is not None:                # head and body bytes read for this request (nginx's request_length)
                x.bytes_received = r.got - len(r.buf) - r.mark
            access_log.record(x, status, monotonic() - x.start)

    def client_closed(self, x: "Exchange", reached: bool) -> None:
        """The client went away before its answer: not a backend failure. Logged and counted as 499
        (nginx's code), against the backend's requests when the request had reached it."""
        b = x.backend.url if (reached and x.backend is not None) else None
        log.info("client closed the connection before the answer: %s %s -> 499%s", x.req.method.decode(),
                 x.req.target[:200].decode("latin-1"), f" (backend {b})" if b else "")
        self.metrics.client_failed(b, 499, monotonic() - x.start)
        self._done(x, 499)

    _send = staticmethod(send)


class _NotBuffered(HttpError):
    """A request body the edge could not buffer (its temp file failed): a 503, logged once, at ERROR."""


class Exchange:
    """What the stages learned about one request, carried to wherever its response is written.

    The access log reads the fields after `set_cookie`; a stage that learns one (a retry: tries; the
    rules: limited_by and the client's label, key) sets it here and the log line and JSON object carry it."""

    __slots__ = ("req", "start", "key", "rl", "backend", "set_cookie", "proto", "request_id", "rid_sent", "client_ip",
                 "status", "bytes_sent", "upstream_start", "upstream_seconds", "tries", "limited_by", "upgrade",
                 "tunnel", "key_name", "rid_header", "counted", "slots", "admitted", "reader", "bytes_received", "upstream_status")

    def __init__(self, req: Request, start: float, proto: bytes = b"http"):
        self.req, self.start = req, start
        self.proto = proto           # the scheme the client used: X-Forwarded-Proto
        self.key = ""                # who, as logs may show it (never a raw API key)
        self.key_name = None         # a known API key's configured name (lb/limiting/keys.py)
        self.slots = None            # in-flight slots to give back (lb/limiting/stage.py: release)
        self.admitted = None         # the Breaker that admitted it, to leave() at its end
        self.limited_by = ""         # the rules that rejected (or, dry-run, would have)
        self.upgrade = None          # the Upgrade value forwarded, for an allowed upgrade (lb/proxy/tunnel.py)
        self.tunnel = None           # (bytes client->backend, bytes backend->client, why it ended) after a 101
        self.rl = b""                # X-RateLimit-* (and Retry-After) header lines, when limiting
        self.backend = None
        self.set_cookie = b""
        self.request_id = b""
        self.rid_sent = None         # the id the backend must get instead of the client's (generated)
        self.rid_header = b""        # its X-Request-Id line for the client (--request-id-response), else empty
        self.client_ip = None
        self.status = None           # set once the access-log line is written
        self.bytes_sent = None       # bytes written to the client (head and body)
        self.upstream_start = 0.0
        self.upstream_seconds = None
        self.tries = 0               # backends tried: 0 when answered by the edge, more than 1 after retries
        self.counted = None          # the backend whose in-flight count this request holds (lb/proxy/forward.py)
        self.reader = None           # the connection's Reader: bytes_received
        self.bytes_received = None
        self.upstream_status = None  # the backend's status code, when one answered

    def extra_headers(self) -> bytes:
        """What every answer of the edge's own carries: its id (--request-id-response), the rate-limit headers."""
        return self.rid_header + self.rl


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



def _since(item) -> float:
    return item[1][0]


def route_cookie(cookie: bytes) -> str | None:
    """The value of the `route` cookie (sticky sessions), if the client sent one."""
    for part in cookie.split(b";"):
        name, eq, value = part.strip().partition(b"=")
        if eq and name == b"route":
            return value.decode("latin-1")
    return None
