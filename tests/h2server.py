"""A scripted h2c backend for the tests: h2's server side over real sockets, one thread per connection.

It misbehaves on command, by path, where a gRPC server library would not: /early answers (END_STREAM)
before the request body ended; the first /goaway gets GOAWAY saying it was never processed, and
the connection closed; /stall is never answered. It records what each stream saw from the edge -- ended by END_STREAM,
reset, or still open -- so a test can see a stream the edge left half-open.
"""

from __future__ import annotations

import socket
import threading

import h2.config
import h2.connection
import h2.events
import h2.settings
from hyperframe.frame import GoAwayFrame


class H2Server:
    def __init__(self, max_streams: int = 100, header_table: int = 4096):
        self.max_streams, self.header_table = max_streams, header_table
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.port = self.lsock.getsockname()[1]
        self.url = f"h2c://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.connections = 0
        self.streams: dict[tuple[int, int], str] = {}     # (connection, stream) -> "open" | "ended" | "reset"
        self.socks: list[socket.socket] = []
        self.sent: dict[tuple[int, int], int] = {}         # (connection, stream) -> DATA bytes sent
        self.went_away = False
        self.closed_by_peer = 0              # connections the edge closed
        self.decoders: list = []             # each connection's HPACK decoder: what the edge's encoder indexed
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                s, _ = self.lsock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                n = self.connections
                self.socks.append(s)
            threading.Thread(target=self._serve, args=(s, n), daemon=True).start()

    def _serve(self, s: socket.socket, n: int):
        c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        c.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams,
            h2.settings.SettingCodes.HEADER_TABLE_SIZE: self.header_table})
        self.decoders.append(c.decoder)
        c.initiate_connection()
        pending: dict[int, int] = {}          # /big streams: bytes still to send
        try:
            s.sendall(c.data_to_send())
            while True:
                data = s.recv(65536)
                if not data:
                    with self.lock:
                        self.closed_by_peer += 1
                    return
                for ev in c.receive_data(data):
                    sid = getattr(ev, "stream_id", None)
                    if isinstance(ev, h2.events.RequestReceived):
                        path = dict(ev.headers).get(b":path", b"")
                        with self.lock:
                            self.streams[(n, sid)] = "ended" if ev.stream_ended else "open"
                        if path.startswith(b"/goaway") and not self.went_away:   # once: this stream unprocessed
                            self.went_away = True
                            c.close_connection(last_stream_id=sid - 2 if sid > 2 else 0)
                            s.sendall(c.data_to_send())
                            return
                        if path.startswith(b"/stall"):
                            continue
                        if path.startswith(b"/big"):        # 4 MB, as the edge's windows allow
                            c.send_headers(sid, [(b":status", b"200")])
                            pending[sid] = 4 << 20
                            continue
                        if path.startswith(b"/bye"):        # GOAWAY past this stream, which is answered; kept open
                            bye = GoAwayFrame(0)          # by hand: h2 sends nothing after its own
                            bye.last_stream_id = sid
                            s.sendall(c.data_to_send() + bye.serialize())
                            c.send_headers(sid, [(b":status", b"200"), (b"content-length", b"2")])
                            c.send_data(sid, b"ok", end_stream=True)
                            continue
                        if path.startswith(b"/early") or ev.stream_ended:
                            c.send_headers(sid, [(b":status", b"200"), (b"content-length", b"2")])
                            c.send_data(sid, b"ok", end_stream=True)
                    elif isinstance(ev, h2.events.DataReceived):
                        c.acknowledge_received_data(ev.flow_controlled_length, sid)
                    elif isinstance(ev, h2.events.StreamEnded):
                        with self.lock:
                            self.streams[(n, sid)] = "ended"
                    elif isinstance(ev, h2.events.StreamReset):
                        pending.pop(sid, None)
                        with self.lock:
                            self.streams[(n, sid)] = "reset"
                for sid, left in list(pending.items()):
                    k = min(c.local_flow_control_window(sid), c.max_outbound_frame_size, left)
                    while k > 0:
                        c.send_data(sid, b"x" * k, end_stream=k == left)
                        left -= k
                        with self.lock:
                            self.sent[(n, sid)] = self.sent.get((n, sid), 0) + k
                        k = min(c.local_flow_control_window(sid), c.max_outbound_frame_size, left)
                    pending[sid] = left
                    if not left:
                        del pending[sid]
                out = c.data_to_send()
                if out:
                    s.sendall(out)
        except (OSError, h2.exceptions.ProtocolError):
            return
        finally:
            s.close()

    def open_streams(self) -> list:
        with self.lock:
            return [k for k, v in self.streams.items() if v == "open"]

    def close(self):
        self.lsock.close()
        with self.lock:
            for s in self.socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
