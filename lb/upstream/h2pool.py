"""An h2c:// backend's connections: HTTP/2 by prior knowledge, a few connections, many calls on each.

A call takes the connection with the fewest calls in flight that is below the backend's
SETTINGS_MAX_CONCURRENT_STREAMS, and a new connection only when every one is full (up to MAX_CONNS):
a gRPC backend sees a handful of connections however many calls the edge multiplexes onto them. The
balancing is per call (the pipeline picks the backend for each), never per connection.

Each connection has a reader thread that applies what arrives and hands each stream's events to its
Call (a queue); writers take the connection's lock. A call's DATA is acknowledged (window given back)
only when its consumer has passed it on to the client, so a slow client holds back its own stream on
the backend, never the connection's other streams.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes

from lb.http.h2frames import take_goaways
from lb.http.hpacktable import cap_encoder_table

log = logging.getLogger("edge")

MAX_CONNS = 4  # connections per backend (each carries up to its peer's stream limit)
MAX_STREAMS = 1000  # our own bound on calls per connection, whatever the peer allows
WINDOW = 1 << 20  # receive window, per stream and (x16) per connection


class H2Unavailable(OSError):
    """No call could be opened: connect failed, or every connection is full."""


class Call:
    """One stream to the backend. events(): ("headers", fields, ended) | ("data", bytes, n) |
    ("trailers", fields) | ("end",) | ("reset", code) | ("closed", why) | ("refused", why): the
    backend's GOAWAY said it never processed this stream."""

    __slots__ = ("conn", "sid", "q", "done", "unacked")
    q: queue.SimpleQueue[tuple]  # the events, as the connection's reader puts them

    def __init__(self, conn: "H2UpConn", sid: int):
        self.conn, self.sid, self.q, self.done = conn, sid, queue.SimpleQueue(), False
        self.unacked = 0  # DATA received (queued or being relayed) not yet given back as window

    def get(self, timeout: float | None):
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return None

    def send(self, data: bytes, end: bool = False, timeout: float = 30.0) -> None:
        self.conn.send_data(self, data, end, timeout)

    def ack(self, n: int) -> None:
        self.conn.ack(self, n)

    def reset(self, code=ErrorCodes.CANCEL) -> None:
        self.conn.reset(self, code)


