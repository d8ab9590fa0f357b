"""The response half of a try: the backend's answer relayed to the client as it arrives (HTTP/1.1's raw
path), then the backend connection back to its pool, passive health told, the access-log line written.

The head for the client is built from the backend's (hop-by-hop and the framing out, the edge's own
headers in); a small body leaves with it, read whole first so a backend failing inside it still gets the
client a clean 502; a large one streams (or is buffered ahead of a slow client: nginx's proxy_buffering).
Once a byte of the body reached the client, a backend failure can only show as a close.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
from time import monotonic

from lb.errors import ClientGone, HttpError, UpstreamError
from lb.http.chunked import CHUNK, CHUNK_END, END, NEED, ChunkedDecoder
from lb.http.framing import (
    NOT_RELAYED,
    NOT_RELAYED_IETF,
    NOT_RELAYED_RID,
    NOT_RELAYED_RID_IETF,
    RESPONSE_NAMES,
    Reader,
    linger,
    not_relayed,
    send,
)
from lb.http.plan import response_plan
from lb.proxy.downstream import SMALL_BODY
from lb.proxy.spool import Spool
from lb.upstream.failures import Failure

log = logging.getLogger("edge")

PIECE = 262144  # the most of a body held at once while relaying
_NO_BODY_STATUS = frozenset({204, 304})


class Relay:
    """The relaying of one Forwarder (its edge's cfg, metrics and buffers, read per call; its observe()
    and failed() for the backend's outcome)."""

    def __init__(self, fw):
        self.fw, self.edge = fw, fw.edge

    def relay(self, x, rh, ur: Reader, uc, down, in_sync: bool = True) -> bool:
        """The response to the client as it arrives, on HTTP/1.1's raw path (down.sock: the head built by
        response_head, the body relayed as the backend sends it), then the backend connection back to its
        pool. The edge writes the framing: the client never sees a Content-Length and a
        Transfer-Encoding together, nor a length the edge did not parse."""
        sock = down.sock
        if sock is None:  # a Downstream without HTTP/1.1's raw path (HTTP/2)
            return self.relay_fields(x, rh, ur, uc, down, in_sync)
        req, backend = x.req, x.backend
        out, mode, client_keep = self.response_head(x, rh, in_sync)
        n = rh.content_length
        if mode == "length" and n <= SMALL_BODY:
            # Read a small body before anything goes to the client: if the backend fails now, the
            # client still gets a clean 502 rather than a truncated response.
            try:
                buf = ur.buf
                if len(buf) == n:  # (the common case: it came with the head; read_exact's copies spared)
                    out += buf
                    buf.clear()
                else:
                    out += ur.read_exact(n)
            except (socket.timeout, OSError, EOFError) as e:
                backend.pool.release(uc, False)
                kind = Failure.TIMEOUT if isinstance(e, socket.timeout) else Failure.RESET
                self.fw.observe(backend, False, f"{kind} inside a response body")
                return self.fw.failed(down, x, kind, "failed inside a response body", req.keep_alive and in_sync)
            mode = "sent-with-head"
        upstream_ok = False
        x.bytes_sent = len(out)
        c = None
        try:
            if mode == "sent-with-head" or mode == "none":
                try:
                    sock.sendall(out)  # (framing.send, without the call: the client's failure is ClientGone)
                except OSError:
                    raise ClientGone() from None
                upstream_ok = True
            else:
                c, ur = self.client_side(sock, rh, ur, backend.url)
                upstream_ok = _relay_body(mode, req.version == b"HTTP/1.0", rh.content_length, out, ur, c)
        except (socket.timeout, UpstreamError, OSError, EOFError, HttpError) as e:
            return self.broken(x, rh.status, e, uc, c, down, in_sync)
        except ClientGone:
            backend.pool.release(uc, False)
            if c is not None:
                c.close()
            raise
        self.relayed(x, rh, ur, uc, c, upstream_ok)
        if not in_sync:
            linger(sock)  # the client may still be sending the body the backend refused
        return client_keep

    def relay_fields(self, x, rh, ur: Reader, uc, down, in_sync: bool) -> bool:
        """The response through the neutral interface (down.start, send, finish): what a Downstream without
        HTTP/1.1's raw path gets. The same rules as the raw path: the fields relayed (relayed_fields), a
        small body read whole before the head leaves (a backend failing inside it is still a clean 502),
        a larger one as it arrives (the downstream's own queue is its buffer); once the head is gone, a
        backend failure is down.abort()."""
        req, backend = x.req, x.backend
        status = rh.status
        mode = _body_mode(req, rh)
        body = b""
        if mode == "length" and rh.content_length <= SMALL_BODY:
            try:
                body = ur.read_exact(rh.content_length)
            except (socket.timeout, OSError, EOFError) as e:
                backend.pool.release(uc, False)
                kind = Failure.TIMEOUT if isinstance(e, socket.timeout) else Failure.RESET
                self.fw.observe(backend, False, f"{kind} inside a response body")
                return self.fw.failed(down, x, kind, "failed inside a response body", req.keep_alive and in_sync)
            mode = "whole"
        length = rh.content_length if mode in ("length", "whole") else (0 if mode == "none" else None)
        started = False
        try:
            down.start(x, status, rh.status_line[13:], relayed_fields(x, rh), length)
            started = True
            if body:
                down.send(body)
            n, upstream_ok = len(body), True
            if mode == "length":
                n += _pull_length(rh.content_length, ur, down)
            elif mode == "chunked":
                n += _pull_chunked(ur, down)
            elif mode == "eof":
                n += _pull_eof(ur, down)
                upstream_ok = False
            down.finish(None)
        except (socket.timeout, UpstreamError, OSError, EOFError, HttpError) as e:
            backend.pool.release(uc, False)
            if not started:
                raise ClientGone() from None  # start() failed: the client's side, not the backend's
            down.abort()
            kind = Failure.TIMEOUT if isinstance(e, socket.timeout) else Failure.RESET
            self.fw.observe(backend, False, f"{kind} mid-response")
            log.warning(
                "backend %s %s mid-response: %s %s (the response is aborted)",
                backend.url,
                kind,
                req.method.decode(),
                req.target[:200].decode("latin-1"),
            )
            self.edge.metrics.upstream_error(backend.url, kind, status, monotonic() - x.start)
            self.edge.record(x, status)
            return False
        except ClientGone:
            backend.pool.release(uc, False)
            raise
        x.bytes_sent = n
        self.relayed(x, rh, ur, uc, None, upstream_ok)
        return req.keep_alive and in_sync and not self.edge.closing

    def response_head(self, x, rh, in_sync: bool) -> tuple[bytearray, str, bool]:
        """(the head for the client, the body's mode, whether the client connection stays open).
        mode: none | length | chunked | eof (delimited by the backend's close) | raw (a coding we do not
        decode, relayed as it came, delimited by the close)."""
        req = x.req
        rl, rid = x.rl, x.rid_header
        # not_relayed(rl, rid), without the call (find, not `in`: framing.py's not_relayed says why)
        if rl.find(b"\nRateLimit: ") >= 0:
            skip = NOT_RELAYED_RID_IETF if rid else NOT_RELAYED_IETF
        else:
            skip = NOT_RELAYED_RID if rid else NOT_RELAYED
        route = x.route
        edit = route.response_edit if route is not None else None  # a route's header rules (lb/proxy/routes.py)
        if edit is None:
            out, mode, client_keep = response_plan(
                rh,
                req.method,
                req.version == b"HTTP/1.0",
                req.keep_alive and in_sync and not self.edge.closing,
                skip,
                bool(rl),
                rid + rl + x.set_cookie,
            )  # (lb/http/plan.py)
        else:
            out, mode, client_keep = response_plan(
                rh,
                req.method,
                req.version == b"HTTP/1.0",
                req.keep_alive and in_sync and not self.edge.closing,
                skip | edit.drop,
                bool(rl),
                edit.render(x) + rid + rl + x.set_cookie,
                not edit.drop <= RESPONSE_NAMES,  # a removed name the parser does not locate
            )
        if rh.status == 101:
            rh.close = True  # no tunnel here (the upgrade path is its own): the backend's side is done too
        return out, mode, client_keep

    def client_side(self, sock, rh, ur: Reader, url: str):
        """(what a large body is written through, the backend reader to read it with): buffered ahead of the
        client (_Buffered, reading through it) or straight (_Client)."""
        cfg = self.edge.cfg
        if _buffered(cfg, rh):
            c = _Buffered(
                sock,
                Spool(self.edge.buffers, cfg.buffer_memory, cfg.max_temp_file_size, cfg.temp_dir),
                cfg.send_timeout,
                url,
            )
            return c, c.reader(ur)
        return _Client(sock), ur

    def broken(self, x, status: int, e: BaseException, uc, c, down, in_sync: bool) -> bool:
        """The backend failed while its body was being relayed: a clean answer if nothing reached the client
        yet, else a close, so the truncation shows."""
        edge = self.edge
        req, backend = x.req, x.backend
        kind = (
            Failure.TIMEOUT
            if isinstance(e, socket.timeout)
            else Failure.PROTOCOL
            if isinstance(e, (UpstreamError, HttpError))
            else Failure.RESET
        )
        backend.pool.release(uc, False)
        if c is not None:
            c.close()  # what is still buffered is never sent: the client sees the truncation
        if c is not None and not c.n and not c.partial:  # nothing reached the client yet: a clean answer
            self.fw.observe(backend, False, f"{kind} before the response body")
            return self.fw.failed(down, x, kind, "failed before the response body", req.keep_alive and in_sync)
        self.fw.observe(backend, False, f"{kind} mid-response")
        log.warning(
            "backend %s %s mid-response: %s %s (closing the client connection)",
            backend.url,
            kind,
            req.method.decode(),
            req.target[:200].decode("latin-1"),
        )
        edge.metrics.upstream_error(backend.url, kind, status, monotonic() - x.start)
        edge.record(x, status)
        return False

    def relayed(self, x, rh, ur: Reader, uc, c, upstream_ok: bool) -> None:
        """The body is relayed: the backend connection back to its pool (reused only when nothing is left
        on it), passive health, the counts and the access-log line."""
        backend = x.backend
        status = rh.status
        reusable = upstream_ok and not rh.close
        if reusable:
            if ur.buf:
                # More than the response (a second one, a body after a HEAD, 204 or 304, a Content-Length
                # too short): never relayed, and the connection is not reused for someone else to read it.
                log.warning(
                    "backend %s sent %d bytes after a complete response: closed, not relayed", backend.url, len(ur.buf)
                )
                reusable = False
            else:
                try:  # ack_now(uc.sock), without the call
                    uc.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
                except OSError:
                    pass
        backend.pool.release(uc, reusable)
        if status >= 500 or backend.fail_run:  # (observe()'s own first test: a success after successes is nothing)
            self.fw.observe(backend, status < 500, rh.status_line)
        now = monotonic()
        x.upstream_seconds = up = now - x.upstream_start
        if c is not None:
            if c.buffered:
                # The backend is done and its connection free: the rest is the client's pace, and no
                # longer the backend's load (least-request, the drain's in-flight count).
                uncount(x)
                c.finish()
            x.bytes_sent = c.n
        edge = self.edge
        # (with the version: answered()'s count too, so logged() rather than record())
        edge.metrics.backend_done(backend.url, status, now - x.start, up, x.req.version)
        edge.logged(x, status)


def relayed_fields(x, rh) -> list[tuple[bytes, bytes]]:
    """The response's fields as the client gets them, without framing (the neutral path's; response_head
    writes the same choice as HTTP/1.1 lines): hop-by-hop and the framing out, the backend's rate-limit
    and request-id fields replaced by the edge's, the sticky cookie added."""
    tokens = rh.conn_tokens
    limiting = bool(x.rl)
    skip = not_relayed(x.rl, x.rid_header)
    edit = x.route.response_edit if x.route is not None else None  # lb/proxy/routes.py
    if edit is not None:
        skip = skip | edit.drop
    out = [
        (name, value)
        for name, lname, value in rh.headers
        if not (lname in skip or (tokens and lname in tokens) or (limiting and lname[:12] == b"x-ratelimit-"))
    ]
    out += _pairs((edit.render(x) if edit is not None else b"") + x.rid_header + x.rl + x.set_cookie)
    return out


def _pairs(lines: bytes) -> list[tuple[bytes, bytes]]:
    pairs = []
    for line in lines.split(b"\r\n"):
        if line:
            name, _, value = line.partition(b":")
            pairs.append((name, value.strip()))
    return pairs


def _body_mode(req, rh) -> str:
    """none | length | chunked | eof (delimited by the backend's close; a coding we do not decode too)."""
    status = rh.status
    if req.method == b"HEAD" or status in _NO_BODY_STATUS or status < 200:
        return "none"
    if rh.content_length is not None:
        return "length"
    return "chunked" if rh.chunked else "eof"


def _pull_length(n: int, ur: Reader, down) -> int:
    total = n
    while n > 0:
        data = ur.read_some(min(n, PIECE))
        n -= len(data)
        down.send(data)
    return total


def _pull_chunked(ur: Reader, down) -> int:
    dec = ChunkedDecoder(_bad_chunk)
    buf = ur.buf
    n = 0
    while True:
        ev = dec.next(buf, PIECE)
        if type(ev) is bytes:
            n += len(ev)
            down.send(ev)
        elif ev == NEED:
            if not ur.fill():
                raise EOFError("closed inside a body")
        elif ev == END:
            return n


def _pull_eof(ur: Reader, down) -> int:
    n = 0
    while ur.buf or ur.fill():
        data = bytes(ur.buf)
        ur.buf.clear()
        n += len(data)
        down.send(data)
    return n


def uncount(x) -> None:
    """The request no longer loads its backend: its in-flight count goes back, once."""
    b, x.counted = x.counted, None
    if b is not None:
        b.lock.acquire()  # (not `with`: half its cost; an int's decrement cannot raise)
        b.inflight -= 1
        b.lock.release()


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
    partial = False  # some bytes may have left though none are counted (a TLS want-write)

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


_TLS_PIECE = 16384  # one TLS record: a send that would block is retried with the same bytes


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
        # bytes being written; after a TLS want-write, retried exactly as they are
        self.piece: bytes | memoryview = b""
        self.streaming = False
        self.tls = type(sock) is not socket.socket
        self.send_timeout = send_timeout
        self.last = monotonic()  # when the client last took a byte (it gets send_timeout between two)
        self.poll: select.poll | None = None
        self.url = url
        self.partial = False
        self.nb = self.tls  # an SSLSocket takes no MSG_DONTWAIT: non-blocking until _blocking()
        if self.tls:
            sock.setblocking(False)

    def reader(self, ur: Reader) -> Reader:
        """ur, as a reader that feeds the client while it waits for the backend (same buffer)."""
        pr = _PumpReader(ur.sock)
        pr.buf, pr.timeout, pr.deadline, pr.applied, pr.send_bound = (
            ur.buf,
            ur.timeout,
            ur.deadline,
            ur.applied,
            ur.send_bound,
        )
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
                log.warning(
                    "response buffer: temp file failed (%s); streaming the rest of a response from backend %s",
                    self.spool.error.strerror or self.spool.error,
                    self.url,
                )
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
            return  # a TLS backend: a record already decrypted, readable now
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
            for fd, _ev in p.poll(wait * 1000):
                if fd == ufd:
                    readable = True
                else:
                    self._push()  # POLLERR/POLLHUP too: the send says what happened
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
    client: _Buffered
    origin: Reader  # the connection's own reader (the same buffer)

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
            self.origin.applied = self.applied  # the connection's own reader knows the socket's timeout


def _relay_body(mode: str, http10: bool, length: int | None, out: bytearray, ur: Reader, c: _Client) -> bool:
    """A body that does not leave with its head, as it arrives; True when the backend's connection ended
    in step (reusable), False when the body was delimited by its close."""
    if mode == "length":
        assert length is not None  # "length": the head had a Content-Length (_body_mode)
        return _relay_length(length, out, ur, c)
    if mode == "chunked":
        return _relay_chunked(http10, out, ur, c)
    _relay_eof(http10 or mode == "raw", out, ur, c)
    return False


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
    """A chunked body (lb/http/chunked.py), relayed as it arrives: a chunk goes out in pieces (never read
    whole first), and what was read is sent whenever the next read would wait. The client gets clean
    chunks of the sizes the edge counted, without extensions or trailers (or the bare data, to HTTP/1.0)."""
    dec = ChunkedDecoder(_bad_chunk)
    buf = ur.buf
    pending = out
    while True:
        ev = dec.next(buf, PIECE)
        if type(ev) is bytes:
            pending += ev
            if len(pending) >= PIECE:
                c.send(pending)
                pending = bytearray()
        elif ev == NEED:  # about to wait for the backend: flush what we have
            if pending:
                c.send(pending)
                pending = bytearray()
            if not ur.fill():
                raise EOFError("closed inside a body")
        elif ev == CHUNK:
            if not http10:
                pending += b"%x\r\n" % dec.size
        elif ev == CHUNK_END:
            if not http10:
                pending += b"\r\n"
        elif ev == END:
            if not http10:
                pending += b"0\r\n\r\n"
            c.send(pending)
            return True


def _bad_chunk(reason: str) -> UpstreamError:
    return UpstreamError("protocol", reason)
