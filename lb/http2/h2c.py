"""One exchange to an h2c:// backend: the request as an HTTP/2 call, the answer relayed as it arrives.

The pipeline has already identified, limited and chosen (per call: the balancer picked this backend
for this request alone). Here: the call opens on the backend's pool (lb/upstream/h2pool.py); the request
body streams to it from the client as it arrives, on a thread of its own, while this one relays the
answer -- both directions at once, as a gRPC bidirectional stream needs. grpc-timeout is the call's
deadline (within response_timeout); a client that resets its stream cancels the backend's.

The answer goes to the exchange's Downstream (start, send, finish with the backend's trailers --
grpc-status, grpc-message, trailing metadata -- abort): an HTTP/2 stream's HEADERS, DATA and trailing
HEADERS, or HTTP/1.1's chunks with the trailers in the last one.
"""

from __future__ import annotations

import logging
import threading
from time import monotonic

from h2.errors import ErrorCodes

from lb.errors import ClientGone, HttpError
from lb.http.framing import HOP_BY_HOP, iter_chunked, iter_fixed, not_relayed
from lb.http2.grpc import parse_timeout
from lb.upstream.failures import Failure
from lb.upstream.h2pool import H2Unavailable

log = logging.getLogger("edge")

_NOT_SENT = HOP_BY_HOP | {b"host", b"content-length", b"x-forwarded-for", b"x-forwarded-proto", b"expect"}
_CHECK = 1.0  # how often a wait for the backend looks at whether the client is still there


def _fields(x, req, peer: bytes, trusted: bool, length) -> list:
    out = [(b":method", req.method), (b":scheme", b"http"), (b":path", req.target), (b":authority", req.host or b"")]
    edit = x.route.request_edit if x.route is not None else None  # a route's header rules (lb/proxy/routes.py)
    drop = edit.drop if edit is not None else ()
    for _, lname, value in req.headers:
        if lname in _NOT_SENT or (x.rid_sent is not None and lname == b"x-request-id") or lname in drop:
            continue
        out.append((lname, value))
    if edit is not None:
        out += [(n.lower(), v) for n, v in _pairs(edit.render(x))]
    out.append((b"te", b"trailers"))  # gRPC servers require it; HTTP/2 allows no other TE
    out.append((b"x-forwarded-for", req.xff + b", " + peer if req.xff else peer))
    if not (trusted and req.proto):
        out.append((b"x-forwarded-proto", x.proto))
    if x.rid_sent is not None:
        out.append((b"x-request-id", x.rid_sent))
    if length is not None:
        out.append((b"content-length", b"%d" % length))
    return out


def _upload(call, pieces, failed: list) -> None:
    """The request body to the backend as the client sends it; a client failure cancels the call."""
    try:
        for piece in pieces:
            if piece:
                call.send(piece)
        call.send(b"", end=True)
    except (HttpError, ClientGone, EOFError, OSError) as e:
        failed.append(e)
        call.reset(ErrorCodes.CANCEL)


def _deadline(req, response_timeout: float) -> float:
    """When the answer must be in: response_timeout, or sooner when the call says grpc-timeout."""
    deadline = monotonic() + response_timeout
    for _, lname, value in req.headers:
        if lname == b"grpc-timeout":
            t = parse_timeout(value)
            if t is not None:
                deadline = min(deadline, monotonic() + t)
    return deadline


def _request_body(reader, req, cfg):
    """(body, pieces): the request body's pieces as they arrive, and the same as body when the whole of it
    is here already (a unary call: read inline, kept for a replay), else body None."""
    reader.timeout, reader.deadline = cfg.body_timeout, None
    pieces = (
        iter_chunked(reader, cfg.max_body_size, cfg.body_min_rate)
        if req.chunked
        else iter_fixed(reader, req.content_length, cfg.body_min_rate)
    )
    st = getattr(reader, "stream", None)
    return (pieces if st is not None and st.body_end else None), pieces


