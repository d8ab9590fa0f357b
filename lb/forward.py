"""The upstream half of the edge: one request to one backend, and its response back to the client.

In the order of an exchange:
  upstream_head()      the request head as the backend sees it (the edge writes the framing itself)
  Forwarder.attempt()  one try on one backend: a pooled connection, head + body out, response head in.
                       Returns (conn, response head, reader) or raises UpstreamFailed, classified, with
                       the connection already released: a caller may try another backend (retries) or
                       take a 101 somewhere else (a tunnel) before relay().
  Forwarder.relay()    the response to the client as it arrives, then the connection back to the pool
  Forwarder.forward()  attempt + relay, and the exact answer when the backend fails

The byte-level rules (parsing, limits, chunk syntax) are lb/httpio.py's; this module decides what is
forwarded and who is blamed when something breaks.
"""

from __future__ import annotations

import logging
import socket
import ssl
from time import monotonic

from urllib3.exceptions import HTTPError as Urllib3Error

from . import tunnel
from .backends import Backend, PoolExhausted
from .netaddr import hostport
from .httpio import (HOP_BY_HOP, ClientGone, HttpError, Reader, Request, UpstreamError, own_response,
                     parse_response, send)

log = logging.getLogger("edge")

SMALL_BODY = 65536           # bodies up to this are read whole and sent with their head, both ways
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})
_NO_BODY_STATUS = frozenset({204, 304})

# Forwarding headers we write ourselves (after the client's), and Expect, which the edge answered.
_REPLACED = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"expect"})
_REPLACED_TRUSTED = frozenset({b"x-forwarded-for", b"expect"})
_REQUEST_ID_HEADER = frozenset({b"x-request-id"})

_REASONS = {"connect": "backend unreachable", "reset": "backend closed the connection",
            "timeout": "backend timed out", "protocol": "backend sent an invalid response",
            "pool": "backend connection limit reached"}


class UpstreamFailed(Exception):
    """One try on one backend failed before any response byte reached the client.

    kind: connect | reset | timeout | protocol | pool; status: what the client gets (502/503/504);
    sent: whether any byte of the request had been written to the backend (if not, it may be retried).
    """

    def __init__(self, kind: str, status: int, detail: str, sent: bool = False):
        super().__init__(detail)
        self.kind, self.status, self.detail, self.sent = kind, status, detail, sent


def upstream_head(req: Request, backend: Backend, peer: bytes, trusted: bool = False,
                  close: bool = False, proto: bytes = b"http", upgrade: bytes | None = None,
                  request_id: bytes | None = None) -> bytearray:
    """The request as the backend sees it: hop-by-hop headers out, forwarding headers appended.

    X-Forwarded-Proto/-Host from a trusted proxy (a TLS terminator in front) are passed on as they
    are; from anyone else they are replaced with what the edge saw. request_id: the id the edge made
    up (the client sent none, or a malformed one), which replaces the client's X-Request-Id.
    """
    out = bytearray(req.method + b" " + req.target + b" HTTP/1.1\r\n")
    tokens = req.conn_tokens
    replaced = _REPLACED if not trusted else _REPLACED_TRUSTED
    if request_id is not None:
        replaced = replaced | _REQUEST_ID_HEADER
    for name, lname, value in req.headers:
        if lname in HOP_BY_HOP or (tokens and lname in tokens):
            continue
        if lname in replaced:
            continue
        out += name + b": " + value + b"\r\n"
    if not req.host:  # HTTP/1.0 without Host: HTTP/1.1 to the backend requires one
        out += b"Host: " + hostport(backend.spec.host, backend.spec.port).encode() + b"\r\n"
    out += b"X-Forwarded-For: " + (req.xff + b", " + peer if req.xff else peer) + b"\r\n"
    if not (trusted and req.proto):
        out += b"X-Forwarded-Proto: " + proto + b"\r\n"      # https when it came over our TLS
    if req.host and not (trusted and req.fwd_host):
        out += b"X-Forwarded-Host: " + req.host + b"\r\n"
    if request_id is not None:
        out += b"X-Request-Id: " + request_id + b"\r\n"
    if req.chunked:
        out += b"Transfer-Encoding: chunked\r\n"
    if upgrade:   # an allowed upgrade (lb/tunnel.py): the one exception to hop-by-hop stripping
        out += b"Upgrade: " + upgrade + b"\r\nConnection: Upgrade\r\n"
    elif close:
        out += b"Connection: close\r\n"
    out += b"\r\n"
    return out


