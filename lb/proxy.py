"""The proxy: a threaded server, one thread per client connection, HTTP/1.1 keep-alive on both sides.

Per request: read and check the head -> (identify, rate limit: the composed edge) -> choose a backend
-> forward on a pooled connection -> relay the response as it arrives -> record.

The per-request path is budgeted: the request head and a small body leave in one sendall, the response
head and a small body return in one sendall, and nothing is formatted for logging unless something
failed. Connections come from urllib3's pool (limits, connect timeout, idle expiry: lb/backends.py);
the bytes on them are ours (lb/httpio.py), so nothing is added or reordered on the way.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from email.utils import formatdate
from http import HTTPStatus
from time import monotonic, time

from urllib3.exceptions import HTTPError as Urllib3Error

from .backends import Backend, PoolExhausted
from .identity import Identifier
from .ratelimit import headers as ratelimit_headers
from .httpio import (HOP_BY_HOP, HttpError, Reader, Request, UpstreamError, iter_chunked,
                     parse_request, parse_response)

log = logging.getLogger("edge")

SMALL_BODY = 65536           # request bodies up to this are read whole and sent with the head
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})
_NO_BODY_STATUS = frozenset({204, 304})


class ClientGone(Exception):
    """The client closed or reset its connection while we were answering."""


# ------------------------------------------------------------------------------ responses of our own

_date_cache = [0, b""]


def http_date() -> bytes:
    now = int(time())
    if _date_cache[0] != now:
        _date_cache[1] = formatdate(now, usegmt=True).encode()
        _date_cache[0] = now
    return _date_cache[1]


def own_response(status: int, reason: str, close: bool, extra: bytes = b"", head_only: bool = False) -> bytes:
    """A short text/plain answer from the edge itself (errors, 429, 503)."""
    body = reason.encode("utf-8", "replace") + b"\n"
    phrase = HTTPStatus(status).phrase.encode() if status in HTTPStatus._value2member_map_ else b"Error"
    head = b"HTTP/1.1 %d %s\r\nDate: %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n%s%s\r\n" % (
        status, phrase, http_date(), len(body), extra, b"Connection: close\r\n" if close else b"")
    return head if head_only else head + body


# ------------------------------------------------------------------------------------------- server

class EdgeServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """ThreadingHTTPServer's model (thread per connection, daemon threads) without http.server's parsing.

    Concurrent connections are capped: past max_connections a new one gets a 503 and is closed at once,
    so an attack costs us a socket for a moment, never a thread.
    """

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, addr, edge: "Edge"):
        self.edge = edge
        self.active = 0
        self._active_lock = threading.Lock()
        super().__init__(addr, None)

    def process_request(self, request, client_address):
        with self._active_lock:
            full = self.active >= self.edge.cfg.max_connections
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
        try:
            super().process_request(request, client_address)
        except BaseException:
            with self._active_lock:
                self.active -= 1
            raise

    def finish_request(self, request, client_address):
        self.edge.serve_connection(request, client_address)

    def shutdown_request(self, request):
        super().shutdown_request(request)
        with self._active_lock:
            self.active -= 1

    def handle_error(self, request, client_address):
        log.exception("connection from %s: unexpected error", client_address[0])


# ------------------------------------------------------------------------------------------- the edge

class Edge:
    """The request pipeline over one configuration. serve_connection runs on each client's thread."""

    def __init__(self, cfg, balancer, metrics, limiter=None, identifier=None, access_log=None):
        self.cfg = cfg
        self.balancer = balancer
        self.metrics = metrics
        self.limiter = limiter              # LimitStage, or None when limiting is off
        self.identifier = identifier or Identifier()
        self.access_log = access_log        # AccessLog, or None
        self.refused_connections = 0
        self.draining = False               # set on SIGTERM: finish what is in flight, take nothing new
        self.conns: dict[socket.socket, bool] = {}   # client socket -> inside a request (for the drain)

    # -- the connection loop ------------------------------------------------------------------------

    def serve_connection(self, sock: socket.socket, addr) -> None:
        cfg = self.cfg
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = Reader(sock)
        peer = addr[0].encode()
        peer_trusted = self.identifier.trusted(addr[0])   # once per connection, not per request
        peer_ip = addr[0]
        conns = self.conns
        conns[sock] = False
        try:
            while not self.draining:
                reader.deadline = None
                try:
                    if not reader.buf:
                        reader.timeout = cfg.keepalive_timeout   # idle between requests
                        if not reader.fill():
                            return
                    conns[sock] = True
                    reader.timeout = None
                    reader.deadline = monotonic() + cfg.header_timeout
                    head = reader.read_head()
                    if head is None:
                        return
                    req = parse_request(head)
                except HttpError as e:
                    self._refuse(sock, e.status, e.reason, addr)
                    return
                except socket.timeout:
                    if reader.buf:
                        self._refuse(sock, 408, "request head not received in time", addr)
                    return
                except OSError:
                    return
                try:
                    if not self.handle(req, reader, sock, peer, peer_trusted, peer_ip):
                        return
                except ClientGone:
                    return
                conns[sock] = False
        finally:
            conns.pop(sock, None)

    def wake_idle(self) -> int:
        """Draining: end the connections waiting between requests (a busy one ends after its response)."""
        n = 0
        for sock, busy in list(self.conns.items()):
            if not busy:
                try:
                    sock.shutdown(socket.SHUT_RD)   # the blocked recv returns b"": the thread exits
                    n += 1
                except OSError:
                    pass
        return n

    def busy(self) -> int:
        return sum(1 for b in list(self.conns.values()) if b)

    def _refuse(self, sock, status: int, reason: str, addr) -> None:
        """Answer a request we could not read, then the caller closes: framing is lost."""
        log.warning("client %s: %d %s", addr[0], status, reason)
        self.metrics.edge_answered(status, 0.0)
        try:
            sock.sendall(own_response(status, reason, close=True))
        except OSError:
            pass

    # -- one request ----------------------------------------------------------------------------------

    def handle(self, req: Request, reader: Reader, sock: socket.socket, peer: bytes,
               peer_trusted: bool = False, peer_ip: str = "") -> bool:
        """Serve one request; True when the client connection may carry another.

        Stage order (and why): a bad frame spends no token; a rejected request costs no backend
        capacity and takes no round-robin turn; a request that finds nobody healthy has still spent
        its token, so hammering a failing pool is not free.
        """
        cfg = self.cfg
        x = Exchange(req, monotonic())
        has_body = req.chunked or bool(req.content_length)
        # After an early answer, an unread body would be read as the next request: close instead.
        keep_if_early = req.keep_alive and not has_body

        if req.content_length is not None and req.content_length > cfg.max_body_size:
            return self._answer(sock, x, 413, "request body too large", False)

        # 1. identify
        peer_ip = peer_ip or peer.decode()
        ip = self.identifier.client_ip(peer_ip, peer_trusted, req.xff) if peer_trusted else peer_ip
        try:
            x.key, match = Identifier.limiter_key(req.api_key, ip)
        except ValueError as e:
            return self._answer(sock, x, 400, str(e), False)

        # 2. rate limit
        if self.limiter is not None:
            d = self.limiter.check(x.key, match)
            if getattr(d, "degraded", False):    # the store was unreachable: its failure policy decided
                self.metrics.limiter_error()
            x.rl = ratelimit_headers(d)
            if not d.allowed:
                status = 503 if getattr(d, "unavailable", False) else 429
                reason = "rate limiter unavailable" if status == 503 else "rate limit exceeded"
                return self._answer(sock, x, status, reason, keep_if_early, limited=status == 429)

        # 3. choose a backend (a sticky route takes no round-robin turn)
        backend = None
        if cfg.sticky and req.cookie:
            backend = self.balancer.by_route(route_cookie(req.cookie))
        if backend is None:
            backend = self.balancer.pick()
            if backend is not None and cfg.sticky:
                x.set_cookie = b"Set-Cookie: route=" + backend.route.encode() + b"; Path=/; HttpOnly\r\n"
        if backend is None:
            return self._answer(sock, x, 503, "no healthy backend", keep_if_early, unavailable=True)
        x.backend = backend

        # 4. the body: only now is the client invited to send it
        if req.expect_continue:
            self._send(sock, b"HTTP/1.1 100 Continue\r\n\r\n")
        reader.timeout = cfg.body_timeout
        reader.deadline = None
        body: bytes | object
        try:
            if req.chunked:
                body = iter_chunked(reader, cfg.max_body_size)
            elif req.content_length and req.content_length <= SMALL_BODY:
                body = reader.read_exact(req.content_length)
            elif req.content_length:
                body = self._iter_fixed(reader, req.content_length)
            else:
                body = b""
        except (EOFError, OSError):
            raise ClientGone() from None   # socket.timeout is an OSError: a silent client is gone too
        # 5. forward and relay
        return self.forward(x, backend, body, reader, sock, peer, peer_trusted)

    @staticmethod
    def _iter_fixed(reader: Reader, n: int):
        while n > 0:
            data = reader.read_some(min(n, 65536))
            n -= len(data)
            yield data

    def _answer(self, sock, x: "Exchange", status: int, reason: str, keep: bool, **counters) -> bool:
        """A response of the edge's own (413, 429, 503, ...), with the rate-limit headers."""
        keep = keep and not self.draining
        self.metrics.edge_answered(status, monotonic() - x.start, **counters)
        self._done(x, status)
        self._send(sock, own_response(status, reason, close=not keep, extra=x.rl,
                                      head_only=x.req.method == b"HEAD"))
        return keep

    def _done(self, x: "Exchange", status: int) -> None:
        if self.access_log is not None:
            self.access_log.record(x, status, monotonic() - x.start)

    @staticmethod
    def _send(sock: socket.socket, data) -> None:
        try:
            sock.sendall(data)
        except OSError:
            raise ClientGone() from None

    # -- forwarding -----------------------------------------------------------------------------------

    def upstream_head(self, req: Request, backend: Backend, peer: bytes, trusted: bool = False) -> bytearray:
        """The request as the backend sees it: hop-by-hop headers out, forwarding headers appended.

        X-Forwarded-Proto/-Host from a trusted proxy (a TLS terminator in front) are passed on as they
        are; from anyone else they are replaced with what the edge saw.
        """
        out = bytearray(req.method + b" " + req.target + b" HTTP/1.1\r\n")
        tokens = req.conn_tokens
        replaced = _REPLACED if not trusted else _REPLACED_TRUSTED
        for name, lname, value in req.headers:
            if lname in HOP_BY_HOP or (tokens and lname in tokens):
                continue
            if lname in replaced:
                continue
            out += name + b": " + value + b"\r\n"
        if not req.host:  # HTTP/1.0 without Host: HTTP/1.1 to the backend requires one
            out += b"Host: " + backend.spec.host.encode() + b":%d\r\n" % backend.spec.port
        out += b"X-Forwarded-For: " + (req.xff + b", " + peer if req.xff else peer) + b"\r\n"
        if not (trusted and req.proto):
            out += b"X-Forwarded-Proto: http\r\n"
        if req.host and not (trusted and req.fwd_host):
            out += b"X-Forwarded-Host: " + req.host + b"\r\n"
        if req.chunked:
            out += b"Transfer-Encoding: chunked\r\n"
        if self.cfg.no_pool:
            out += b"Connection: close\r\n"
        out += b"\r\n"
        return out

    def forward(self, x: "Exchange", backend: Backend, body, reader: Reader, sock: socket.socket,
                peer: bytes, trusted: bool = False) -> bool:
        cfg = self.cfg
        req, start = x.req, x.start
        pool = backend.pool
        replayable = isinstance(body, bytes)
        keep_if_failed = req.keep_alive and replayable   # a streamed body may be half read
        try:
            conn = pool.acquire()
        except PoolExhausted as e:
            return self._upstream_failed(sock, x, "pool", 503, str(e), keep_if_failed)
        head = self.upstream_head(req, backend, peer, trusted)
        with backend.lock:
            backend.inflight += 1
        try:
            retried = False
            while True:
                reused = conn.sock is not None
                try:
                    if not reused:
                        conn.connect()
                    up = conn.sock
                    up.settimeout(cfg.read_timeout)
                    if replayable:
                        up.sendall(head + body if body else head)
                    else:
                        self._send_streamed(up, head, body, req.chunked)
                    ur = Reader(up)
                    ur.timeout = cfg.read_timeout
                    ur.deadline = start + cfg.response_timeout
                    rhead = ur.read_head(max_first_line=8192)
                    while rhead is not None and rhead[9:10] == b"1" and rhead[9:12] != b"101":
                        rhead = ur.read_head(max_first_line=8192)   # interim 1xx: not relayed
                    if rhead is None:
                        raise UpstreamError("reset", "closed the connection without a response")
                    rh = parse_response(rhead)
                except HttpError as e:
                    pool.release(conn, False)
                    if e.status in (414, 431):   # our reader's limit hit by the *response* head
                        return self._upstream_failed(sock, x, "protocol", 502, "response head too large", False)
                    # a request body we were streaming turned out malformed
                    log.warning("client %s: %d %s", peer.decode(), e.status, e.reason)
                    return self._answer(sock, x, e.status, e.reason, False)
                except ClientGone:
                    pool.release(conn, False)
                    raise
                except (socket.timeout, UpstreamError, OSError, Urllib3Error) as e:
                    pool.release(conn, False)
                    kind, status, detail = _classify(e, reused)
                    if kind == "reset" and reused and not retried and replayable and req.method in IDEMPOTENT:
                        # A kept-alive connection the backend had already closed: nothing was processed.
                        retried = True
                        conn = pool.acquire_fresh()
                        continue
                    return self._upstream_failed(sock, x, kind, status, detail, keep_if_failed)
                break
            return self._relay(x, rh, ur, conn, sock)
        finally:
            with backend.lock:
                backend.inflight -= 1

    @staticmethod
    def _send_streamed(up: socket.socket, head: bytes, body, chunked: bool) -> None:
        up.sendall(head)
        try:
            for piece in body:
                if chunked:
                    if piece:
                        up.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                else:
                    up.sendall(piece)
        except (EOFError, socket.timeout):
            raise ClientGone() from None
        if chunked:
            up.sendall(b"0\r\n\r\n")

    def _upstream_failed(self, sock, x: "Exchange", kind, status, detail, keep) -> bool:
        req, backend = x.req, x.backend
        log.warning("backend %s %s: %s %s -> %d (%s)", backend.url, kind, req.method.decode(),
                    req.target[:200].decode("latin-1"), status, detail)
        self.metrics.upstream_error(backend.url, kind, status, monotonic() - x.start)
        self._done(x, status)
        reason = {"connect": "backend unreachable", "reset": "backend closed the connection",
                  "timeout": "backend timed out", "protocol": "backend sent an invalid response",
                  "pool": "backend connection limit reached"}[kind]
        self._send(sock, own_response(status, reason, close=not keep, extra=x.rl,
                                      head_only=req.method == b"HEAD"))
        return keep

    # -- relaying the response ------------------------------------------------------------------------

    def _relay(self, x: "Exchange", rh, ur: Reader, conn, sock: socket.socket) -> bool:
        req, backend, start = x.req, x.backend, x.start
        out = bytearray(b"HTTP/1.1" + rh.status_line[8:] + b"\r\n")
        tokens = None
        for name, lname, value in rh.headers:
            if lname == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
        limiting = bool(x.rl)
        for name, lname, value in rh.headers:
            if lname in HOP_BY_HOP or (tokens and lname in tokens):
                continue
            if limiting and lname[:12] == b"x-ratelimit-":
                continue               # ours replace the backend's, never duplicate them
            out += name + b": " + value + b"\r\n"
        if limiting:
            out += x.rl
        if x.set_cookie:
            out += x.set_cookie

        client_keep = req.keep_alive and not self.draining
        http10 = req.version == b"HTTP/1.0"
        if req.method == b"HEAD" or rh.status in _NO_BODY_STATUS or rh.status < 200:
            mode = "none"
        elif rh.content_length is not None:
            mode = "length"
        elif rh.chunked:
            mode = "chunked"
        else:
            mode = "eof"      # delimited by the backend closing
        if mode in ("chunked", "eof"):
            if http10:
                client_keep = False   # an HTTP/1.0 client reads to EOF
            else:
                out += b"Transfer-Encoding: chunked\r\n"
        if not client_keep:
            out += b"Connection: close\r\n"
        elif http10:
            out += b"Connection: keep-alive\r\n"
        out += b"\r\n"

        if mode == "length" and rh.content_length <= SMALL_BODY:
            # Read a small body before anything goes to the client: if the backend fails now, the
            # client still gets a clean 502 rather than a truncated response.
            try:
                out += ur.read_exact(rh.content_length)
            except (socket.timeout, OSError, EOFError) as e:
                backend.pool.release(conn, False)
                kind = "timeout" if isinstance(e, socket.timeout) else "reset"
                return self._upstream_failed(sock, x, kind, 504 if kind == "timeout" else 502,
                                             "failed inside a response body", req.keep_alive)
            mode = "sent-with-head"

        upstream_ok = False
        try:
            if mode in ("none", "sent-with-head"):
                self._send(sock, out)
                upstream_ok = True
            elif mode == "length":
                upstream_ok = self._relay_length(rh.content_length, out, ur, sock)
            else:
                upstream_ok = self._relay_chunks(mode, http10, out, ur, sock)
        except (socket.timeout, UpstreamError, OSError, EOFError, HttpError) as e:
            # The head is gone to the client: all we can do is close, so the truncation shows.
            kind = "timeout" if isinstance(e, socket.timeout) else "reset"
            log.warning("backend %s %s mid-response: %s %s (closing the client connection)",
                        backend.url, kind, req.method.decode(), req.target[:200].decode("latin-1"))
            self.metrics.upstream_error(backend.url, kind, rh.status, monotonic() - start)
            self._done(x, rh.status)
            backend.pool.release(conn, False)
            return False
        except ClientGone:
            backend.pool.release(conn, False)
            raise
        reusable = upstream_ok and not rh.close and mode != "eof" and not ur.buf
        backend.pool.release(conn, reusable)
        self.metrics.backend_done(backend.url, rh.status, monotonic() - start)
        self._done(x, rh.status)
        return client_keep

    def _relay_length(self, n: int, out: bytearray, ur: Reader, sock) -> bool:
        """A large body: the head and what has arrived, then the rest as it comes."""
        buf = ur.buf
        n -= len(buf)
        out += buf
        buf.clear()
        self._send(sock, out)
        while n > 0:
            data = ur.read_some(min(n, 262144))
            n -= len(data)
            self._send(sock, data)
        return True

    def _relay_chunks(self, mode: str, http10: bool, out: bytearray, ur: Reader, sock) -> bool:
        """Chunked or EOF-delimited from the backend -> chunked to an HTTP/1.1 client, raw to 1.0."""
        pending = out
        if mode == "eof":
            while True:
                if not ur.buf and not ur.fill():
                    break
                data = bytes(ur.buf)
                ur.buf.clear()
                pending += data if http10 else b"%x\r\n%s\r\n" % (len(data), data)
                self._send(sock, pending)
                pending = bytearray()
            if not http10:
                pending += b"0\r\n\r\n"
            self._send(sock, pending)
            return False
        while True:
            line = ur.read_line(1024)
            size_s = line.split(b";", 1)[0].strip()
            try:
                size = int(size_s, 16)
            except ValueError:
                raise UpstreamError("protocol", "invalid chunk size") from None
            if size == 0:
                while ur.read_line(8192):   # trailers: dropped (not announced to the client)
                    pass
                if not http10:
                    pending += b"0\r\n\r\n"
                self._send(sock, pending)
                return True
            data = ur.read_exact(size + 2)
            if data[-2:] != b"\r\n":
                raise UpstreamError("protocol", "chunk longer than declared")
            pending += data[:-2] if http10 else line + b"\r\n" + data
            if not ur.buf:             # about to block on the backend: flush what we have
                self._send(sock, pending)
                pending = bytearray()


