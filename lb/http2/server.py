"""HTTP/2 from clients: cleartext by prior knowledge, or over TLS by ALPN.

One thread per connection (the listener's, as for HTTP/1.1) drives the h2 state machine and is the only
one that reads or writes the socket (an SSL object must not be read and written from two threads). Each
stream's request runs the edge's pipeline on a worker of a bounded pool; a worker hands its response to
the stream (start, send, finish) and the connection thread sends it as its flow-control windows allow.
A stream's queued response is bounded (STREAM_BUFFER): past it its worker waits, so a client that does
not read one stream holds up that stream's backend, never the other streams; a stream that makes no
progress for send_timeout is reset.

What a peer can make the edge do without asking for work is bounded too (lb/http2/guard.py): resets
(rapid reset, CVE-2023-44487) and control frames (PING/SETTINGS/PRIORITY/WINDOW_UPDATE floods) spend per-connection allowances,
and past them the connection gets GOAWAY ENHANCE_YOUR_CALM; streams still running after their client
reset them count against max_concurrent_streams, so resets cannot start unbounded backend work; header
blocks are bounded by SETTINGS_MAX_HEADER_LIST_SIZE (an HPACK bomb) and by h2's limit on CONTINUATION
frames (CVE-2024-27316's class).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from time import monotonic

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame

from lb.errors import ClientGone, HttpError
from lb.http.framing import MAX_HEAD, Reader, linger, request_from_fields
from lb.http.h2frames import take_goaways
from lb.http.hpacktable import cap_encoder_table
from lb.http2 import grpc
from lb.http2.bridge import StreamSocket
from lb.http2.downstream import H2Downstream
from lb.http2.guard import (
    CONTROL_BURST,
    CONTROL_RATE,
    NOPROGRESS_BURST,
    NOPROGRESS_PER_REQUEST,
    NOPROGRESS_RATE,
    RESET_BURST,
    RESET_RATE,
    Allowance,
)
from lb.http2.writer import FrameWriter
from lb.logs import client_fault

log = logging.getLogger("edge")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
STREAM_BUFFER = 256 * 1024  # response bytes one stream may have queued before its worker waits
CONN_WINDOW = 1 << 24  # the connection's receive window: no stream's unread body blocks the others
STREAM_WINDOW = 1 << 16  # each stream's receive window (a request body's back-pressure)
WORKERS = 512  # streams being served at once, over every connection of the process
TICK = 1.0  # the connection thread's longest sleep (timeouts, the drain)

_pool: ThreadPoolExecutor | None = None
_slots = threading.BoundedSemaphore(WORKERS)
_pool_lock = threading.Lock()


def _workers() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="h2-stream")
    return _pool


def _reset_pool_after_fork() -> None:
    global _pool, _slots
    _pool, _slots = None, threading.BoundedSemaphore(WORKERS)


os.register_at_fork(after_in_child=_reset_pool_after_fork)


class Stream:
    """One request/response exchange on a connection: its queues, which H2Downstream
    (lb/http2/downstream.py) writes the response into and the connection thread sends from."""

    proto = b"HTTP/2"

    def __init__(self, conn: "Connection", sid: int):
        self.conn, self.sid = conn, sid
        self.body: deque = deque()  # request DATA not yet read by the worker
        self.body_end = False
        self.unacked = 0  # flow-controlled bytes received, not yet given back as window
        self.reset = False  # by the client, or by us
        self.out: deque = deque()  # response: ("h", fields, end) | bytes | ("end",) | ("t", trailers)
        self.out_n = 0  # bytes of DATA queued in out
        self.sent_end = False  # END_STREAM is on its way
        self.progress = monotonic()  # when the client last took some of this stream's bytes
        self.grpc = False
        self.on_reset = None  # called at the client's RST_STREAM (lb/proxy/edge.py: Exchange.abandon)
        # Its worker's waits (window, body, the end): on the connection's lock, but woken alone -- one
        # condition for all streams woke every worker at each pump (half the GIL's time under h2load).
        self.cv = threading.Condition(conn.lock)

    # -- what H2Downstream calls ---------------------------------------------------------------------------

    def headers(self, status: int, fields: list, end: bool = False) -> None:
        self._put(("h", [(b":status", b"%d" % status)] + fields, end), 0)

    def send(self, data: bytes) -> None:
        if data:
            self._put(data, len(data))

    def finish(self, trailers: list | None = None) -> None:
        self._put(("t", trailers) if trailers else ("end",), 0)

    def _put(self, item, n: int) -> None:
        c = self.conn
        timeout = c.edge.cfg.send_timeout
        with c.cv:
            while self.out_n > STREAM_BUFFER and not self.reset:
                left = self.progress + timeout - monotonic()
                if left <= 0:
                    c.reset_stream(self, ErrorCodes.CANCEL)  # the client stopped reading this stream
                    break
                self.cv.wait(min(left, TICK))
            if self.reset:
                raise ConnectionResetError("stream reset")
            self.out.append(item)
            self.out_n += n
            if len(self.out) == 1:
                self.progress = monotonic()
            c.ready[self.sid] = self
        c.wake()

    def drained(self) -> bool:
        """Wait until everything queued left (or the stream was reset, or stalled past send_timeout)."""
        c = self.conn
        timeout = c.edge.cfg.send_timeout
        with c.cv:
            while (self.out or not self.sent_end) and not self.reset:
                left = self.progress + timeout - monotonic()
                if left <= 0:
                    c.reset_stream(self, ErrorCodes.CANCEL)
                    break
                self.cv.wait(min(left, TICK))
            return not self.reset


class StreamReader(Reader):
    """A stream's request body as the pipeline's Reader reads it: DATA as it arrives (re-chunked when the
    request carries no length, so the HTTP/1.1 path reads it as a chunked body); each read gives the
    client its window back, so an unread body back-pressures that stream alone."""

    __slots__ = ("stream", "chunked", "ended")

    def __init__(self, stream: Stream, chunked: bool):
        Reader.__init__(self, None)  # type: ignore[arg-type]  # no socket: fill() and apply() are a stream's
        self.stream, self.chunked, self.ended = stream, chunked, False

    def apply(self, t) -> None:
        self.applied = t

    def fill(self) -> bool:
        st = self.stream
        c = st.conn
        while True:
            t = self.timeout
            if self.deadline is not None:
                left = self.deadline - monotonic()
                if left <= 0:
                    raise socket.timeout("deadline")
                t = left if t is None or left < t else t
            end_at = None if t is None else monotonic() + t
            with c.cv:
                while not st.body and not st.body_end and not st.reset:
                    rest = None if end_at is None else end_at - monotonic()
                    if rest is not None and rest <= 0:
                        raise socket.timeout("timed out")
                    st.cv.wait(TICK if rest is None else min(rest, TICK))
                if st.reset:
                    raise ConnectionResetError("stream reset")
                data = b"".join(st.body)
                st.body.clear()
                end = st.body_end
                n, st.unacked = st.unacked, 0
                if n:
                    c.ack(st.sid, n)
            if n:
                c.wake()
            out = data
            if self.chunked:
                out = b"%x\r\n%s\r\n" % (len(data), data) if data else b""
                if end and not self.ended:
                    out += b"0\r\n\r\n"
            if end:
                self.ended = True
            if out:
                self.buf += out
                self.got += len(data)
                return True
            if end:
                return False


class Connection:
    """One client connection speaking HTTP/2."""

    def __init__(self, edge, sock, peer_ip: str, over_tls: bool, accepted, cert, first: bytes = b""):
        self.edge, self.sock, self.peer_ip, self.over_tls, self.cert = edge, sock, peer_ip, over_tls, cert
        self.accepted = accepted or sock
        self.first = first
        self.lock = threading.Lock()  # the h2 state machine, and every stream's state
        self.cv = threading.Condition(self.lock)
        self.streams: dict[int, Stream] = {}
        self.ready: dict[int, Stream] = {}  # streams with output queued
        self.running = 0  # streams whose worker has not returned (reset ones too)
        self.writer = FrameWriter(self)  # the frames on their way to the socket
        self.wfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.goaway = False  # ours sent, or the client's received: no new streams
        self._closed = False
        self.inbuf = bytearray()  # received, not yet a whole frame (lb/http/h2frames.py)
        self.preface_left = len(PREFACE)
        now = monotonic()
        self.resets = Allowance(RESET_BURST, RESET_RATE, now)
        self.control = Allowance(CONTROL_BURST, CONTROL_RATE, now)
        self.noprogress = Allowance(NOPROGRESS_BURST, NOPROGRESS_RATE, now)  # PRIORITY, WINDOW_UPDATE
        cfg = edge.cfg
        self.max_streams = cfg.http2_max_concurrent_streams
        self.h2 = _state_machine(self.max_streams)

    # -- called by workers (and the connection thread), self.cv held where it says so ------------------

    def wake(self) -> None:
        try:
            os.eventfd_write(self.wfd, 1)
        except OSError:
            pass

    def ack(self, sid: int, n: int) -> None:
        """(cv held) n bytes of a stream's body were read: window back to the client."""
        try:
            self.h2.acknowledge_received_data(n, sid)
        except (h2.exceptions.ProtocolError, KeyError):
            pass

    def reset_stream(self, st: Stream, code) -> None:
        """(cv held) End a stream from our side; its worker sees `reset` at its next read or write."""
        if not st.reset:
            st.reset = True
            try:
                self.h2.reset_stream(st.sid, code)
            except h2.exceptions.ProtocolError:
                pass
            self.ready.pop(st.sid, None)
            st.cv.notify_all()
        self.wake()

    # -- the connection thread ---------------------------------------------------------------------------

    def serve(self) -> None:
        edge, sock = self.edge, self.sock
        edge.metrics.inc("lb_http2_connections_total")
        sock.setblocking(False)
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.register(self.wfd, select.POLLIN)
        with self.cv:
            self.h2.initiate_connection()
            self.h2.increment_flow_control_window(CONN_WINDOW - 65535)
        conns = edge.conns
        idle = edge.idle
        conns[sock] = True
        cfg = edge.cfg
        idle_since = monotonic()
        idle_limit = cfg.header_timeout  # the first stream within header_timeout, then keepalive_timeout
        stalled_since = None
        writing = 0  # the poll mask last registered
        try:
            if self.first:
                if not self._receive(self.first):
                    return
            while True:
                self.writer.pump()
                if not self.writer.write():
                    return
                now = monotonic()
                with self.cv:
                    busy = self.running > 0
                if busy:
                    idle_since = now
                    conns[sock] = True
                    idle.pop(sock, None)
                else:
                    conns[sock] = False
                    if sock not in idle:
                        idle[sock] = (idle_since, self.accepted)  # at max_connections, closed first (evict_idle)
                    if self.goaway and not self.writer.buf:
                        return
                    if now - idle_since > idle_limit:
                        _go_away(self, ErrorCodes.NO_ERROR)
                        self.writer.write()
                        return
                if edge.closing and not self.goaway:
                    _go_away(self, ErrorCodes.NO_ERROR)  # SIGTERM: finish the streams open, take no more
                    continue
                if self.writer.buf:
                    stalled_since = stalled_since or now
                    if now - stalled_since > cfg.send_timeout:
                        client_fault(
                            "client %s: HTTP/2 connection not read for %gs; closed", self.peer_ip, cfg.send_timeout
                        )
                        return
                else:
                    stalled_since = None
                want = select.POLLIN | (select.POLLOUT if self.writer.buf else 0)
                if want != writing:
                    poller.modify(sock, want)
                    writing = want
                if _wait(poller, sock, self.wfd, self.over_tls):
                    data = self._recv()
                    if data is None:
                        continue
                    if not data:
                        return
                    if not self._receive(data):
                        self.writer.write()
                        return
                    if idle_limit != cfg.keepalive_timeout and self.streams:
                        idle_limit = cfg.keepalive_timeout
        except OSError:
            pass
        finally:
            self._close()

    def _close(self) -> None:
        """(the connection thread, at its end) Every stream told, the socket out of the edge's tables."""
        sock = self.sock
        if self.goaway and not self.writer.buf:
            # What the peer sent after our GOAWAY is read and dropped for a moment: a close with
            # unread bytes is a reset, which can destroy the GOAWAY before the peer reads it.
            linger(sock, 1.0, 1 << 20)
        self.edge.conns.pop(sock, None)
        self.edge.idle.pop(sock, None)
        with self.cv:
            for st in list(self.streams.values()):
                st.reset = True
                st.cv.notify_all()
                _abandon(st)  # the client is gone: its backends freed as at a reset
            self.goaway = True
            self._closed = True  # the last worker to end closes the wake-up fd
            close_now = self.running == 0
        if close_now:
            os.close(self.wfd)

    def _recv(self):
        """Bytes read, b"" at the end, None when there was nothing after all (a TLS record part)."""
        try:
            return self.sock.recv(65536)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except OSError:
            return b""

    def _receive(self, data: bytes) -> bool:
        """Feed the state machine; False when the connection is to end (after what was queued is sent)."""
        now = monotonic()
        with self.cv:
            head = b""
            if self.preface_left:  # the preface is no frame: h2's as it is
                head, data = data[: self.preface_left], data[self.preface_left :]
                self.preface_left -= len(head)
            data, goaways = take_goaways(self.inbuf, data, self.h2.max_inbound_frame_size)
            try:
                events = self.h2.receive_data(head + data)
            except h2.exceptions.ProtocolError as e:
                # h2 queued the GOAWAY (its code: PROTOCOL_ERROR, FRAME_SIZE_ERROR, ENHANCE_YOUR_CALM for
                # an oversized header list...); we only say why.
                client_fault("client %s: HTTP/2 protocol error: %s", self.peer_ip, e)
                self.goaway = True
                self.edge.metrics.inc("lb_http2_goaways_total", reason=type(e).__name__)
                return False
        calm = None
        for ev in events:
            t = type(ev)
            if t is h2.events.RequestReceived:
                self.noprogress.earn(NOPROGRESS_PER_REQUEST)
                self._request(ev)
            elif t is h2.events.DataReceived:
                with self.cv:
                    st = self.streams.get(ev.stream_id)
                    if st is None or st.reset:
                        self.ack(ev.stream_id, ev.flow_controlled_length)  # the connection's window back
                    else:
                        st.body.append(ev.data)
                        st.unacked += ev.flow_controlled_length
                        st.cv.notify_all()
                if not ev.data and not ev.stream_ended and not self.control.take(now):
                    calm = "empty DATA frames"
            elif t is h2.events.StreamEnded:
                with self.cv:
                    st = self.streams.get(ev.stream_id)
                    if st is not None:
                        st.body_end = True
                        st.cv.notify_all()
            elif t is h2.events.StreamReset:
                with self.cv:
                    st = self.streams.get(ev.stream_id)
                    if st is not None:
                        st.reset = True
                        self.ready.pop(st.sid, None)
                        st.cv.notify_all()
                        _abandon(st)
                self.edge.metrics.inc("lb_http2_streams_total", outcome="reset by client")
                if not self.resets.take(now):
                    calm = "too many stream resets"
            elif t in (h2.events.PingReceived, h2.events.RemoteSettingsChanged, h2.events.UnknownFrameReceived):
                if t is h2.events.RemoteSettingsChanged:
                    with self.cv:
                        cap_encoder_table(self.h2)
                if not self.control.take(now):
                    calm = "too many control frames"
            elif t is h2.events.PriorityUpdated or t is h2.events.WindowUpdated:
                if not self.noprogress.take(now):
                    calm = "too many PRIORITY/WINDOW_UPDATE frames"
            elif t is h2.events.TrailersReceived:
                pass  # a request's trailers: not carried to an HTTP/1.1 backend
            elif t is h2.events.ConnectionTerminated:
                self.goaway = True
                return False
        for _, code in goaways:
            # The client's GOAWAY (after the streams it opened before it): it opens no more, those open
            # are still answered -- h2 would have ended the connection with them. One with an error
            # code ends the connection, as h2 would.
            self.goaway = True
            if code != ErrorCodes.NO_ERROR:
                return False
        if calm is not None:
            client_fault("client %s: HTTP/2 %s: GOAWAY ENHANCE_YOUR_CALM", self.peer_ip, calm)
            _go_away(self, ErrorCodes.ENHANCE_YOUR_CALM, calm)
            return False
        return True

    def _request(self, ev) -> None:
        sid = ev.stream_id
        edge = self.edge
        st = Stream(self, sid)
        if self.goaway:
            with self.cv:
                self.reset_stream(st, ErrorCodes.REFUSED_STREAM)
            return
        with self.cv:
            # Streams reset by the client whose work still runs count too: resets cannot start more.
            full = self.running >= self.max_streams
            if not full:
                full = not _slots.acquire(blocking=False)
            if full:
                self.reset_stream(st, ErrorCodes.REFUSED_STREAM)
        if full:
            edge.metrics.inc("lb_http2_streams_total", outcome="refused")
            if not self.resets.take(monotonic()):
                _go_away(self, ErrorCodes.ENHANCE_YOUR_CALM, "too many refused streams")
            return
        method, path, authority, ctype, fields = _request_head(ev.headers)
        st.grpc = grpc.is_grpc(ctype)
        ended = ev.stream_ended is not None
        with self.cv:
            self.streams[sid] = st
            self.running += 1
            if ended:
                st.body_end = True
        try:
            req = request_from_fields(method or b"", path or b"", authority, fields)
            if ended and req.content_length:
                # h2 checks a length against the DATA that came, not against none at all (RFC 9113 8.1.1:
                # malformed); unchecked, the pipeline waited for a body that cannot come, then said 499.
                raise HttpError(400, "Content-Length but the stream ended without a body")
        except HttpError as e:
            _workers().submit(_refuse_stream, self, st, e)
            return
        req.client_cert = self.cert
        if not ended and req.content_length is None:
            req.chunked = True
        _workers().submit(_serve_stream, self, st, req)

    def _ended(self, st: Stream) -> None:
        with self.cv:
            if not st.reset and not st.body_end:
                # Answered before the request's body ended (a 413, a 429): the rest is not wanted
                # (RFC 9113 8.1: RST_STREAM NO_ERROR), and what arrived unread is window back.
                self.reset_stream(st, ErrorCodes.NO_ERROR)
            if st.unacked:
                self.ack(st.sid, st.unacked)
                st.unacked = 0
            self.streams.pop(st.sid, None)
            self.running -= 1
            last = self.running == 0 and self._closed
        _slots.release()
        if last:
            try:
                os.close(self.wfd)
            except OSError:
                pass
        else:
            self.wake()


