"""H2Downstream: where one HTTP/2 stream's response goes -- the Downstream of PIPELINE.md, for HTTP/2.

It encodes, deciding nothing: a head (start), body bytes (send, which waits while the client is slow on
this stream), the end with or without trailers (finish), and the edge's own replies (local_reply), which
a gRPC client gets trailers-only (lb/http2/grpc.py). Field names go out lowercase and without the
HTTP/1.1 connection-specific ones, which HTTP/2 forbids.

The pipeline reaches it through lb/proxy/h2stream.py (this room sits below the pipeline's, which lends
it the replies builder); lb/http2/bridge.py drives it for the refusals of streams whose fields cannot
make a Request.
"""

from __future__ import annotations

from h2.errors import ErrorCodes

from lb.http.framing import HOP_BY_HOP
from lb.http2 import grpc

_FORBIDDEN = HOP_BY_HOP | {b"proxy-connection"}
_TEXT = b"text/plain; charset=utf-8"


def fields(headers) -> list[tuple[bytes, bytes]]:
    """HTTP/1.1-style (name, value) pairs as HTTP/2 fields."""
    out = []
    for name, value in headers:
        n = name.lower()
        if n not in _FORBIDDEN:
            out.append((n, value))
    return out


class H2Downstream:
    proto = b"HTTP/2"

    def __init__(self, stream, edge=None, head_only: bool = False, build=None):
        self.stream, self.edge, self.head_only = stream, edge, head_only
        self.build = build  # lb.proxy.replies.build, given by the pipeline's side (a room above)

    @property
    def grpc(self) -> bool:
        return self.stream.grpc

    def start(self, x, status: int, reason: bytes, headers, length: int | None) -> None:
        """A response head; length 0 (or a HEAD's, a 204's, a 304's) ends the stream on it."""
        out = fields(headers)
        if length and not any(f[0] == b"content-length" for f in out):
            out.append((b"content-length", b"%d" % length))  # the pipeline hands framing over apart
        end = length == 0 or self.head_only or status in (204, 304)
        if end and not self.head_only:
            out = [f for f in out if f[0] != b"content-length"]  # END_STREAM says it (and gRPC reads it as metadata)
        self.stream.headers(status, out, end)
        self.ended = end

    def send(self, data: bytes) -> None:
        if data and not getattr(self, "ended", False):
            self.stream.send(data)

    def finish(self, trailers=None) -> None:
        if not getattr(self, "ended", False):
            self.ended = True
            self.stream.finish(fields(trailers) if trailers else None)

    def grpc_reply(self, status: int, reason: bytes, headers) -> None:
        """The edge's own answer to a gRPC client: trailers-only, its fields kept as metadata."""
        self.ended = True
        self.stream.headers(200, grpc.trailers_only(status, reason, fields(headers)), True)

    def local_reply(self, x, status: int, reason: str, keep: bool, linger: bool = False) -> bool:
        """The edge's own reply (PIPELINE.md): built by lb/proxy/replies.py's build (self.build), logged, then
        encoded."""
        r = self.build(x, status, reason, keep)
        x.bytes_sent = len(r.body)
        self.edge.record(x, status)
        if self.grpc:
            self.grpc_reply(r.status, r.body, r.headers)
        else:
            self.start(
                x,
                r.status,
                r.phrase,
                [(b"content-type", _TEXT), (b"content-length", b"%d" % len(r.body))] + r.headers,
                0 if r.head_only else len(r.body),
            )
            if not r.head_only:
                self.send(r.body)
                self.finish()
        return True

    def abort(self) -> None:
        """The answer cannot be completed (its backend failed after the head): the stream is reset."""
        st = self.stream
        with st.conn.cv:
            st.conn.reset_stream(st, ErrorCodes.INTERNAL_ERROR)

    @property
    def complete(self) -> bool:
        return getattr(self, "ended", False)