def classify(e: BaseException, reused: bool) -> tuple[str, int, str]:
    """(kind, status, detail) for a failure before any response byte reached the client."""
    if isinstance(e, UpstreamError):
        return e.kind, (504 if e.kind == "timeout" else 502), e.detail
    name = type(e).__name__
    if isinstance(e, ssl.SSLError) and not reused:   # an https:// backend's handshake or certificate
        if isinstance(e, ssl.SSLCertVerificationError):
            return "connect", 502, f"TLS: certificate verify failed ({e.verify_message})"
        return "connect", 502, "TLS: " + str(getattr(e, "reason", None) or e).replace("_", " ").lower()
    if isinstance(e, Urllib3Error):   # raised by connect(): refused, unreachable, connect timeout
        return "connect", 502, name
    if isinstance(e, (socket.timeout, BlockingIOError)):   # BlockingIOError: SO_SNDTIMEO (httpio.kernel_timeout)
        return "timeout", 504, "no response within the read timeout"
    if isinstance(e, ConnectionRefusedError):
        return "connect", 502, "connection refused"
    return "reset", 502, (e.strerror or name) if isinstance(e, OSError) else name


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


class Forwarder:
    """The forwarding stage of one Edge (its cfg, metrics, access log and drain flag, read per call)."""

    def __init__(self, edge):
        self.edge = edge

    # -- one request --------------------------------------------------------------------------------

    def forward(self, x, backend: Backend, body, sock: socket.socket, peer: bytes,
                trusted: bool = False, reader: Reader | None = None) -> bool:
        """Forward x.req with its body (bytes, or an iterator when streamed) and relay the answer.

        A try that failed to connect sent nothing, so it is retried -- any method -- on a backend in
        rotation this request has not tried, up to cfg.retries times and within the retry budget
        (lb/retrybudget.py). Any other failure is answered: a request is never sent twice once a byte
        of it was written (but for attempt()'s stale keep-alive retry, on the same backend).
        An allowed upgrade (x.upgrade, lb/tunnel.py) is forwarded with its Upgrade header; a 101 to it
        becomes a tunnel to the client (`reader`: the client's, with any bytes it sent early).
        True when the client connection may carry another request.
        """
        edge = self.edge
        req = x.req
        keep_if_failed = req.keep_alive and isinstance(body, bytes)   # a streamed body may be half read
        budget = edge.retry_budget
        budget.start()
        held = False          # this request holds a retry slot of the budget
        tried = None          # the backends tried so far, once there was a failure
        if not backend.in_rotation:
            # Ejected (or taken out) since it was picked -- in a burst, by the failures of requests
            # picked just before this one: choose again rather than try it. Nothing was tried yet.
            backend = self.repick(x, backend)
        x.upstream_start = monotonic()   # upstream_seconds: every try, up to the last response byte
        try:
            while True:
                head = upstream_head(req, backend, peer, trusted, edge.cfg.no_pool, x.proto, x.upgrade, x.rid_sent)
                with backend.lock:
                    backend.inflight += 1
                try:
                    try:
                        conn, rh, ur = self.attempt(x, backend, head, body)
                    except UpstreamFailed as f:
                        if f.kind != "pool":      # a full pool is our limit, not the backend's failure
                            self.observe(backend, False, f.detail)
                        nxt = None
                        tried = (tried or []) + [backend]
                        if f.kind == "connect" and not f.sent:
                            if len(tried) <= edge.cfg.retries:
                                nxt = edge.balancer.pick(exclude=tried)
                                if nxt is not None and not budget.try_retry(held):
                                    f.detail += (f"; retry budget exhausted: {budget.retrying} retries in "
                                                 f"flight for {budget.active} requests")
                                    nxt = None
                        if nxt is None:
                            return self.failed(sock, x, f.kind, f.status, f.detail, keep_if_failed, tried)
                        held = True
                        self.retrying(x, backend, f, nxt, len(tried))
                        backend = nxt
                        continue
                    except HttpError as e:
                        # a request body we were streaming turned out malformed
                        log.warning("client %s: %d %s", peer.decode(), e.status, e.reason)
                        return edge._answer(sock, x, e.status, e.reason, False)
                    if rh.status == 101 and x.upgrade:
                        self.observe(backend, True, "101 Switching Protocols")
                        return tunnel.take(edge, x, conn, rh, ur, sock, reader)
                    return self.relay(x, rh, ur, conn, sock)    # it tells passive health the outcome
                finally:
                    with backend.lock:
                        backend.inflight -= 1
        finally:
            budget.end(held)

    def observe(self, backend: Backend, ok: bool, why) -> None:
        """Passive health: one request's outcome; an ejection it causes is one log line and one count.
        why: a string, or the response's status line (decoded only if it is logged)."""
        if ok and not backend.fail_run:
            return
        edge = self.edge
        ej = edge.ejector
        duration = ej.observe(backend, ok, monotonic(), edge.balancer.backends)
        if duration:
            if isinstance(why, bytes):
                why = why[9:].decode("latin-1")
            log.warning("backend %s EJECTED for %gs: %d consecutive failed requests (last: %s); "
                        "ejection %d", backend.url, duration, ej.eject_after, why, backend.times_ejected)
            edge.metrics.ejection(backend.url)

    def repick(self, x, backend: Backend) -> Backend:
        nxt = self.edge.balancer.pick()
        if nxt is None:
            return backend    # nobody else: try it anyway (it may be the one that answers)
        x.backend = nxt
        if x.set_cookie:
            x.set_cookie = b"Set-Cookie: route=" + nxt.route.encode() + b"; Path=/; HttpOnly\r\n"
        return nxt

    def retrying(self, x, failed: Backend, f: "UpstreamFailed", nxt: Backend, tries: int) -> None:
        """A failed connect is retried elsewhere: logged and counted, not answered."""
        req = x.req
        x.tries = tries + 1
        if x.set_cookie:          # sticky: the client is pinned to whoever answers
            x.set_cookie = b"Set-Cookie: route=" + nxt.route.encode() + b"; Path=/; HttpOnly\r\n"
        x.backend = nxt
        log.warning("backend %s %s: %s %s (%s); retrying on %s (try %d)", failed.url, f.kind,
                    req.method.decode(), req.target[:200].decode("latin-1"), f.detail, nxt.url, tries + 1)
        self.edge.metrics.try_failed(failed.url, f.kind)

    def attempt(self, x, backend: Backend, head: bytes, body):
        """One try on `backend`: (conn, response head, reader) once a final (or 101) head arrived.

        Raises UpstreamFailed (the backend's fault, nothing sent to the client yet), ClientGone or
        HttpError (a streamed request body failed: the client's fault). The connection is released
        on every raise. A kept-alive connection the backend had already closed is retried once on a
        new connection when that is safe (a replayable body, an idempotent method).
        """
        cfg = self.edge.cfg
        req = x.req
        pool = backend.pool
        replayable = isinstance(body, bytes)
        try:
            conn = pool.acquire(replayable and req.method in IDEMPOTENT)
        except PoolExhausted as e:
            raise UpstreamFailed("pool", 503, str(e)) from None
        retried = False
        sent = False              # a byte of this request was written to this backend
        while True:
            reused = conn.sock is not None
            try:
                if not reused:
                    conn.connect()
                up = conn.sock
                # One Reader per backend connection, kept with it: its timeout is set once, not per request.
                ur = getattr(conn, "reader", None)
                if ur is None or ur.sock is not up:
                    ur = conn.reader = Reader(up)
                ur.apply(cfg.read_timeout)
                sent = True
                if replayable:
                    up.sendall(head + body if body else head)
                else:
                    _send_streamed(up, head, body, req.chunked)
                ur.timeout = cfg.read_timeout
                ur.deadline = x.start + cfg.response_timeout
                rhead = ur.read_head(max_first_line=8192)
                while rhead is not None and rhead[9:10] == b"1" and rhead[9:12] != b"101":
                    rhead = ur.read_head(max_first_line=8192)   # interim 1xx: not relayed
                if rhead is None:
                    raise UpstreamError("reset", "closed the connection without a response")
                return conn, parse_response(rhead), ur
            except HttpError as e:
                pool.release(conn, False)
                if e.status in (414, 431):   # our reader's limit hit by the *response* head
                    raise UpstreamFailed("protocol", 502, "response head too large") from None
                raise
            except ClientGone:
                pool.release(conn, False)
                raise
            except (socket.timeout, UpstreamError, OSError, Urllib3Error) as e:
                pool.release(conn, False)
                kind, status, detail = classify(e, reused)
                if kind == "reset" and reused and not retried and replayable and req.method in IDEMPOTENT:
                    # A kept-alive connection the backend had already closed: nothing was processed.
                    retried = True
                    conn = pool.acquire_fresh()
                    continue
                raise UpstreamFailed(kind, status, detail, sent) from None

    def failed(self, sock, x, kind: str, status: int, detail: str, keep: bool, tried=None) -> bool:
        """The backend failed before the client saw a byte: log, count, answer with status.
        After retries, the line says how many tries and on which backends."""
        req, backend = x.req, x.backend
        after = "" if not tried or len(tried) < 2 else \
            f" after {len(tried)} tries: {', '.join(b.url for b in tried)}"
        log.warning("backend %s %s: %s %s -> %d (%s)%s", backend.url, kind, req.method.decode(),
                    req.target[:200].decode("latin-1"), status, detail, after)
        self.edge.metrics.upstream_error(backend.url, kind, status, monotonic() - x.start)
        data = own_response(status, _REASONS[kind], close=not keep, extra=x.extra_headers(),
                            head_only=req.method == b"HEAD")
        x.bytes_sent = len(data)
        self.edge._done(x, status)
        send(sock, data)
        return keep

    # -- relaying the response ------------------------------------------------------------------------

    def relay(self, x, rh, ur: Reader, conn, sock: socket.socket) -> bool:
        edge = self.edge
        req, backend, start = x.req, x.backend, x.start
        out = bytearray(b"HTTP/1.1" + rh.status_line[8:] + b"\r\n")
        tokens = None
        for name, lname, value in rh.headers:
            if lname == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
        limiting = bool(x.rl)
        ietf = limiting and b"\nRateLimit: " in x.rl      # [limits] ietf_headers: ours replace those too
        for name, lname, value in rh.headers:
            if lname in HOP_BY_HOP or (tokens and lname in tokens):
                continue
            if limiting and (lname[:12] == b"x-ratelimit-" or ietf and lname in _IETF_FIELDS) \
                    or lname == b"x-request-id":
                continue               # ours replace the backend's, never duplicate them
            out += name + b": " + value + b"\r\n"
        out += b"X-Request-Id: " + x.request_id + b"\r\n"
        if limiting:
            out += x.rl
        if x.set_cookie:
            out += x.set_cookie

        client_keep = req.keep_alive and not edge.draining
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
                self.observe(backend, False, f"{kind} inside a response body")
                return self.failed(sock, x, kind, 504 if kind == "timeout" else 502,
                                   "failed inside a response body", req.keep_alive)
            mode = "sent-with-head"

        upstream_ok = False
        x.bytes_sent = len(out)
        try:
            if mode in ("none", "sent-with-head"):
                send(sock, out)
                upstream_ok = True
            elif mode == "length":
                x.bytes_sent += rh.content_length
                upstream_ok = _relay_length(rh.content_length, out, ur, sock)
            else:
                upstream_ok, x.bytes_sent = _relay_chunks(mode, http10, out, ur, sock)
        except (socket.timeout, UpstreamError, OSError, EOFError, HttpError) as e:
            # The head is gone to the client: all we can do is close, so the truncation shows.
            kind = "timeout" if isinstance(e, socket.timeout) else "reset"
            self.observe(backend, False, f"{kind} mid-response")
            log.warning("backend %s %s mid-response: %s %s (closing the client connection)",
                        backend.url, kind, req.method.decode(), req.target[:200].decode("latin-1"))
            edge.metrics.upstream_error(backend.url, kind, rh.status, monotonic() - start)
            edge._done(x, rh.status)
            backend.pool.release(conn, False)
            return False
        except ClientGone:
            backend.pool.release(conn, False)
            raise
        reusable = upstream_ok and not rh.close and mode != "eof" and not ur.buf
        backend.pool.release(conn, reusable)
        self.observe(backend, rh.status < 500, rh.status_line)
        now = monotonic()
        x.upstream_seconds = now - x.upstream_start
        edge.metrics.backend_done(backend.url, rh.status, now - start, x.upstream_seconds)
        edge._done(x, rh.status)
        return client_keep