def _wait(poller, sock, wfd: int, over_tls: bool) -> bool:
    """The connection thread's sleep, at most TICK: True when the socket has bytes to read (a worker's
    wake-up only ends the sleep, so queued output is pumped)."""
    if over_tls and sock.pending():
        return True  # decrypted bytes already inside the SSL object: poll would not see them
    readable = False
    for fd, ev in poller.poll(TICK * 1000):
        if fd == wfd:
            try:
                os.eventfd_read(wfd)
            except OSError:
                pass
        elif ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
            readable = True
    return readable


def _state_machine(max_streams: int):
    """h2's server side as the edge runs it: no push, bounded header lists, per-stream receive windows."""
    config = h2.config.H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=True)
    h = h2.connection.H2Connection(config)
    h.local_settings = h2.settings.Settings(
        client=False,
        initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEAD,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
        },
    )
    # Advertised max_concurrent_streams is ours to enforce: a stream past it is refused alone
    # (REFUSED_STREAM, as nginx does) where h2 would end the whole connection. So h2's own bound is
    # raised once the client acknowledged the advertised one (a pending local value applies on ACK).
    h.local_settings.max_concurrent_streams = 1 << 20
    return h


def _request_head(headers) -> tuple:
    """A HEADERS block -> (method, path, authority, content-type, the regular fields in order)."""
    method = path = authority = None
    ctype = None
    fields = []
    for name, value in headers:
        if name[:1] == b":":
            if name == b":method":
                method = value
            elif name == b":path":
                path = value
            elif name == b":authority":
                authority = value
        else:
            if name == b"content-type":
                ctype = value
            fields.append((name, value))
    return method, path, authority, ctype, fields


