"""One try on one backend: the request head as the backend sees it, a pooled connection, head and body
out, the response head in -- or an UpstreamFailed that says how it failed (lb/upstream/failures.py) and
whether any byte of the request left (then it is not retried elsewhere).

  upstream_head()  the request head as the backend sees it (the edge writes the framing itself)
  attempt()        the try: (connection, response head, reader), the connection released on every raise,
                   so a caller may try another backend (retries, hedging) or take a 101 elsewhere (a tunnel)

The byte-level rules (parsing, limits, chunk syntax) are lb/http/framing.py's.
"""

from __future__ import annotations

import socket
import ssl
from time import monotonic

from urllib3.exceptions import ClosedPoolError
from urllib3.exceptions import HTTPError as Urllib3Error

from lb.errors import ClientGone, HttpError, PoolExhausted, UpstreamError
from lb.http.framing import HOP_BY_HOP, MAX_HEAD, REQUEST_NAMES, Reader, Request, parse_response
from lb.http.plan import request_head
from lb.netaddr import hostport
from lb.proxy.spool import SpooledBody
from lb.upstream.backends import Backend
from lb.upstream.failures import Failure

IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})

# Never copied from a message: hop-by-hop, and the framing the edge writes itself from what it parsed.
# X-Forwarded-Client-Cert is the edge's to write (mutual TLS): a client's own copy never reaches a
# backend, with or without client certificates configured (Envoy's forward_client_cert_details SANITIZE).
_NOT_COPIED = HOP_BY_HOP | {b"content-length", b"x-forwarded-client-cert"}
# Forwarding headers we write ourselves (after the client's), and Expect, which the edge answered.
_REPLACED = _NOT_COPIED | {b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"expect"}
_REPLACED_TRUSTED = _NOT_COPIED | {b"x-forwarded-for", b"expect"}
_REQUEST_ID_HEADER = frozenset({b"x-request-id"})
# ... and with the client's X-Request-Id, when the edge writes its own (made at import, not per request)
_REPLACED_RID = _REPLACED | _REQUEST_ID_HEADER
_REPLACED_TRUSTED_RID = _REPLACED_TRUSTED | _REQUEST_ID_HEADER


class UpstreamFailed(Exception):
    """One try on one backend failed before any response byte reached the client.

    kind: a Failure (lb/upstream/failures.py), which carries what the client gets (kind.status);
    sent: whether any byte of the request had been written to the backend (if not, it may be retried).
    """

    def __init__(self, kind: Failure, detail: str, sent: bool = False):
        super().__init__(detail)
        self.kind, self.detail, self.sent = kind, detail, sent

    also_tried = ()  # other backends this try reached (a failed hedge, lb/proxy/hedge.py): not retried on

    @property
    def status(self) -> int:
        return self.kind.status


