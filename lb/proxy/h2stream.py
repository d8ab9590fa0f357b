"""An HTTP/2 stream as the pipeline's Downstream: lb/http2's codec (H2Downstream) under the interface
lb/proxy/downstream.py defines, with what the pipeline's room provides -- the one builder of the edge's
own replies, and HTTP/1.1's body reading (the stream's reader presents its DATA as a Reader does).

No raw path (sock is None): the relay answers through start, send, finish and abort.
"""

from __future__ import annotations

import time

from lb.errors import ClientGone
from lb.proxy import replies
from lb.proxy.downstream import H1Downstream


class StreamDownstream(H1Downstream):
    proto = b"HTTP/2"

    def __init__(self, conn, edge, codec):
        H1Downstream.__init__(self, conn, edge)
        self.sock = None  # the relay's neutral path
        self.codec = codec  # lb.http2.downstream.H2Downstream
        codec.edge, codec.build = edge, replies.build
        self.stream = codec.stream  # (lb/http2/h2c.py: its reset cancels a backend call)

    def local_reply(self, x, status: int, reason: str, keep: bool, linger: bool = False) -> bool:
        try:
            return self.codec.local_reply(x, status, reason, keep)
        except OSError:
            raise ClientGone() from None

    def start(self, x, status, reason, headers, length) -> None:
        try:
            self.codec.start(x, status, reason, headers, length)
        except OSError:
            raise ClientGone() from None  # the stream is gone: the client's doing, never the backend's

    def send(self, data: bytes) -> None:
        try:
            self.codec.send(data)
        except OSError:
            raise ClientGone() from None

    def finish(self, trailers=None) -> None:
        try:
            self.codec.finish(trailers)
        except OSError:
            raise ClientGone() from None

    def abort(self) -> None:
        self.codec.abort()

    def hold(self, delay: float) -> None:
        time.sleep(delay)
