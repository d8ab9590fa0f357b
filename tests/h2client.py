"""A scripted HTTP/2 client for the tests: h2's state machine over a real socket, with deadlines.

It does what curl and h2load do not: open streams without reading them, reset them at once, flood
control frames, write raw frames (CONTINUATION), and hold its windows shut.
"""

from __future__ import annotations

import socket
import ssl
import time

import h2.config
import h2.connection
import h2.events
import h2.settings


class H2Client:
    def __init__(self, port: int, settings: dict | None = None, ctx: ssl.SSLContext | None = None,
                 timeout: float = 10.0):
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        if ctx is not None:
            sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
        self.sock = sock
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.h2.initiate_connection()
        if settings:
            self.h2.update_settings(settings)
        self.flush()
        self.port = port
        self.responses: dict[int, dict] = {}     # stream -> {"headers", "data", "trailers", "ended", "reset"}
        self.goaway = None                       # the ConnectionTerminated event, once received
        self.closed = False
        self.events: list = []

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def request(self, path: str, method: str = "GET", headers: list | None = None, body: bytes | None = None,
                end: bool = True) -> int:
        sid = self.h2.get_next_available_stream_id()
        fields = [(b":method", method.encode()), (b":path", path.encode()), (b":scheme", b"http"),
                  (b":authority", b"127.0.0.1:%d" % self.port)]
        fields += [(k.encode() if isinstance(k, str) else k, v.encode() if isinstance(v, str) else v)
                   for k, v in (headers or [])]
        self.h2.send_headers(sid, fields, end_stream=end and body is None)
        if body is not None:
            self.h2.send_data(sid, body, end_stream=end)
        self.responses[sid] = {"headers": None, "data": b"", "trailers": None, "ended": False, "reset": None}
        self.flush()
        return sid

    def send_body(self, sid: int, data: bytes, end: bool = True, timeout: float = 10.0) -> None:
        """DATA as the stream's and the connection's windows allow (waiting for WINDOW_UPDATEs)."""
        while data:
            n = self.wait(lambda: min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size, len(data)),
                          timeout, "window")
            self.h2.send_data(sid, data[:n])
            data = data[n:]
            self.flush()
        if end:
            self.h2.end_stream(sid)
            self.flush()

    def pump(self, timeout: float = 0.2, ack: bool = True) -> bool:
        """Read what arrives within timeout and apply it; False once the connection ended."""
        if self.closed:
            return False
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except (socket.timeout, ssl.SSLWantReadError):
            return True
        except OSError:
            self.closed = True
            return False
        if not data:
            self.closed = True
            return False
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            self.closed = True
            return False
        for ev in events:
            self.events.append(ev)
            r = self.responses.get(getattr(ev, "stream_id", None))
            if isinstance(ev, h2.events.ResponseReceived):
                r["headers"] = dict(ev.headers) | {"_list": ev.headers}
            elif isinstance(ev, h2.events.DataReceived):
                r["data"] += ev.data
                if ack and ev.flow_controlled_length:
                    self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.TrailersReceived):
                r["trailers"] = dict(ev.headers)
            elif isinstance(ev, h2.events.StreamEnded):
                r["ended"] = True
            elif isinstance(ev, h2.events.StreamReset):
                if r is not None:
                    r["reset"] = ev.error_code
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self.goaway = ev
        try:
            self.flush()
        except OSError:
            self.closed = True
        return True

    def wait(self, predicate, timeout: float = 10.0, what: str = "condition"):
        end = time.monotonic() + timeout
        while True:
            v = predicate()
            if v:
                return v
            if time.monotonic() > end:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            if not self.pump() and not predicate():
                raise AssertionError(f"connection ended waiting for {what} (goaway: {self.goaway})")

    def response(self, sid: int, timeout: float = 10.0) -> dict:
        r = self.responses[sid]
        return self.wait(lambda: (r["ended"] or r["reset"] is not None) and r, timeout, f"stream {sid}")

    def until_closed(self, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while self.pump(0.5):
            if time.monotonic() > end:
                raise AssertionError(f"connection still open after {timeout}s (goaway: {self.goaway})")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