def upstream_head(x, backend: Backend, conn, cfg, length: int | None) -> bytearray:
    """The request as the backend sees it: hop-by-hop headers out, forwarding headers appended, and
    exactly one framing header, the edge's: Content-Length `length`, else chunked if the body is.
    x: the Exchange (x.req, the scheme it came by, an allowed upgrade, the request id the edge made up, the
    route's edits); conn: the client connection (its address, whether it is a trusted proxy); cfg: the
    configuration (no_pool: Connection: close; allow_underscores).

    X-Forwarded-Proto/-Host from a trusted proxy (a TLS terminator in front) are passed on as they
    are; from anyone else they are replaced with what the edge saw. request_id: the id the edge made
    up (the client sent none, or a malformed one), which replaces the client's X-Request-Id.

    A field name with '_' is not forwarded unless `underscores` (nginx's underscores_in_headers off,
    its default): CGI-style backends read X_Forwarded_For and X-Forwarded-For as one HTTP_X_FORWARDED_FOR,
    so a client could slip its own beside the edge's. The edge itself never reads such a name as its
    dashed twin (parse_request matches exact names).
    """
    req = x.req
    peer, trusted, proto, request_id = conn.peer, conn.peer_trusted, x.proto, x.rid_sent
    underscores = cfg.allow_underscores
    if request_id is None:
        replaced = _REPLACED if not trusted else _REPLACED_TRUSTED
    else:
        replaced = _REPLACED_RID if not trusted else _REPLACED_TRUSTED_RID
    route = x.route
    edit = route.request_edit if route is not None else None  # lb/proxy/routes.py
    slow = False
    if edit is not None:
        replaced = replaced | edit.drop
        slow = not edit.drop <= REQUEST_NAMES  # a removed name the parser does not locate
    # A head the connection's memo remembers (the same bytes again) whose first part -- the request line,
    # the client's fields, X-Forwarded-* -- was written before for the same inputs: those bytes again.
    sent = req.sent
    if (
        sent is not None
        and sent[0] is replaced
        and sent[1] == length
        and sent[2] == peer
        and sent[3] == proto
        and sent[4] is underscores  # (trust is in `replaced`: one of four sets when it is kept)
    ):
        out = bytearray(sent[5])
        length = sent[6]
    else:
        out, still = _first_part(req, backend, peer, trusted, proto, replaced, underscores, length, slow)
        if sent is not None and edit is None and req.host:  # (no Host: the line is the backend's)
            sent[:] = replaced, length, peer, proto, underscores, bytes(out), still
        length = still
    if request_id is not None:
        out += b"X-Request-Id: " + request_id + b"\r\n"
    if req.client_cert is not None:
        out += b"X-Forwarded-Client-Cert: " + req.client_cert.xfcc + b"\r\n"
    if edit is not None:
        out += edit.render(x)
    if length is not None:
        out += b"Content-Length: %d\r\n" % length
    elif req.chunked:
        out += b"Transfer-Encoding: chunked\r\n"
    upgrade = x.upgrade
    if upgrade:  # an allowed upgrade (lb/proxy/tunnel.py): the one exception to hop-by-hop stripping
        out += b"Upgrade: " + upgrade + b"\r\nConnection: Upgrade\r\n"
    elif cfg.no_pool:
        out += b"Connection: close\r\n"
    out += b"\r\n"
    return out


def _first_part(
    req: Request,
    backend: Backend,
    peer: bytes,
    trusted: bool,
    proto: bytes,
    replaced: frozenset,
    underscores: bool,
    length: int | None,
    slow: bool,
) -> tuple[bytearray, int | None]:
    """upstream_head's head up to the edge's X-Request-Id: the request line and the client's fields
    (lb/http/plan.py; Connection's tokens never name Host or the framing), then X-Forwarded-*; and
    `length` if it is still to be written."""
    out, length = request_head(req, replaced, underscores, length, slow)
    host = req.host
    if not host:  # HTTP/1.0 without Host: HTTP/1.1 to the backend requires one
        out += b"Host: " + hostport(backend.spec.host, backend.spec.port).encode() + b"\r\n"
    out += b"X-Forwarded-For: "
    if req.xff:
        out += req.xff
        out += b", "
    out += peer
    if not (trusted and req.proto):
        out += b"\r\nX-Forwarded-Proto: "  # https when it came over our TLS
        out += proto
    if host and not (trusted and req.fwd_host):
        out += b"\r\nX-Forwarded-Host: "
        out += host
    out += b"\r\n"
    return out, length


