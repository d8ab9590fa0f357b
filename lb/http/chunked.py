"""HTTP/1.1's chunked transfer coding, decoded without I/O (h11's _readers.py, in spirit): feed it the buffer
a reader fills, take events. One decoder for both directions -- a client's request body
(lb/http/framing.iter_chunked) and a backend's response body (lb/proxy/relay.py) -- so both refuse the same
framing for the same reasons; the caller picks the error type (a client's is a 400, a backend's a 502).

    dec = ChunkedDecoder(error)          error(reason) -> the exception to raise for bad framing
    ev = dec.next(buf, most)             consumes from the bytearray buf, in place; ev is one of
        bytes       body data (at most `most` bytes, never empty)
        NEED        nothing more to decode in buf: read more into it (an EOF then is the caller's)
        CHUNK       a chunk of dec.size bytes begins (its size line consumed)
        CHUNK_END   its data and their CRLF are consumed
        TRAILER     a trailer line was consumed (dropped: the decoder keeps none)
        END         the last chunk and the trailer section are consumed; the message is over
    dec.consumed                         bytes of the coding consumed so far, framing included (body size
                                         limits and minimum rates count what a peer made us read)

The rules: sizes are strict hex (no 0x, sign, blanks or '_': each a way for two parsers to disagree); lines
end in CRLF (a bare LF is refused, never read as a line end); a size line is at most max_line bytes and a
trailer line max_trailer_line, however the bytes were split across reads; a chunk's data is followed by
CRLF exactly; at most max_trailers trailer lines (0: no bound).
"""

from __future__ import annotations

NEED, CHUNK, CHUNK_END, TRAILER, END = range(5)

_SIZE, _DATA, _CRLF, _TRAILERS, _DONE = range(5)
_HEX = b"0123456789abcdefABCDEF"


def chunk_size(line: bytes) -> int:
    """The size on a chunk-size line, or -1 when it is not strict hex (int(x, 16) alone would also take
    '0x5', '+5', '-5', '5_0' and surrounding blanks: each a way for two parsers to disagree)."""
    size_s = line.split(b";", 1)[0]
    if not size_s or size_s.translate(None, _HEX) or len(size_s) > 15:
        return -1
    return int(size_s, 16)


class ChunkedDecoder:
    __slots__ = (
        "error",
        "max_line",
        "max_trailer_line",
        "max_trailers",
        "state",
        "size",
        "left",
        "consumed",
        "trailers",
    )

    def __init__(self, error, max_line: int = 1024, max_trailer_line: int = 8192, max_trailers: int = 0):
        self.error = error
        self.max_line, self.max_trailer_line, self.max_trailers = max_line, max_trailer_line, max_trailers
        self.state = _SIZE
        self.size = 0  # the current chunk's declared size
        self.left = 0  # of which still to come
        self.consumed = 0
        self.trailers = 0

    def next(self, buf: bytearray, most: int = 65536):
        """The next event from buf (see the module's docstring); raises error(reason) for bad framing."""
        state = self.state
        if state == _DATA:
            n = len(buf)
            if not n:
                return NEED
            k = self.left
            if most < k:
                k = most
            if n <= k:
                k = n
                data = bytes(buf)
                buf.clear()
            else:
                data = bytes(buf[:k])
                del buf[:k]
            self.consumed += k
            self.left -= k
            if not self.left:
                self.state = _CRLF
            return data
        if state == _CRLF:
            if len(buf) < 2:
                return NEED
            if buf[0] != 13 or buf[1] != 10:
                # read, though not a CRLF: counted as consumed (the access log's bytes_received)
                del buf[:2]
                self.consumed += 2
                raise self.error("chunk longer than its declared size")
            del buf[:2]
            self.consumed += 2
            self.state = _SIZE
            return CHUNK_END
        if state == _SIZE:
            line = self._line(buf, self.max_line)
            if line is None:
                return NEED
            size = chunk_size(line)
            if size < 0:
                raise self.error("invalid chunk size")
            if size == 0:
                self.state = _TRAILERS
                return self.next(buf, most)
            self.size = self.left = size
            self.state = _DATA
            return CHUNK
        if state == _TRAILERS:
            line = self._line(buf, self.max_trailer_line)
            if line is None:
                return NEED
            if not line:
                self.state = _DONE
                return END
            self.trailers += 1
            if self.max_trailers and self.trailers > self.max_trailers:
                raise self.error(f"more than {self.max_trailers} trailer fields")
            return TRAILER
        return END

    def _line(self, buf: bytearray, limit: int) -> bytes | None:
        """A CRLF-terminated line of at most `limit` bytes before its CRLF, consumed; None when it has not
        all arrived. The search stops at the limit, so a longer line is refused however it was split."""
        i = buf.find(b"\n", 0, limit + 2)
        if i >= 0:
            if i == 0 or buf[i - 1] != 13:
                raise self.error("bare LF in a chunked body")
            line = bytes(buf[: i - 1])
            del buf[: i + 1]
            self.consumed += i + 1
            return line
        if len(buf) > limit + 1:
            raise self.error("chunk line too long")
        return None
