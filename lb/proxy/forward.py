"""The upstream half of the edge: one request to one backend, and its response back to the client.

In the order of an exchange:
  upstream_head()      the request head as the backend sees it (the edge writes the framing itself)
  Forwarder.attempt()  one try on one backend: a pooled connection, head + body out, response head in.
                       Returns (conn, response head, reader) or raises UpstreamFailed, classified, with
                       the connection already released: a caller may try another backend (retries) or
                       take a 101 somewhere else (a tunnel) before relay().
  Forwarder.relay()    the response to the client as it arrives, then the connection back to the pool
  Forwarder.forward()  attempt + relay, and the exact answer when the backend fails

The byte-level rules (parsing, limits, chunk syntax) are lb/http/framing.py's; this module decides what is
forwarded and who is blamed when something breaks.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
from time import monotonic, sleep

from urllib3.exceptions import ClosedPoolError, HTTPError as Urllib3Error

from lb.proxy import tunnel
from lb.upstream.backends import Backend, PoolExhausted
from lb.logs import ClientFaults, client_fault
from lb.upstream.retrypolicy import RetryPolicy, retry_after
from lb.proxy.spool import Spool, SpooledBody
from lb.netaddr import hostport
from lb.http.plan import request_fields, response_plan
from lb.http.framing import (HOP_BY_HOP, ClientGone, HttpError, Reader, Request, UpstreamError, chunk_size, linger,
                     not_relayed, own_response, parse_response, send)

log = logging.getLogger("edge")
retry_log = ClientFaults(log, what="retries")   # retries past connect: one WARNING per window, then a count

SMALL_BODY = 65536           # bodies up to this are read whole and sent with their head, both ways
PIECE = 262144               # the most of a body held at once while relaying
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})
_NO_BODY_STATUS = frozenset({204, 304})

# Never copied from a message: hop-by-hop, and the framing the edge writes itself from what it parsed.
# X-Forwarded-Client-Cert is the edge's to write (mutual TLS): a client's own copy never reaches a
# backend, with or without client certificates configured (Envoy's forward_client_cert_details SANITIZE).
_NOT_COPIED = HOP_BY_HOP | {b"content-length", b"x-forwarded-client-cert"}
# Forwarding headers we write ourselves (after the client's), and Expect, which the edge answered.
_REPLACED = _NOT_COPIED | {b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"expect"}
_REPLACED_TRUSTED = _NOT_COPIED | {b"x-forwarded-for", b"expect"}
_REQUEST_ID_HEADER = frozenset({b"x-request-id"})

_REASONS = {"connect": "backend unreachable", "reset": "backend closed the connection",
            "timeout": "backend timed out", "protocol": "backend sent an invalid response",
            "pool": "backend connection limit reached", "gone": "backend removed"}


class UpstreamFailed(Exception):
    """One try on one backend failed before any response byte reached the client.

    kind: connect | reset | timeout | protocol | pool | gone (its pool closed by a reload);
    status: what the client gets (502/503/504);
    sent: whether any byte of the request had been written to the backend (if not, it may be retried).
    """

    def __init__(self, kind: str, status: int, detail: str, sent: bool = False):
        super().__init__(detail)
        self.kind, self.status, self.detail, self.sent = kind, status, detail, sent


def upstream_head(req: Request, backend: Backend, peer: bytes, trusted: bool = False,
                  close: bool = False, proto: bytes = b"http", upgrade: bytes | None = None,
                  request_id: bytes | None = None, length: int | None = None,
                  underscores: bool = False) -> bytearray:
    """The request as the backend sees it: hop-by-hop headers out, forwarding headers appended, and
    exactly one framing header, the edge's: Content-Length `length`, else chunked if the body is.

    X-Forwarded-Proto/-Host from a trusted proxy (a TLS terminator in front) are passed on as they
    are; from anyone else they are replaced with what the edge saw. request_id: the id the edge made
    up (the client sent none, or a malformed one), which replaces the client's X-Request-Id.

    A field name with '_' is not forwarded unless `underscores` (nginx's underscores_in_headers off,
    its default): CGI-style backends read X_Forwarded_For and X-Forwarded-For as one HTTP_X_FORWARDED_FOR,
    so a client could slip its own beside the edge's. The edge itself never reads such a name as its
    dashed twin (parse_request matches exact names).
    """
    out = bytearray(req.method + b" " + req.target + b" HTTP/1.1\r\n")
    replaced = _REPLACED if not trusted else _REPLACED_TRUSTED
    if request_id is not None:
        replaced = replaced | _REQUEST_ID_HEADER
    fields, length = request_fields(req, replaced, underscores, length)   # Connection's tokens never name Host
    out += fields                                                          # or the framing (NOT_NOMINABLE)
    if not req.host:  # HTTP/1.0 without Host: HTTP/1.1 to the backend requires one
        out += b"Host: " + hostport(backend.spec.host, backend.spec.port).encode() + b"\r\n"
    out += b"X-Forwarded-For: " + (req.xff + b", " + peer if req.xff else peer) + b"\r\n"
    if not (trusted and req.proto):
        out += b"X-Forwarded-Proto: " + proto + b"\r\n"      # https when it came over our TLS
    if req.host and not (trusted and req.fwd_host):
        out += b"X-Forwarded-Host: " + req.host + b"\r\n"
    if request_id is not None:
        out += b"X-Request-Id: " + request_id + b"\r\n"
    if req.client_cert is not None:
        out += b"X-Forwarded-Client-Cert: " + req.client_cert.xfcc + b"\r\n"
    if length is not None:
        out += b"Content-Length: %d\r\n" % length
    elif req.chunked:
        out += b"Transfer-Encoding: chunked\r\n"
    if upgrade:   # an allowed upgrade (lb/proxy/tunnel.py): the one exception to hop-by-hop stripping
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
    """Head, then the body as it arrives from the client (re-chunked when chunked). What fails while
    reading the client is the client's: HttpError (bad framing, 413; a silence is 408) or ClientGone;
    what fails while writing to the backend raises OSError as it is."""
    up.sendall(head)
    it = iter(body)
    while True:
        try:
            piece = next(it)
        except StopIteration:
            break
        except socket.timeout:
            raise HttpError(408, "request body not received in time") from None
        except (EOFError, OSError):
            raise ClientGone() from None
        if chunked:
            if piece:
                up.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        else:
            up.sendall(piece)
    if chunked:
        up.sendall(b"0\r\n\r\n")


def _acquire(pool, fresh: bool = False):
    try:
        return pool.acquire_fresh() if fresh else pool.acquire()
    except PoolExhausted as e:
        raise UpstreamFailed("pool", 503, str(e)) from None
    except ClosedPoolError:
        raise UpstreamFailed("gone", 502, "removed by a reload") from None


class Forwarder:
    """The forwarding stage of one Edge (its cfg, metrics, access log and drain flag, read per call)."""

    def __init__(self, edge):
        self.edge = edge
        self._policy, self._policy_of = None, None

    # -- one request --------------------------------------------------------------------------------

    def forward(self, x, backend: Backend, body, sock: socket.socket, peer: bytes,
                trusted: bool = False, reader: Reader | None = None) -> bool:
        """Forward x.req with its body (bytes, or an iterator when streamed) and relay the answer.

        A try that failed to connect sent nothing, so it is retried -- any method -- on a backend in
        rotation this request has not tried, up to cfg.retries times and within the retry budget
        (lb/upstream/retrybudget.py). Any other failure is answered: a request is never sent twice once a byte
        of it was written (but for attempt()'s stale keep-alive retry, on the same backend).
        An allowed upgrade (x.upgrade, lb/proxy/tunnel.py) is forwarded with its Upgrade header; a 101 to it
        becomes a tunnel to the client (`reader`: the client's, with any bytes it sent early).
        True when the client connection may carry another request.
        """
        edge = self.edge
        req = x.req
        streamed = not isinstance(body, (bytes, SpooledBody))   # a spooled body is whole, like bytes
        if streamed:
            length = None if req.chunked else req.content_length
        else:
            length = len(body) if (req.chunked or req.content_length is not None) else None
        keep_if_failed = req.keep_alive and not streamed   # a streamed body may be half read
        policy = self.policy()
        budget = edge.retry_budget
        budget.start()
        held = False          # this request holds a retry slot of the budget
        tried = None          # the backends tried so far, once there was a failure
        regone = None         # the backend picked again after a reload closed the first one's pool
        if not backend.in_rotation:
            # Ejected (or taken out) since it was picked -- in a burst, by the failures of requests
            # picked just before this one: choose again rather than try it. Nothing was tried yet.
            backend = self.repick(x, backend)
        x.upstream_start = monotonic()   # upstream_seconds: every try, up to the last response byte
        try:
            while True:
                head = upstream_head(req, backend, peer, trusted, edge.cfg.no_pool, x.proto, x.upgrade, x.rid_sent,
                                     length, edge.cfg.allow_underscores)
                x.counted = backend      # uncount() takes back this count, whichever backend a retry names next
                with backend.lock:
                    backend.inflight += 1
                try:
                    try:
                        conn, rh, ur = self.attempt(x, backend, head, body)
                    except UpstreamFailed as f:
                        tried = (tried or []) + [backend]
                        if f.kind == "gone" and not regone:
                            # A reload removed this backend between the pick and now: another, once
                            # (not a failure of anyone's, so no retry or budget is spent on it).
                            regone = edge.balancer.pick(exclude=tried)
                            if regone is not None:
                                backend = x.backend = regone
                                continue
                        if f.kind not in ("pool", "gone"):   # a full pool is our limit, not the backend's
                            self.observe(backend, False, f.detail)
                        nxt = None
                        budgeted = False
                        # A "connect" after bytes were sent (a TLS failure past the handshake) is not one.
                        cond = None if f.kind == "connect" and f.sent else \
                            policy.should_retry(f.kind, None, req.method, not streamed, False)
                        if cond is not None:
                            nxt, budgeted, refused = self.next_try(backend, tried, held)
                            f.detail += refused
                        if nxt is None:
                            keep = self.failed(sock, x, f.kind, f.status, f.detail, keep_if_failed, tried)
                            if streamed:
                                linger(sock)     # the rest of the body may still be arriving
                            return keep
                        held = held or budgeted
                        self.retrying(x, backend, f.kind, f.detail, cond, nxt, len(tried))
                        if cond != "connect":
                            sleep(policy.backoff(len(tried) - 1))
                        backend = nxt
                        continue
                    except HttpError as e:
                        return self.client_failed(sock, x, e.status, e.reason)
                    if rh.status in policy.statuses and not rh.early:
                        # The head is ours alone so far (relay() has not begun): a 5xx the policy names
                        # can still go elsewhere, its connection closed with the body unread.
                        if rh.status == 503:
                            self.rest(backend, rh)
                        cond = policy.should_retry("status", rh.status, req.method, not streamed, False)
                        nxt = None
                        if cond is not None:
                            tried = (tried or []) + [backend]
                            nxt, budgeted, _ = self.next_try(backend, tried, held)
                        if nxt is not None:
                            backend.pool.release(conn, False)
                            self.observe(backend, False, rh.status_line)
                            held = held or budgeted
                            self.retrying(x, backend, None, rh.status_line[9:].decode("latin-1"), cond, nxt,
                                          len(tried))
                            sleep(policy.backoff(len(tried) - 1))
                            backend = nxt
                            continue
                    if rh.status == 101 and x.upgrade:
                        self.observe(backend, True, "101 Switching Protocols")
                        # The handshake is over: a tunnel (open for hours) neither keeps the retry slot
                        # its handshake may hold nor counts as a request in the budget's percentage.
                        budget.end(held)
                        held = None
                        return tunnel.take(edge, x, conn, rh, ur, sock, reader)
                    # relay() tells passive health the outcome. An early answer to a body not sent
                    # whole leaves the client's body half read.
                    return self.relay(x, rh, ur, conn, sock, in_sync=not (rh.early and streamed))
                finally:
                    uncount(x)
        except ClientGone:
            if x.status is None:
                edge.client_closed(x, reached=True)
            raise
        finally:
            if held is not None:
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
        nxt = edge.balancer.pick(exclude=tried)
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
                    self.edge.balancer.rest(backend, secs)
                    retry_log("backend %s answered 503 with Retry-After: %s: not picked for %gs", backend.url,
                              value.decode("latin-1"), secs)
                return

    def retrying(self, x, failed: Backend, kind: str | None, detail: str, cond: str, nxt: Backend,
                 tries: int) -> None:
        """A failed try is retried elsewhere: logged and counted, not answered. kind: the failure's
        (None: the backend answered, with the status `detail` names)."""
        req = x.req
        x.tries = tries + 1
        if x.set_cookie:          # sticky: the client is pinned to whoever answers
            x.set_cookie = b"Set-Cookie: route=" + nxt.route.encode() + b"; Path=/; HttpOnly\r\n"
        x.backend = nxt
        # A connect failure's line as always (one per request: passive health ejects the backend soon);
        # the other conditions can be every request of an outage: rate-limited, then one summary.
        say = log.warning if cond == "connect" else retry_log
        say("backend %s %s: %s %s (%s); retrying on %s (try %d)", failed.url, kind or "answered",
            req.method.decode(), req.target[:200].decode("latin-1"), detail, nxt.url, tries + 1)
        self.edge.metrics.try_failed(failed.url, kind, cond)

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
        replayable = isinstance(body, (bytes, SpooledBody))
        conn = _acquire(pool)
        retried = False
        while True:
            reused = conn.sock is not None
            send_err = None     # why sending failed, if it did
            try:
                if not reused:
                    conn.connect()
                up = conn.sock
                # One Reader per backend connection, kept with it: its timeout is set once, not per request.
                ur = getattr(conn, "reader", None)
                if ur is None or ur.sock is not up:
                    ur = conn.reader = Reader(up)
                ur.apply(cfg.read_timeout)
            except (OSError, Urllib3Error) as e:
                pool.release(conn, False)
                raise UpstreamFailed(*classify(e, reused)) from None   # nothing was sent: retryable
            try:
                if type(body) is bytes:
                    up.sendall(head + body if body else head)
                elif replayable:
                    up.sendall(head)            # a buffered body, from its first byte on every try
                    for piece in body.pieces():
                        up.sendall(piece)
                else:
                    _send_streamed(up, head, body, req.chunked)
            except (HttpError, ClientGone):
                pool.release(conn, False)
                raise
            except OSError as e:
                send_err = e    # the backend stopped reading: it may have answered early (its 413)
            # After a failed send only an answer already there counts: read it without waiting long.
            per_try = cfg.per_try_timeout
            ur.timeout = (per_try if 0 < per_try < cfg.read_timeout else cfg.read_timeout) \
                if send_err is None else 0.5
            # The whole response within response_timeout of the backend having the request (Envoy's route
            # timeout starts at the request's end): a slow upload or a delay-mode hold is not the backend's.
            ur.deadline = monotonic() + cfg.response_timeout
            try:
                rhead = ur.read_head(max_first_line=8192, what="response")
                while rhead is not None and rhead[9:10] == b"1" and rhead[9:12] != b"101":
                    rhead = ur.read_head(max_first_line=8192, what="response")   # interim 1xx: not relayed
                if rhead is None:
                    raise UpstreamError("reset", "closed the connection without a response")
                rh = parse_response(rhead)
                x.upstream_status = rh.status      # the access log's upstream_status
                if per_try:
                    ur.timeout = cfg.read_timeout  # the body's reads: the per-try bound is the head's
            except HttpError as e:
                # Our reader's limits and its "closed inside the head", hit by a *response* head.
                pool.release(conn, False)
                if e.status in (414, 431):
                    raise UpstreamFailed("protocol", 502, "response head too large", True) from None
                if e.reason.startswith("bare CR"):
                    raise UpstreamFailed("protocol", 502, e.reason, True) from None
                raise UpstreamFailed("reset", 502, "closed the connection inside the response head", True) from None
            except (OSError, UpstreamError) as e:
                pool.release(conn, False)
                if send_err is not None:
                    e = send_err
                    if isinstance(e, (socket.timeout, BlockingIOError)):   # BlockingIOError: SO_SNDTIMEO
                        raise UpstreamFailed("timeout", 504, "stopped reading the request body", True) from None
                kind, status, detail = classify(e, reused)
                if kind == "timeout" and 0 < per_try < cfg.read_timeout and isinstance(e, socket.timeout) \
                        and str(e) != "deadline":
                    detail = f"no response head within the per-try timeout ({per_try:g}s)"
                if kind == "reset" and reused and not retried and replayable and req.method in IDEMPOTENT:
                    # A kept-alive connection the backend had already closed: nothing was processed.
                    # If the fresh connection cannot connect either, that is a connect failure like any
                    # other, retried elsewhere (the spec's exception for this idempotent retry).
                    retried = True
                    conn = _acquire(pool, fresh=True)
                    continue
                raise UpstreamFailed(kind, status, detail, True) from None
            if send_err is not None:
                rh.early = True
                rh.close = True          # the request was not sent whole: this connection is done
            return conn, rh, ur

    def failed(self, sock, x, kind: str, status: int, detail: str, keep: bool, tried=None) -> bool:
        """The backend failed before the client saw a byte: log, count, answer with status.
        After retries, the line says how many tries and on which backends."""
        req, backend = x.req, x.backend
        after = "" if not tried or len(tried) < 2 else \
            f" after {len(tried)} tries: {', '.join(b.url for b in tried)}"
        log.warning("backend %s %s: %s %s -> %d (%s)%s", backend.url, kind, req.method.decode(),
                    req.target[:200].decode("latin-1"), status, detail, after)
        self.edge.metrics.upstream_error(backend.url, kind, status, monotonic() - x.start)
        keep = keep and not self.edge.closing      # from SIGTERM on, as relay() and _answer() say it
        data = own_response(status, _REASONS[kind], close=not keep, extra=x.extra_headers(),
                            head_only=req.method == b"HEAD")
        x.bytes_sent = len(data)
        self.edge._done(x, status)
        send(sock, data)
        return keep

    def client_failed(self, sock, x, status: int, reason: str) -> bool:
        """The client's streamed body failed (bad framing, too large, too slow) after its head reached
        the backend (that connection is closed): answer, count it against the backend's requests."""
        edge = self.edge
        client_fault("client %s: %d %s (request body to backend %s)", x.client_ip, status, reason, x.backend.url)
        edge.metrics.client_failed(x.backend.url, status, monotonic() - x.start)
        data = own_response(status, reason, close=True, extra=x.extra_headers(), head_only=x.req.method == b"HEAD")
        x.bytes_sent = len(data)
        edge._done(x, status)
        send(sock, data)
        linger(sock)
        return False

    # -- relaying the response ------------------------------------------------------------------------

    def relay(self, x, rh, ur: Reader, conn, sock: socket.socket, in_sync: bool = True) -> bool:
        """The response to the client as it arrives. The edge writes the framing: the client never
        sees a Content-Length and a Transfer-Encoding together, nor a length the edge did not parse."""
        edge = self.edge
        req, backend, start = x.req, x.backend, x.start
        status = rh.status
        client_keep = req.keep_alive and in_sync and not edge.closing
        http10 = req.version == b"HTTP/1.0"
        out, mode, client_keep = response_plan(rh, req.method, http10, client_keep, not_relayed(x.rl, x.rid_header),
                                               bool(x.rl), x.rid_header + x.rl + x.set_cookie)
        if status == 101:
            rh.close = True      # no tunnel here (the upgrade path is its own): the backend's side is done too

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
                                   "failed inside a response body", req.keep_alive and in_sync)
            mode = "sent-with-head"

        upstream_ok = False
        x.bytes_sent = len(out)
        c = None
        try:
            if mode in ("none", "sent-with-head"):
                send(sock, out)
                upstream_ok = True
            else:
                if _buffered(edge.cfg, rh):
                    c = _Buffered(sock, Spool(edge.buffers, edge.cfg.buffer_memory, edge.cfg.max_temp_file_size,
                                              edge.cfg.temp_dir), edge.cfg.send_timeout, backend.url)
                    ur = c.reader(ur)
                else:
                    c = _Client(sock)
                if mode == "length":
                    upstream_ok = _relay_length(rh.content_length, out, ur, c)
                elif mode == "chunked":
                    upstream_ok = _relay_chunked(http10, out, ur, c)
                else:
                    _relay_eof(http10 or mode == "raw", out, ur, c)
        except (socket.timeout, UpstreamError, OSError, EOFError, HttpError) as e:
            kind = ("timeout" if isinstance(e, socket.timeout) else
                    "protocol" if isinstance(e, (UpstreamError, HttpError)) else "reset")
            backend.pool.release(conn, False)
            if c is not None:
                c.close()    # what is still buffered is never sent: the client sees the truncation
            if c is not None and not c.n and not c.partial:   # nothing reached the client yet: a clean answer
                self.observe(backend, False, f"{kind} before the response body")
                return self.failed(sock, x, kind, 504 if kind == "timeout" else 502,
                                   "failed before the response body", req.keep_alive and in_sync)
            # The head is gone to the client: all we can do is close, so the truncation shows.
            self.observe(backend, False, f"{kind} mid-response")
            log.warning("backend %s %s mid-response: %s %s (closing the client connection)",
                        backend.url, kind, req.method.decode(), req.target[:200].decode("latin-1"))
            edge.metrics.upstream_error(backend.url, kind, status, monotonic() - start)
            edge._done(x, status)
            return False
        except ClientGone:
            backend.pool.release(conn, False)
            if c is not None:
                c.close()
            raise
        reusable = upstream_ok and not rh.close
        if reusable and ur.buf:
            # More than the response (a second one, a body after a HEAD, 204 or 304, a Content-Length
            # too short): never relayed, and the connection is not reused for someone else to read it.
            log.warning("backend %s sent %d bytes after a complete response: closed, not relayed",
                        backend.url, len(ur.buf))
            reusable = False
        elif reusable:
            ack_now(conn.sock)
        backend.pool.release(conn, reusable)
        self.observe(backend, rh.status < 500, rh.status_line)
        now = monotonic()
        x.upstream_seconds = now - x.upstream_start
        if c is not None:
            if c.buffered:
                # The backend is done and its connection free: the rest is the client's pace, and no
                # longer the backend's load (least-request, the drain's in-flight count).
                uncount(x)
                c.finish()
            x.bytes_sent = c.n
        edge.metrics.backend_done(backend.url, status, now - start, x.upstream_seconds)
        edge._done(x, status)
        if not in_sync:
            linger(sock)    # the client may still be sending the body the backend refused
        return client_keep


def uncount(x) -> None:
    """The request no longer loads its backend: its in-flight count goes back, once."""
    b, x.counted = x.counted, None
    if b is not None:
        with b.lock:
            b.inflight -= 1


def ack_now(sock) -> None:
    """Acknowledge the response at once instead of after the delayed-ACK timer (up to 40 ms on Linux).
    A backend that writes something after its response without TCP_NODELAY has that write held back
    by Nagle until its response is acknowledged -- and the ACK would otherwise ride on our next request
    on this connection: the stray bytes would arrive just after the pool's check and be read as that
    request's answer. Acked now, they arrive while the connection is idle, where the check sees them."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
    except OSError:
        pass


class _Client:
    """The client socket while a body streams: counts what went out (before the first byte a failed
    backend still gets a clean 502; after it, only a close can show the truncation)."""

    __slots__ = ("sock", "n")
    buffered = False
    partial = False          # some bytes may have left though none are counted (a TLS want-write)

    def __init__(self, sock):
        self.sock, self.n = sock, 0

    def send(self, data) -> None:
        send(self.sock, data)
        self.n += len(data)

    def close(self) -> None:
        pass


def _buffered(cfg, rh) -> bool:
    """Whether this response is read ahead of the client (nginx's rules): not an event stream, and the
    backend's X-Accel-Buffering (yes/no) overrides --proxy-buffering. Asked only of bodies that do not
    leave with their head, so a small response pays nothing for it."""
    on = cfg.proxy_buffering
    for _, lname, value in rh.headers:
        if lname == b"x-accel-buffering":
            v = value.lower()
            if v == b"no":
                return False
            if v == b"yes":
                on = True
        elif lname == b"content-type" and value[:17].lower() == b"text/event-stream":
            return False
    return on


_TLS_PIECE = 16384       # one TLS record: a send that would block is retried with the same bytes


class _Buffered(_Client):
    """The client socket when a response is buffered: what the client takes at once goes at once
    (non-blocking sends, so the first byte leaves as without buffering); the rest waits in a Spool
    while the backend is read on. Before each read of the backend (_PumpReader.fill) the client is fed
    whatever it can take, so a slow backend never holds back what already arrived. When the spool is
    full (memory budget and --max-temp-file-size spent, or the disk failed) the rest streams: the
    backend waits on the client, as with --proxy-buffering off. finish() sends what is left once the
    backend connection is back in the pool."""

    __slots__ = ("spool", "piece", "streaming", "tls", "nb", "send_timeout", "last", "poll", "url", "partial")
    buffered = True

    def __init__(self, sock, spool: Spool, send_timeout: float, url: str):
        super().__init__(sock)
        self.spool = spool
        self.piece = b""          # bytes being written; after a TLS want-write, retried exactly as they are
        self.streaming = False
        self.tls = type(sock) is not socket.socket
        self.send_timeout = send_timeout
        self.last = monotonic()   # when the client last took a byte (it gets send_timeout between two)
        self.poll = None
        self.url = url
        self.partial = False
        self.nb = self.tls            # an SSLSocket takes no MSG_DONTWAIT: non-blocking until _blocking()
        if self.tls:
            sock.setblocking(False)

    def reader(self, ur: Reader) -> Reader:
        """ur, as a reader that feeds the client while it waits for the backend (same buffer)."""
        pr = _PumpReader(ur.sock)
        pr.buf, pr.timeout, pr.deadline, pr.applied, pr.send_bound = ur.buf, ur.timeout, ur.deadline, ur.applied, \
            ur.send_bound
        pr.client, pr.origin = self, ur
        return pr

    def send(self, data) -> None:
        if self.streaming:
            self._blocking(data)
        elif not self.piece and not len(self.spool):
            self.piece = data
            self._push()
        elif not self.spool.write(data):
            self.streaming = True
            if self.spool.error is not None:
                log.warning("response buffer: temp file failed (%s); streaming the rest of a response from "
                            "backend %s", self.spool.error.strerror or self.spool.error, self.url)
            self._blocking(data)

    def _push(self) -> None:
        """One non-blocking send of the next piece, as much as the client takes now."""
        piece = self.piece
        if not piece:
            piece = self.spool.read(_TLS_PIECE if self.tls else PIECE)
            if not piece:
                return
        try:
            k = self.sock.send(piece) if self.tls else self.sock.send(piece, socket.MSG_DONTWAIT)
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            k = 0
            # OpenSSL may have put some records of the piece on the wire already: never a 502 after it.
            self.partial = self.tls
        except OSError:
            raise ClientGone() from None
        if k:
            self.n += k
            self.last = monotonic()
        self.piece = b"" if k >= len(piece) else (memoryview(piece)[k:] if k else piece)

    def pending(self) -> bool:
        return bool(self.piece) or len(self.spool) > 0

    def pump(self, up, timeout: float | None) -> None:
        """Until the backend has bytes to read: feed the client. The client gets send_timeout between
        two bytes taken (ClientGone, as a blocked send would); a backend silent for `timeout` is a
        socket.timeout, as its recv would be."""
        if getattr(up, "pending", None) and up.pending():
            return                          # a TLS backend: a record already decrypted, readable now
        p = self.poll
        if p is None:
            p = self.poll = select.poll()
            p.register(up, select.POLLIN)
            p.register(self.sock, select.POLLOUT)
        ufd = up.fileno()
        start = monotonic()
        while self.pending():
            now = monotonic()
            wait = self.send_timeout - (now - self.last)
            if timeout is not None:
                wait = min(wait, timeout - (now - start))
            if wait <= 0:
                if now - self.last >= self.send_timeout:
                    raise ClientGone()
                raise socket.timeout("timed out")
            readable = False
            for fd, ev in p.poll(wait * 1000):
                if fd == ufd:
                    readable = True
                else:
                    self._push()            # POLLERR/POLLHUP too: the send says what happened
            if readable:
                return

    def _blocking(self, data=None) -> None:
        """Back to blocking sends (bounded by send_timeout): what is pending, then data."""
        if self.nb:
            self.nb = False
            self.sock.settimeout(self.send_timeout)
        if self.piece:
            send(self.sock, self.piece)
            self.n += len(self.piece)
            self.piece = b""
        spool = self.spool
        while True:
            chunk = spool.read(PIECE)
            if not chunk:
                break
            send(self.sock, chunk)
            self.n += len(chunk)
        if data is not None:
            send(self.sock, data)
            self.n += len(data)

    def finish(self) -> None:
        try:
            self._blocking()
        finally:
            self.close()

    def close(self) -> None:
        self.spool.close()
        if self.nb:
            self.nb = False
            try:
                self.sock.settimeout(self.send_timeout)
            except OSError:
                pass


class _PumpReader(Reader):
    """A backend Reader whose every wait for bytes also feeds a buffered client (_Buffered.pump)."""

    __slots__ = ("client", "origin")

    def fill(self) -> bool:
        c = self.client
        if c.pending():
            t = self.timeout
            if self.deadline is not None:
                left = self.deadline - monotonic()
                t = left if t is None or left < t else t
            c.pump(self.sock, t)
        try:
            return Reader.fill(self)
        finally:
            self.origin.applied = self.applied     # the connection's own reader knows the socket's timeout


def _relay_length(n: int, out: bytearray, ur: Reader, c: _Client) -> bool:
    """A large body: the head and what has arrived, then the rest as it comes."""
    buf = ur.buf
    take = min(n, len(buf))
    out += buf[:take]
    del buf[:take]
    n -= take
    c.send(out)
    while n > 0:
        data = ur.read_some(min(n, PIECE))
        n -= len(data)
        c.send(data)
    return True


def _relay_eof(raw: bool, out: bytearray, ur: Reader, c: _Client) -> None:
    """A body delimited by the backend's close -> chunked to an HTTP/1.1 client, else as it is."""
    pending = out
    while True:
        if not ur.buf and not ur.fill():
            break
        data = bytes(ur.buf)
        ur.buf.clear()
        pending += data if raw else b"%x\r\n%s\r\n" % (len(data), data)
        c.send(pending)
        pending = bytearray()
    if not raw:
        pending += b"0\r\n\r\n"
    c.send(pending)


def _relay_chunked(http10: bool, out: bytearray, ur: Reader, c: _Client) -> bool:
    """A chunked body, relayed as it arrives: a chunk goes out in pieces (never read whole first), and
    what was read is sent whenever the next read would wait. Sizes are strict hex; the client gets
    clean chunks of the sizes the edge counted, without extensions (or the bare data, to HTTP/1.0)."""
    pending = out
    while True:
        size = chunk_size(ur.read_line(1024))
        if size < 0:
            raise UpstreamError("protocol", "invalid chunk size")
        if size == 0:
            while ur.read_line(8192):   # trailers: dropped (not announced to the client)
                pass
            if not http10:
                pending += b"0\r\n\r\n"
            c.send(pending)
            return True
        if not http10:
            pending += b"%x\r\n" % size
        while size > 0:
            if not ur.buf and pending:
                c.send(pending)         # about to wait for the backend: flush what we have
                pending = bytearray()
            data = ur.read_some(min(size, PIECE))
            size -= len(data)
            pending += data
            if len(pending) >= PIECE:
                c.send(pending)
                pending = bytearray()
        if ur.read_exact(2) != b"\r\n":
            raise UpstreamError("protocol", "chunk longer than declared")
        if not http10:
            pending += b"\r\n"
        if not ur.buf:
            c.send(pending)
            pending = bytearray()