def classify(e: BaseException, reused: bool) -> tuple[Failure, str]:
    """(kind, detail) for a failure before any response byte reached the client."""
    if isinstance(e, UpstreamError):
        return Failure(e.kind), e.detail  # type: ignore[call-arg]  # a lookup by value (EnumType.__call__), not __new__
    name = type(e).__name__
    if isinstance(e, ssl.SSLError) and not reused:  # an https:// backend's handshake or certificate
        if isinstance(e, ssl.SSLCertVerificationError):
            return Failure.CONNECT, f"TLS: certificate verify failed ({e.verify_message})"
        return Failure.CONNECT, "TLS: " + str(getattr(e, "reason", None) or e).replace("_", " ").lower()
    if isinstance(e, Urllib3Error):  # raised by connect(): refused, unreachable, connect timeout
        return Failure.CONNECT, name
    if isinstance(e, (socket.timeout, BlockingIOError)):  # BlockingIOError: SO_SNDTIMEO (httpio.kernel_timeout)
        return Failure.TIMEOUT, "no response within the read timeout"
    if isinstance(e, ConnectionRefusedError):
        return Failure.CONNECT, "connection refused"
    return Failure.RESET, (e.strerror or name) if isinstance(e, OSError) else name


def _send_streamed(up: socket.socket, head: bytes | bytearray, body, chunked: bool) -> None:
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
    except (PoolExhausted, ClosedPoolError) as e:
        raise _no_slot(e) from None


def _no_slot(e: Exception) -> UpstreamFailed:
    """No connection from the pool: all busy (PoolExhausted), or the pool closed by a reload."""
    if isinstance(e, PoolExhausted):
        return UpstreamFailed(Failure.POOL, str(e))
    return UpstreamFailed(Failure.GONE, "removed by a reload")


def attempt(cfg, x, backend: Backend, head: bytes | bytearray, body, wait=None):
    """One try on `backend`: (conn, response head, reader) once a final (or 101) head arrived.
    wait(ur): called once the request is sent, before its head is read (lb/proxy/hedge.py's race);
    what it raises fails the try as a read would.

    Raises UpstreamFailed (the backend's fault, nothing sent to the client yet), ClientGone or
    HttpError (a streamed request body failed: the client's fault). The connection is released
    on every raise. A kept-alive connection the backend had already closed is retried once on a
    new connection when that is safe (a replayable body, an idempotent method).
    """
    req = x.req
    pool = backend.pool
    replayable = type(body) is bytes or isinstance(body, SpooledBody)
    read_timeout, per_try = cfg.read_timeout, cfg.per_try_timeout
    try:  # (_acquire's, inline: once per request)
        conn = pool.acquire()
    except (PoolExhausted, ClosedPoolError) as e:
        raise _no_slot(e) from None
    retried = False
    while True:
        reused = (up := conn.sock) is not None
        send_err = None  # why sending failed, if it did
        ur = conn.reader
        if not reused or ur is None or ur.sock is not up or ur.applied != read_timeout:
            up, ur = _connected(pool, conn, reused, read_timeout)  # (a kept connection's Reader as it was: no call)
        try:
            # Where an HTTP/2 client's reset finds it (Exchange.abandon); once closed, the socket ignores it.
            x.upstream_sock = up
            if x.abandoned:  # reset before this: nothing sent (the flag is set before the socket is read)
                raise ClientGone()
            if type(body) is bytes:  # (_send_request's first case, without the call)
                up.sendall(head + body if body else head)
            else:
                _send_request(up, head, body, replayable, req.chunked)
        except (HttpError, ClientGone):
            pool.release(conn, False)
            raise
        except OSError as e:
            send_err = e  # the backend stopped reading: it may have answered early (its 413)
        # After a failed send only an answer already there counts: read it without waiting long.
        ur.timeout = (per_try if 0 < per_try < read_timeout else read_timeout) if send_err is None else 0.5
        # The whole response within response_timeout of the backend having the request (Envoy's route
        # timeout starts at the request's end): a slow upload or a delay-mode hold is not the backend's.
        ur.deadline = monotonic() + cfg.response_timeout
        try:
            if wait is not None and send_err is None:
                wait(ur)
            rhead = ur.read_head(MAX_HEAD, 8192, "response")  # (positional: no keyword matching per request)
            while rhead is not None and rhead[9:10] == b"1" and rhead[9:12] != b"101":
                rhead = ur.read_head(max_first_line=8192, what="response")  # interim 1xx: not relayed
            if rhead is None:
                raise UpstreamError("reset", "closed the connection without a response")
            rh = parse_response(rhead, ur.memo)  # (the connection's last head, not parsed again)
            x.upstream_status = rh.status  # the access log's upstream_status
            if per_try:
                ur.timeout = read_timeout  # the body's reads: the per-try bound is the head's
            x.upstream_sock = None  # off the exchange before the relay may pool it
            if x.abandoned:  # a reset came meanwhile: it may have shut the socket
                raise UpstreamError("reset", "the client reset its stream")
        except HttpError as e:
            pool.release(conn, False)
            raise (ClientGone() if x.abandoned else _head_refused(e)) from None
        except (OSError, UpstreamError) as e:
            pool.release(conn, False)
            if x.abandoned:  # the client's reset shut the socket: not the backend's failure
                raise ClientGone() from None
            f = _failed_before_head(send_err or e, send_err is not None, reused, per_try, read_timeout)
            if f.kind is Failure.RESET and reused and not retried and replayable and req.method in IDEMPOTENT:
                # A kept-alive connection the backend had already closed: nothing was processed.
                # If the fresh connection cannot connect either, that is a connect failure like any
                # other, retried elsewhere (the spec's exception for this idempotent retry).
                retried = True
                conn = _acquire(pool, fresh=True)
                continue
            raise f from None
        if send_err is not None:
            rh.early = True
            rh.close = True  # the request was not sent whole: this connection is done
        return conn, rh, ur


