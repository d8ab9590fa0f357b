"""GOAWAY frames taken out of received HTTP/2 bytes before h2 sees them.

h2 ends its state machine at a GOAWAY it receives: after it, every frame of the streams the peer still
wants finished (the answers to calls an h2c:// backend said it processes; a client's requests in flight
when it said it opens no more) is a protocol error, and nothing more may be sent. A graceful GOAWAY is
the peer saying "no new streams", so the edge's connection drivers take it themselves (lb/upstream/h2pool.py,
lb/http2/server.py) and h2 sees the other frames only.
"""

from __future__ import annotations

GOAWAY = 0x7  # the frame type


def take_goaways(buf: bytearray, data: bytes, max_frame: int) -> tuple[bytes, list[tuple[int, int]]]:
    """buf: what came before and is not yet a whole frame (kept there); data: what just came. The whole
    frames but GOAWAYs, for h2, and each GOAWAY's (last stream id, error code)."""
    buf += data
    out = bytearray()
    goaways = []
    i, n = 0, len(buf)
    while n - i >= 9:
        length = int.from_bytes(buf[i : i + 3], "big")
        if length > max_frame:
            out += buf[i:]  # h2 says what is wrong with it
            i = n
            break
        end = i + 9 + length
        if end > n:
            break
        if buf[i + 3] == GOAWAY and length >= 8:
            goaways.append(
                (int.from_bytes(buf[i + 9 : i + 13], "big") & 0x7FFFFFFF, int.from_bytes(buf[i + 13 : i + 17], "big"))
            )
        else:
            out += buf[i:end]
        i = end
    del buf[:i]
    return bytes(out), goaways