def forward(edge, x, backend, conn, down) -> bool:
    """Forward x.req to the h2c backend and relay its answer to `down` (start, send, finish: any
    Downstream); True when the client connection may carry another request (HTTP/2 ignores it)."""
    reader, peer, trusted = conn.reader, conn.peer, conn.peer_trusted
    cfg = edge.cfg
    req = x.req
    fw = edge.forwarder
    has_body = req.chunked or bool(req.content_length)
    keep = req.keep_alive and not edge.closing
    deadline = _deadline(req, cfg.response_timeout)
    x.upstream_start = monotonic()
    stream = getattr(down, "stream", None)  # an HTTP/2 client's stream: its reset cancels the call
    budget = edge.retry_budget
    budget.start()
    held = False
    tried: list = []
    try:
        fields = _fields(x, req, peer, trusted, req.content_length if not req.chunked else None)
        body, pieces = _request_body(reader, req, cfg) if has_body else (None, None)
        replays = 1  # a call the backend refused unprocessed (GOAWAY, REFUSED_STREAM) is tried again
        while True:
            while True:
                x.counted = backend
                with backend.lock:
                    backend.inflight += 1
                try:
                    call = backend.h2.open_call(fields, end=not has_body)
                    break
                except OSError as e:  # H2Unavailable too: nothing was sent
                    why = str(e) if isinstance(e, H2Unavailable) else (e.strerror or type(e).__name__)
                    pool = "stream limit" in why
                    uncount(x)
                    tried.append(backend)
                    nxt = None
                    if not pool:  # ours, not the backend's: no failure counted, no retry
                        fw.observe(backend, False, why)
                        nxt, budgeted, refused = fw.next_try(backend, tried, held)
                        why += refused
                    if nxt is None or nxt.h2 is None:
                        return fw.failed(
                            down, x, Failure.POOL if pool else Failure.CONNECT, why, keep and not has_body, tried
                        )
                    held = held or budgeted
                    fw.retrying(x, backend, "connect", why, "connect", nxt, len(tried))  # as HTTP/1.1's connect retry
                    backend = nxt
            failed: list = []
            if body is not None:
                try:
                    body = list(body)
                except (HttpError, ClientGone, EOFError, OSError) as e:
                    failed.append(e)
                    call.reset(ErrorCodes.CANCEL)
                else:
                    _upload(call, body, failed)  # all of it already here (a unary call): no thread for it
            elif has_body:
                threading.Thread(target=_upload, args=(call, pieces, failed), daemon=True, name="h2c upload").start()
            refusable = replays > 0 and not failed and (body is not None or not has_body)
            keep_on = _relay(edge, x, backend, call, down, stream, deadline, failed, keep, refusable)
            if keep_on is not _REFUSED:
                return keep_on
            replays -= 1
            uncount(x)
            log.warning(
                "backend %s refused a call unprocessed; trying it again: %s %s",
                backend.url,
                req.method.decode(),
                req.target[:200].decode("latin-1"),
            )
    finally:
        uncount(x)
        budget.end(held)


def _relay(edge, x, backend, call, down, stream, deadline: float, failed: list, keep: bool, refusable: bool = False):
    """The answer to `down`; _REFUSED (nothing relayed, nothing counted) when refusable and the backend
    said it never processed the call: RFC 9113 8.7, safe to try again whatever the method."""
    fw = edge.forwarder
    req = x.req
    status = None
    sent = 0
    idle = edge.cfg.read_timeout
    last = monotonic()
    try:
        while True:
            now = monotonic()
            if stream is not None and stream.reset:
                call.reset(ErrorCodes.CANCEL)
                raise ClientGone()
            left = min(deadline - now, last + idle - now)
            if left <= 0:
                return _timed_out(fw, x, backend, call, down, status, deadline - now <= 0, keep and not failed)
            ev = call.get(min(left, _CHECK))
            if ev is None:
                continue
            last = monotonic()
            kind = ev[0]
            if kind == "headers":
                fields = ev[1]
                try:
                    status = int(dict(fields).get(b":status", b"0"))
                except ValueError:
                    status = 0
                if not 200 <= status < 600:
                    call.reset(ErrorCodes.PROTOCOL_ERROR)
                    fw.observe(backend, False, "bad :status")
                    return fw.failed(down, x, Failure.PROTOCOL, "bad :status", keep)
                x.upstream_status = status
                out = _head_fields(x, fields)
                if ev[2] or req.method == b"HEAD" or status in (204, 304):
                    down.start(x, status, _phrase(status), out, 0)
                    if not ev[2]:
                        call.reset(ErrorCodes.CANCEL)  # no body is relayed: nothing more is wanted
                    break
                down.start(x, status, _phrase(status), out, None)
            elif kind == "data":
                data, n = ev[1], ev[2]
                if data:
                    down.send(data)  # blocks while the client is slow: its stream only
                    sent += len(data)
                if n:
                    call.ack(n)  # the window back only once the client took it
            elif kind == "trailers":
                down.finish([(name, value) for name, value in ev[1] if name[:1] != b":" and name not in HOP_BY_HOP])
                break
            elif kind == "end":
                down.finish(None)
                break
            else:  # reset or closed
                if (
                    status is None
                    and refusable
                    and (kind == "refused" or (kind == "reset" and ev[1] == ErrorCodes.REFUSED_STREAM))
                ):
                    return _REFUSED
                why = f"backend reset the stream ({ev[1]})" if kind == "reset" else str(ev[1])
                if status is None:
                    fw.observe(backend, False, why)
                    return fw.failed(down, x, Failure.RESET, why, keep and not failed)
                raise _Cut(why)
    except (_Cut, ClientGone) as e:
        call.reset(ErrorCodes.CANCEL)
        if isinstance(e, _Cut):
            return _cut_short(edge, x, backend, down, status, e)
        if x.status is None:
            edge.client_closed(x, reached=True)
        raise ClientGone() from None
    finally:
        call.conn.finished(call)
    x.bytes_sent = sent
    if failed and isinstance(failed[0], HttpError):
        keep = False  # the upload failed on the client's side: its connection is not reusable
    _completed(edge, x, backend, status)
    return keep