def _connected(pool, conn, reused: bool, read_timeout: float):
    """(socket, Reader) of a connection, connected if it was not; a failure is retryable (nothing was sent)."""
    try:
        if not reused:
            conn.connect()
        up = conn.sock
        # One Reader per backend connection, kept with it: its timeout is set once, not per request.
        ur = conn.reader
        if ur is None or ur.sock is not up:
            ur = conn.reader = Reader(up)
        if ur.applied != read_timeout:
            ur.apply(read_timeout)
    except (OSError, Urllib3Error) as e:
        pool.release(conn, False)
        raise UpstreamFailed(*classify(e, reused)) from None
    return up, ur


def _send_request(up, head: bytes | bytearray, body, replayable: bool, chunked: bool) -> None:
    if type(body) is bytes:
        up.sendall(head + body if body else head)
    elif replayable:
        up.sendall(head)  # a buffered body, from its first byte on every try
        for piece in body.pieces():
            up.sendall(piece)
    else:
        _send_streamed(up, head, body, chunked)


def _head_refused(e: HttpError) -> UpstreamFailed:
    """Our reader's limits and its "closed inside the head", hit by a *response* head."""
    if e.status in (414, 431):
        return UpstreamFailed(Failure.PROTOCOL, "response head too large", True)
    if e.reason.startswith("bare CR"):
        return UpstreamFailed(Failure.PROTOCOL, e.reason, True)
    return UpstreamFailed(Failure.RESET, "closed the connection inside the response head", True)


def _failed_before_head(
    e: BaseException, in_send: bool, reused: bool, per_try: float, read_timeout: float
) -> UpstreamFailed:
    """No response head: why, from the error of the send (in_send: the backend stopped reading the
    request) or of the read."""
    if in_send and isinstance(e, (socket.timeout, BlockingIOError)):  # BlockingIOError: SO_SNDTIMEO
        return UpstreamFailed(Failure.TIMEOUT, "stopped reading the request body", True)
    kind, detail = classify(e, reused)
    if (
        kind is Failure.TIMEOUT
        and 0 < per_try < read_timeout
        and isinstance(e, socket.timeout)
        and str(e) != "deadline"
    ):
        detail = f"no response head within the per-try timeout ({per_try:g}s)"
    return UpstreamFailed(kind, detail, True)