# -- a worker --------------------------------------------------------------------------------------


def _refuse_stream(conn: Connection, st: Stream, e: HttpError) -> None:
    """Fields that could not make a request: the edge's own refusal, written into the stream."""
    sock = StreamSocket(st, False)
    try:
        conn.edge._refuse(sock, e.status, e.reason, conn.peer_ip)
        sock.close_out()
        st.drained()
    except OSError:
        pass
    finally:
        sock.close()
        conn._ended(st)


def _abandon(st: Stream) -> None:
    """The client reset the stream (or left): its backend exchange freed now (lb/proxy/exchange.py's
    abandon: a flag and a socket shutdown, neither of which blocks, so it may run under the lock)."""
    if st.on_reset is not None:
        st.on_reset()


def _serve_stream(conn: Connection, st: Stream, req) -> None:
    """One stream's request through the edge's pipeline; reset unless its answer went out whole."""
    edge = conn.edge
    codec = H2Downstream(st, edge, req.method == b"HEAD")
    try:
        if st.reset:
            return
        reader = StreamReader(st, req.chunked)
        try:
            edge.handle_stream(req, codec, reader, conn.peer_ip, conn.over_tls, conn.cert, conn.accepted)
        except ClientGone:
            pass
        if codec.complete:
            if st.drained():
                edge.metrics.inc("lb_http2_streams_total", outcome="served")
        else:
            with conn.cv:
                conn.reset_stream(st, ErrorCodes.INTERNAL_ERROR if not st.reset else ErrorCodes.CANCEL)
    except OSError:
        pass
    except Exception:
        log.exception("HTTP/2 stream %d from %s: unexpected error", st.sid, conn.peer_ip)
        with conn.cv:
            conn.reset_stream(st, ErrorCodes.INTERNAL_ERROR)
    finally:
        conn._ended(st)