class Exchange:
    """What the stages learned about one request, carried to wherever its response is written."""

    __slots__ = ("req", "start", "key", "rl", "backend", "set_cookie")

    def __init__(self, req: Request, start: float):
        self.req, self.start = req, start
        self.key = ""
        self.rl = b""                # X-RateLimit-* (and Retry-After) header lines, when limiting
        self.backend = None
        self.set_cookie = b""


def route_cookie(cookie: bytes) -> str | None:
    """The value of the `route` cookie (sticky sessions), if the client sent one."""
    for part in cookie.split(b";"):
        name, eq, value = part.strip().partition(b"=")
        if eq and name == b"route":
            return value.decode("latin-1")
    return None


# Forwarding headers we write ourselves (after the client's), and Expect, which the edge answered.
_REPLACED = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"expect"})
_REPLACED_TRUSTED = frozenset({b"x-forwarded-for", b"expect"})


def _classify(e: BaseException, reused: bool) -> tuple[str, int, str]:
    """(kind, status, detail) for a failure before any response byte reached the client."""
    if isinstance(e, UpstreamError):
        return e.kind, (504 if e.kind == "timeout" else 502), e.detail
    name = type(e).__name__
    if isinstance(e, Urllib3Error):   # raised by connect(): refused, unreachable, connect timeout
        return "connect", 502, name
    if isinstance(e, socket.timeout):
        return "timeout", 504, "no response within the read timeout"
    if isinstance(e, ConnectionRefusedError):
        return "connect", 502, "connection refused"
    return "reset", 502, (e.strerror or name) if isinstance(e, OSError) else name