class H2UpConn:
    def __init__(self, host: str, port: int, connect_timeout: float, url: str):
        self.url = url
        self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None, validate_inbound_headers=True)
        )
        self.cv = threading.Condition(threading.Lock())
        self.calls: dict[int, Call] = {}
        self.dead = False
        self.goaway = False
        self.inbuf = bytearray()  # received, not yet a complete frame
        with self.cv:
            self.h2.local_settings = h2.settings.Settings(
                client=True,
                initial_values={
                    h2.settings.SettingCodes.ENABLE_PUSH: 0,
                    h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW,
                    h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 1 << 16,
                },
            )
            self.h2.initiate_connection()
            self.h2.increment_flow_control_window(16 * WINDOW - 65535)
            self._flush()
        threading.Thread(target=self._read_loop, name=f"h2c {url}", daemon=True).start()

    @property
    def capacity(self) -> int:
        return min(self.h2.remote_settings.max_concurrent_streams, MAX_STREAMS)

    def usable(self) -> bool:
        return not self.dead and not self.goaway and len(self.calls) < self.capacity

    def _flush(self) -> None:
        """(cv held) What the state machine has queued, to the socket."""
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def open(self, fields: list, end: bool) -> Call:
        with self.cv:
            if self.dead or self.goaway:
                raise H2Unavailable("connection closing")
            sid = self.h2.get_next_available_stream_id()
            call = self.calls[sid] = Call(self, sid)
            try:
                self.h2.send_headers(sid, fields, end_stream=end)
                self._flush()
            except h2.exceptions.TooManyStreamsError:
                self.calls.pop(sid, None)  # the connection is full, not broken: its calls go on
                raise H2Unavailable("HTTP/2 connection at its stream limit") from None
            except (OSError, h2.exceptions.ProtocolError) as e:
                self.calls.pop(sid, None)
                self.dead = True
                raise H2Unavailable(str(e) or type(e).__name__) from None
            return call

    def send_data(self, call: Call, data: bytes, end: bool, timeout: float) -> None:
        """Within the stream's and the connection's windows, waiting (at most `timeout` per wait) for them."""
        h = self.h2
        view = memoryview(data)
        with self.cv:
            while True:
                if self.dead or call.done or call.sid not in self.calls:
                    raise ConnectionResetError("backend stream closed")
                if not view:
                    if end:
                        h.end_stream(call.sid)
                        self._flush()
                    return
                try:
                    n = min(h.local_flow_control_window(call.sid), h.max_outbound_frame_size, len(view))
                except h2.exceptions.ProtocolError:
                    raise ConnectionResetError("backend stream closed") from None
                if n <= 0:
                    if not self.cv.wait(timeout):
                        raise TimeoutError("backend window stayed shut")
                    continue
                h.send_data(call.sid, bytes(view[:n]), end_stream=end and n == len(view))
                self._flush()
                view = view[n:]
                if not view:
                    return

    def ack(self, call: Call, n: int) -> None:
        with self.cv:
            n = min(n, call.unacked)  # (what _close_ours gave back already is not given twice)
            if n <= 0:
                return
            call.unacked -= n
            try:
                self.h2.acknowledge_received_data(n, call.sid)
                self._flush()
            except (OSError, h2.exceptions.ProtocolError):
                pass

    def reset(self, call: Call, code) -> None:
        """The client cancelled (or we gave up): the backend's stream is cancelled too."""
        with self.cv:
            self.calls.pop(call.sid, None)
            call.done = True
            self._close_ours(call, code)

    def finished(self, call: Call) -> None:
        """The answer is relayed. A request still uploading when the backend ended its answer (it answered
        early) is cancelled: its stream is closed on our side too, or it stays half-open and counts
        against the backend's SETTINGS_MAX_CONCURRENT_STREAMS (h2 then refuses the next call)."""
        with self.cv:
            call.done = True
            self.calls.pop(call.sid, None)
            self._close_ours(call, ErrorCodes.CANCEL)

    def _close_ours(self, call: Call, code) -> None:
        """(cv held) RST_STREAM unless the stream is closed already (the call popped from `calls` when
        the backend ended its side, which does not close ours). And what the call received but never
        relayed (a client gone mid-answer) is the connection's window back: unreturned, every such call
        shrank the connection's window for good, until no call on it could receive a byte."""
        sid, n, call.unacked = call.sid, call.unacked, 0
        st = self.h2.streams.get(sid)
        try:
            if st is not None and not st.closed:
                self.h2.reset_stream(sid, code)
        except h2.exceptions.ProtocolError:
            pass
        try:
            if n:
                self.h2.acknowledge_received_data(n, sid)  # (a closed stream's: the connection's alone)
            self._flush()
        except (OSError, h2.exceptions.ProtocolError):
            pass

    def _read_loop(self) -> None:
        why = "closed by the backend"
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                with self.cv:
                    data, goaways = take_goaways(self.inbuf, data, self.h2.max_inbound_frame_size)
                    for last, _ in goaways:
                        self._went_away(last)
                    events = self.h2.receive_data(data) if data else []
                    for ev in events:
                        self._event(ev)
                    self._flush()
                    self.cv.notify_all()
                    if self.goaway and not self.calls:
                        why = "went away (GOAWAY), its calls done"
                        break  # ours to close: the backend waits for us to (RFC 9113 6.8)
        except (OSError, h2.exceptions.ProtocolError) as e:
            why = f"{type(e).__name__}: {e}"
        finally:
            with self.cv:
                self.dead = True
                calls, self.calls = list(self.calls.values()), {}
                self.cv.notify_all()
            for c in calls:
                c.q.put(("closed", why))
            try:
                self.sock.close()
            except OSError:
                pass

    def _went_away(self, last: int) -> None:
        """(cv held) The backend's GOAWAY: no more calls here; those past `last` were never processed."""
        self.goaway = True
        for sid, c in list(self.calls.items()):
            if sid > last:  # never processed: the caller may try it elsewhere
                self.calls.pop(sid, None)
                c.q.put(("refused", "GOAWAY before it was processed"))

    def _event(self, ev) -> None:
        """(cv held) One event, to its call."""
        t = type(ev)
        if t is h2.events.ConnectionTerminated:  # (GOAWAYs are taken before h2: lb/http/h2frames.py)
            self._went_away(ev.last_stream_id or 0)
            return
        if t is h2.events.RemoteSettingsChanged:
            cap_encoder_table(self.h2)  # however big a table the backend allows
            return
        sid: int = getattr(ev, "stream_id", 0)  # 0 (or none): a connection's event
        c = self.calls.get(sid) if sid else None
        if c is None:
            if t is h2.events.DataReceived and ev.flow_controlled_length:
                self.h2.acknowledge_received_data(ev.flow_controlled_length, sid)  # a cancelled call's
            return
        if t is h2.events.ResponseReceived:
            c.q.put(("headers", ev.headers, ev.stream_ended is not None))
        elif t is h2.events.InformationalResponseReceived:
            pass
        elif t is h2.events.DataReceived:
            c.unacked += ev.flow_controlled_length
            c.q.put(("data", ev.data, ev.flow_controlled_length))
        elif t is h2.events.TrailersReceived:
            c.q.put(("trailers", ev.headers))
        elif t is h2.events.StreamEnded:
            self.calls.pop(sid, None)
            c.q.put(("end",))
        elif t is h2.events.StreamReset:
            self.calls.pop(sid, None)
            c.q.put(("reset", ev.error_code))

    def close(self) -> None:
        with self.cv:
            self.dead = True
            try:
                self.h2.close_connection()
                self._flush()
            except (OSError, h2.exceptions.ProtocolError):
                pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class H2Upstream:
    """The calls to one h2c:// backend."""

    def __init__(self, host: str, port: int, connect_timeout: float, url: str):
        self.host, self.port, self.connect_timeout, self.url = host, port, connect_timeout, url
        self.lock = threading.Lock()
        self.conns: list[H2UpConn] = []
        self.closed = False

    def open_call(self, fields: list, end: bool) -> Call:
        with self.lock:
            if self.closed:
                raise H2Unavailable("removed by a reload")
            self.conns = [c for c in self.conns if not c.dead and not (c.goaway and not c.calls)]
            ok = [c for c in self.conns if c.usable()]
            conn = min(ok, key=lambda c: len(c.calls)) if ok else None
            if conn is None:
                if len(self.conns) >= MAX_CONNS:
                    raise H2Unavailable(f"all {MAX_CONNS} HTTP/2 connections at their stream limit")
                conn = H2UpConn(self.host, self.port, self.connect_timeout, self.url)  # OSError: connect
                self.conns.append(conn)
        return conn.open(fields, end)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            conns, self.conns = self.conns, []
        for c in conns:
            c.close()