def _head_fields(x, fields) -> list:
    """The backend's response fields as the client gets them: no pseudo-headers, no framing (the Downstream
    writes its own), none the edge sets itself, and the edge's own lines (request id, rate limit, cookie)."""
    skip = not_relayed(x.rl, x.rid_header)
    edit = x.route.response_edit if x.route is not None else None  # a route's header rules (lb/proxy/routes.py)
    if edit is not None:
        skip = skip | edit.drop
    limiting = bool(x.rl)
    out = [
        (name, value)
        for name, value in fields
        if name[:1] != b":"
        and name not in skip
        and name not in _FRAMING
        and not (limiting and name[:12] == b"x-ratelimit-")
    ]
    return out + _pairs((edit.render(x) if edit is not None else b"") + x.rid_header + x.rl + x.set_cookie)


def _cut_short(edge, x, backend, down, status, e) -> bool:
    """The backend failed after the head went out: counted as its failure, and the client's stream aborted."""
    req = x.req
    edge.forwarder.observe(backend, False, str(e))
    log.warning(
        "backend %s %s mid-response: %s %s", backend.url, e, req.method.decode(), req.target[:200].decode("latin-1")
    )
    edge.metrics.upstream_error(backend.url, Failure.RESET, status, monotonic() - x.start)
    edge.record(x, status)
    down.abort()  # the client must see the answer cut short
    return False


def _completed(edge, x, backend, status) -> None:
    """A whole answer relayed: the backend's outcome to the balancer, and the exchange's timings and record."""
    edge.forwarder.observe(backend, status < 500, f"HTTP/2 {status}")
    now = monotonic()
    x.upstream_seconds = now - x.upstream_start
    edge.metrics.backend_done(backend.url, status, now - x.start, x.upstream_seconds)
    edge.record(x, status)


def uncount(x) -> None:
    """The call no longer loads its backend (least-request, the drain): its in-flight count back, once
    (lb/proxy/forward.py's, which this room sits below)."""
    b, x.counted = x.counted, None
    if b is not None:
        with b.lock:
            b.inflight -= 1


_REFUSED = object()


def _timed_out(fw, x, backend, call, down, status, deadline_passed: bool, keep: bool) -> bool:
    """The call ran out of time: a 504 before its head (the backend's failure), a cut answer after it."""
    call.reset(ErrorCodes.CANCEL)
    why = "the call's deadline (grpc-timeout) passed" if deadline_passed else "no response within the read timeout"
    if status is None:
        fw.observe(backend, False, why)
        return fw.failed(down, x, Failure.TIMEOUT, why, keep)
    raise _Cut(why)


class _Cut(OSError):
    """The backend failed after the head went to the client: only a reset can show it."""


_FRAMING = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-connection",
    }
)  # the Downstream writes its own framing


def _pairs(lines: bytes) -> list[tuple[bytes, bytes]]:
    """The exchange's own header lines (request id, rate-limit headers, Set-Cookie) as fields."""
    out = []
    for line in lines.split(b"\r\n"):
        if line:
            name, _, value = line.partition(b":")
            out.append((name, value.strip()))
    return out


def _phrase(status: int) -> bytes:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Status"
