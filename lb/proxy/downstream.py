"""Where one exchange's response goes: the codec side of the pipeline (lb/proxy/pipeline.py).

A Downstream encodes; it decides nothing. The pipeline and the forwarder say what to answer (the edge's
own replies are built by lb/proxy/replies.py), the Downstream writes it in its protocol:

    proto                                    b"HTTP/1.1" | b"HTTP/2": the access log's field, a metrics label
    local_reply(x, status, reason, keep)     the edge's own answer; True when the connection may carry another
    start(x, status, reason, headers, length) a response head: headers [(name, value)] without framing;
                                             length: the body's bytes that follow (0: none; None: until finish)
    send(data)                               body bytes; blocks while the client is slow (back-pressure)
    finish(trailers)                         the end of the body
    abort()                                  the backend failed after start: the response cannot be completed
    start, send and finish raise ClientGone when the client (or its stream) is gone.
    read_body(x)                             the request body, read only now (HTTP/1.1 invites it: 100-continue)
    hold(delay)                              delay mode's wait, watching for the client going away

HTTP/1.1's H1Downstream also keeps the raw path the forwarder relays on (conn.sock: a head built from
slices of the backend's, the body as it arrives) -- it is the budgeted request path; start/send/finish are
what HTTP/2 and gRPC use, and what any new producer of a response should use.
"""

from __future__ import annotations

import logging
import select
import socket
import tempfile
import time
from itertools import chain
from time import monotonic

from lb.errors import ClientGone, HttpError
from lb.http.framing import body_deadline, iter_chunked, iter_fixed, linger, send
from lb.proxy import replies
from lb.proxy.spool import Spool, SpooledBody

log = logging.getLogger("edge")

SMALL_BODY = 65536  # bodies up to this are read whole and sent with their head, both ways


class NotBuffered(HttpError):
    """A request body the edge could not buffer (its temp file failed): a 503, logged once, at ERROR."""


class Downstream:
    """The interface (and what every codec shares). record(x, status): the access-log line, written when
    the outcome is known and before the last byte leaves (Edge.record)."""

    proto = b"HTTP/1.1"
    sock: socket.socket | None = (
        None  # HTTP/1.1's raw path (lb/proxy/relay.py); None: responses go through start/send/finish
    )

    def local_reply(self, x, status: int, reason: str, keep: bool, linger: bool = False) -> bool:
        raise NotImplementedError

    def start(self, x, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], length: int | None) -> None:
        raise NotImplementedError

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def finish(self, trailers: list[tuple[bytes, bytes]] | None = None) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """The response cannot be completed (the backend failed after start): HTTP/2 resets the stream.
        (HTTP/1.1's raw path closes the connection instead.)"""

    def read_body(self, x):
        return b""

    def hold(self, delay: float) -> None:
        time.sleep(delay)


class H1Downstream(Downstream):
    """HTTP/1.1 on one client connection (one per connection, reused by each request on it)."""

    __slots__ = ("conn", "edge", "sock", "chunked")
    proto = b"HTTP/1.1"
    sock: socket.socket  # always: the raw path is HTTP/1.1's

    def __init__(self, conn, edge):
        self.conn, self.edge, self.sock = conn, edge, conn.sock
        self.chunked = False

    def local_reply(self, x, status: int, reason: str, keep: bool, linger: bool = False) -> bool:
        """The reply built by lb/proxy/replies.py, logged, then sent. linger: the request's body may still be
        arriving, so a close is a lingering one (not a reset that could overtake the answer)."""
        data = replies.h1(replies.build(x, status, reason, keep))
        x.bytes_sent = len(data)
        self.edge.record(x, status)
        send(self.sock, data)
        if linger and not keep:
            _linger(self.sock)
        return keep

    def start(self, x, status, reason, headers, length) -> None:
        out = bytearray(b"HTTP/1.1 %d %s\r\n" % (status, reason))
        for name, value in headers:
            out += name + b": " + value + b"\r\n"
        self.chunked = length is None
        out += b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
        if not x.req.keep_alive or self.edge.closing:
            out += b"Connection: close\r\n"
        out += b"\r\n"
        send(self.sock, out)

    def send(self, data: bytes) -> None:
        if data:
            send(self.sock, b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)

    def finish(self, trailers=None) -> None:
        if self.chunked:
            send(self.sock, b"0\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in trailers or ()) + b"\r\n")

    def hold(self, delay: float) -> None:
        watch_while_held(self.sock, delay)

    def read_body(self, x):
        """The body as bytes when it is small; else (request buffering) a SpooledBody read whole, or
        (--request-buffering off) an iterator of its pieces (the first already read). A silence is 408,
        an end is ClientGone; bad framing and 413 are HttpError; a spool that failed is NotBuffered."""
        req = x.req
        if req.expect_continue:
            send(self.sock, b"HTTP/1.1 100 Continue\r\n\r\n")
        cfg = self.edge.cfg
        reader = self.conn.reader
        reader.timeout = cfg.body_timeout
        reader.deadline = None
        rate = cfg.body_min_rate
        try:
            if not req.chunked:
                n = req.content_length
                if n <= SMALL_BODY:
                    if rate:
                        body_deadline(reader, monotonic(), n, rate)  # the whole of it, at least at rate
                    return reader.read_exact(n)
                it = iter_fixed(reader, n, rate)
                return self._spool(it, cfg) if cfg.request_buffering else it
            it = iter_chunked(reader, cfg.max_body_size, rate)
            parts, n = [], 0
            for piece in it:
                parts.append(piece)
                n += len(piece)
                if n > SMALL_BODY:
                    if cfg.request_buffering:
                        return self._spool(chain(parts, it), cfg)
                    return chain(parts, it)  # too large to hold: stream the rest as it arrives
            return b"".join(parts)
        except socket.timeout:
            raise HttpError(408, "request body not received in time") from None
        except (EOFError, OSError):
            raise ClientGone() from None

    def _spool(self, pieces, cfg) -> SpooledBody:
        """nginx's proxy_request_buffering: the whole body, in memory then a temp file (up to
        max_body_size, which the framing already enforces), before any backend connection is taken.
        A temp file that cannot be written (a full disk) is a 503: the edge's trouble, worth a retry
        elsewhere or later, not a fault of the request (507 is WebDAV's, and says the request is too
        big to store, which it is not)."""
        spool = Spool(self.edge.buffers, cfg.buffer_memory, cfg.max_body_size, cfg.temp_dir)
        try:
            for piece in pieces:
                if not spool.write(piece):
                    e = spool.error
                    why = (e.strerror or str(e)) if e is not None else "no room"
                    log.error(
                        "request buffer: temp file in %s failed (%s): 503", cfg.temp_dir or tempfile.gettempdir(), why
                    )
                    raise NotBuffered(503, f"request body could not be buffered ({why})")
            return SpooledBody(spool)
        except BaseException:
            spool.close()
            raise


_linger = linger


def watch_while_held(sock: socket.socket, delay: float) -> None:
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
