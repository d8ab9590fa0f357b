"""A stream whose fields could not make a Request is refused by the listener's own refusal (Edge._refuse,
which writes HTTP/1.1 to a socket, having no Exchange nor Downstream): StreamSocket stands where that
socket would be, reads the HTTP/1.1 answer written to it and hands it to the stream's codec
(lb/http2/downstream.py). It is a socket.socket (an unconnected UDP one, never used for I/O) so that
socket.socket's own methods called on a client socket get a harmless answer. Every other answer goes
through the pipeline's Downstream (lb/proxy/h2stream.py) and never comes here.
"""

from __future__ import annotations

import socket

from lb.errors import UpstreamError
from lb.http.framing import parse_response
from lb.http2.downstream import H2Downstream

_GRPC_BODY = 1024  # the text of an answer of the edge's own kept for grpc-message


class StreamSocket(socket.socket):
    def __init__(self, stream, head_only: bool):
        super().__init__(socket.AF_INET, socket.SOCK_DGRAM)
        self.stream = stream
        self.down = H2Downstream(stream, None, head_only)
        self.head_only = head_only  # a HEAD request: the head says a length, no body follows
        self.buf = bytearray()
        self.mode = "head"  # head | length | chunked | eof | grpc | done
        self.left = 0  # bytes of the body (length) or of the chunk (chunked) to come
        self.chunk = "size"  # chunked: size | data | crlf | trailer
        self.grpc_status = 0
        self.grpc_fields: list = []
        self.chunked = False
        self._text = b""
        self.trailers: list = []

    # -- what the pipeline calls ---------------------------------------------------------------------

    def sendall(self, data, flags=0):
        self._feed(bytes(data))

    def send(self, data, flags=0):
        self._feed(bytes(data))
        return len(data)

    def settimeout(self, t):
        pass

    def setblocking(self, flag):
        pass

    def gettimeout(self):
        return None

    def recv(self, n, flags=0):
        return b""  # a lingering close reads to the end: there is none to read

    # -- HTTP/1.1 in, HTTP/2 out ---------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        st = self.stream
        if st.reset:
            raise ConnectionResetError("stream reset")
        if self.mode == "done":
            return
        self.buf += data
        if self.mode == "head":
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(self.buf[:i])
            del self.buf[: i + 4]
            self._start(head)
        self._body()

    def _start(self, head: bytes) -> None:
        try:
            rh = parse_response(head)
        except UpstreamError:
            raise ConnectionResetError("unreadable response head") from None
        headers = [(lname, value) for _, lname, value in rh.headers if not (rh.conn_tokens and lname in rh.conn_tokens)]
        status = rh.status
        no_body = self.head_only or status in (204, 304) or status < 200
        if rh.chunked:
            headers = [f for f in headers if f[0] != b"content-length"]
        if self.stream.grpc and status != 200:
            # An answer of the edge's own (or an HTTP/1.1 backend's error) to a gRPC client: trailers-only
            # once its text is read (the grpc-message).
            self.grpc_status, self.grpc_fields = status, headers
            self.mode, self.left = "grpc", (0 if no_body else (rh.content_length or 0))
            self.chunked = rh.chunked and not no_body
            return
        if no_body or (rh.content_length == 0 and not rh.chunked):
            self.down.start(None, status, b"", headers, 0)
            self.mode = "done"
            return
        self.down.start(None, status, b"", headers, None if rh.chunked else rh.content_length)
        if rh.chunked:
            self.mode = "chunked"
        elif rh.content_length is not None:
            self.mode, self.left = "length", rh.content_length
        else:
            self.mode = "eof"

    def _body(self) -> None:
        buf = self.buf
        mode = self.mode
        if mode == "length":
            if buf:
                take = bytes(buf[: self.left])
                del buf[: len(take)]
                self.left -= len(take)
                self.down.send(take)
                if not self.left:
                    self._finish()
        elif mode == "eof":
            if buf:
                data = bytes(buf)
                buf.clear()
                self.down.send(data)
        elif mode == "chunked":
            self._chunks(self.down.send)
        elif mode == "grpc":
            if self.chunked:
                self._chunks(self._grpc_text)
            elif len(buf) >= self.left:
                self._grpc_done(bytes(buf[: self.left]))

    def _chunks(self, out) -> None:
        """The edge writes clean chunks (sizes it counted, no extensions), split anywhere across writes."""
        buf = self.buf
        while buf:
            if self.chunk == "size":
                i = buf.find(b"\r\n")
                if i < 0:
                    return
                self.left = int(bytes(buf[:i]).split(b";")[0], 16)
                del buf[: i + 2]
                self.chunk = "data" if self.left else "trailer"
            elif self.chunk == "data":
                take = bytes(buf[: self.left])
                del buf[: len(take)]
                self.left -= len(take)
                out(take)
                if not self.left:
                    self.chunk = "crlf"
            elif self.chunk == "crlf":
                if len(buf) < 2:
                    return
                del buf[:2]
                self.chunk = "size"
            else:  # trailer lines until the empty one (an h2c:// backend's grpc-status: lb/http2/h2c.py)
                i = buf.find(b"\r\n")
                if i < 0:
                    return
                line = bytes(buf[:i])
                del buf[: i + 2]
                if i:
                    name, _, value = line.partition(b":")
                    self.trailers.append((name.strip().lower(), value.strip()))
                    continue
                if self.mode == "grpc":
                    self._grpc_done(bytes(self.grpc_text()))
                else:
                    self._finish(self.trailers)
                return

    def grpc_text(self) -> bytes:
        return self._text

    def _grpc_text(self, data: bytes) -> None:
        t = self.grpc_text()
        if len(t) < _GRPC_BODY:
            self._text = t + data[: _GRPC_BODY - len(t)]

    def _grpc_done(self, text: bytes) -> None:
        self.mode = "done"
        self.buf.clear()
        self.down.grpc_reply(self.grpc_status, text[:_GRPC_BODY], self.grpc_fields)

    def _finish(self, trailers=None) -> None:
        self.mode = "done"
        self.down.finish(trailers or None)

    def close_out(self) -> bool:
        """The pipeline returned: end what it wrote. False when the answer was cut short (nothing, or a
        body shorter than its framing said): the stream is then reset, as HTTP/1.1 closes the connection."""
        if self.mode == "eof":
            self._finish()
        elif self.mode == "grpc" and self.left == 0 and not self.chunked:
            self._grpc_done(b"")
        return self.mode == "done"