def serve(edge, sock, peer_ip: str, over_tls: bool, accepted=None, cert=None, first: bytes = b"") -> None:
    """Serve one client connection in HTTP/2 (the preface is in `first` or still to come)."""
    Connection(edge, sock, peer_ip, over_tls, accepted, cert, first).serve()


def _go_away(conn: Connection, code, why: str | None = None) -> None:
    """(the connection thread) GOAWAY. NO_ERROR is the graceful one (a drain, an idle connection): the
    streams open go on to their end, new ones are refused. h2 has no such state -- after its own
    close_connection() nothing more may be sent -- so that frame is written here, past h2."""
    with conn.cv:
        if not conn.goaway:
            conn.goaway = True
            if code == ErrorCodes.NO_ERROR:
                f = GoAwayFrame(0)
                f.last_stream_id = conn.h2.highest_inbound_stream_id
                f.error_code = code
                conn.writer.buf += conn.h2.data_to_send()
                conn.writer.buf += f.serialize()
                return
            try:
                conn.h2.close_connection(code, additional_data=why.encode() if why else None)
            except h2.exceptions.ProtocolError:
                pass
    if code == ErrorCodes.ENHANCE_YOUR_CALM:
        conn.edge.metrics.inc("lb_http2_goaways_total", reason=why or "calm")