def _relay_length(n: int, out: bytearray, ur: Reader, sock) -> bool:
    """A large body: the head and what has arrived, then the rest as it comes."""
    buf = ur.buf
    n -= len(buf)
    out += buf
    buf.clear()
    send(sock, out)
    while n > 0:
        data = ur.read_some(min(n, 262144))
        n -= len(data)
        send(sock, data)
    return True


def _relay_chunks(mode: str, http10: bool, out: bytearray, ur: Reader, sock) -> tuple[bool, int]:
    """Chunked or EOF-delimited from the backend -> chunked to an HTTP/1.1 client, raw to 1.0.
    (the backend ended the body cleanly, bytes sent to the client)"""
    pending = out
    sent = 0
    if mode == "eof":
        while True:
            if not ur.buf and not ur.fill():
                break
            data = bytes(ur.buf)
            ur.buf.clear()
            pending += data if http10 else b"%x\r\n%s\r\n" % (len(data), data)
            send(sock, pending)
            sent += len(pending)
            pending = bytearray()
        if not http10:
            pending += b"0\r\n\r\n"
        send(sock, pending)
        return False, sent + len(pending)
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
            send(sock, pending)
            return True, sent + len(pending)
        data = ur.read_exact(size + 2)
        if data[-2:] != b"\r\n":
            raise UpstreamError("protocol", "chunk longer than declared")
        pending += data[:-2] if http10 else line + b"\r\n" + data
        if not ur.buf:             # about to block on the backend: flush what we have
            send(sock, pending)
            sent += len(pending)
            pending = bytearray()


_IETF_FIELDS = frozenset({b"ratelimit", b"ratelimit-policy"})
