"""The connection's output: queued responses into frames as the flow-control windows allow, and the
frames to the socket as it takes them.

Only the connection thread calls it (an SSL object must not be written from two threads). What waits
for the socket is bounded (OUT_HIGH): past it no stream is pumped, so a client that does not read holds
its own bytes, never the edge's memory.
"""

from __future__ import annotations

import logging
import ssl
from time import monotonic

import h2.exceptions
from h2.errors import ErrorCodes

from lb.http2.guard import NOPROGRESS_PER_DATA

log = logging.getLogger("edge")

OUT_HIGH = 1 << 20  # bytes waiting for the socket past which no stream is pumped


class FrameWriter:
    """The frames of one connection on their way to its socket (`buf`: what the socket has not taken)."""

    def __init__(self, conn):
        self.conn = conn
        self.buf = bytearray()

    def write(self) -> bool:
        """What h2 queued, then as much as the socket takes now; False when the socket failed."""
        c = self.conn
        with c.cv:
            data = c.h2.data_to_send()
        if data:
            self.buf += data
        while self.buf:
            piece = self.buf[:16384] if c.over_tls else self.buf
            try:
                n = c.sock.send(piece)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return True
            except OSError:
                return False
            del self.buf[:n]
        return True

    def pump(self) -> None:
        """Queued responses into frames, as far as each stream's window (and the socket) allows."""
        if len(self.buf) > OUT_HIGH:
            return
        c = self.conn
        now = monotonic()
        budget = OUT_HIGH - len(self.buf)
        with c.cv:
            if not c.ready:
                return
            for sid, st in list(c.ready.items()):
                try:
                    budget = _frame_stream(c.h2, st, budget, now)
                except h2.exceptions.StreamClosedError:
                    st.reset = True  # the client reset it meanwhile
                    st.out.clear()
                    st.out_n = 0
                except h2.exceptions.ProtocolError as e:
                    log.error("HTTP/2 stream %d to %s: cannot send the response (%s): reset", sid, c.peer_ip, e)
                    st.out.clear()
                    st.out_n = 0
                    c.reset_stream(st, ErrorCodes.INTERNAL_ERROR)
                if not st.out or st.reset:
                    c.ready.pop(sid, None)
                st.cv.notify_all()


def _frame_stream(h, st, budget: int, now: float) -> int:
    """(cv held) One stream's queue into h2's frames: heads and ends whole, DATA as far as its window and
    `budget` allow. The budget left."""
    sid = st.sid
    while st.out:
        item = st.out[0]
        if type(item) is tuple:
            if item[0] == "h":
                h.send_headers(sid, item[1], end_stream=item[2])
                if item[2]:
                    st.sent_end = True
            elif item[0] == "t":
                h.send_headers(sid, item[1], end_stream=True)
                st.sent_end = True
            else:
                h.end_stream(sid)
                st.sent_end = True
            st.out.popleft()
            continue
        window = min(h.local_flow_control_window(sid), h.max_outbound_frame_size)
        if window <= 0:
            break
        n = min(window, len(item))
        if n == len(item):
            last = len(st.out) > 1 and st.out[1] == ("end",)  # END_STREAM on the last DATA
            h.send_data(sid, item, end_stream=last)
            st.out.popleft()
            if last:
                st.out.popleft()
                st.sent_end = True
        else:
            h.send_data(sid, item[:n])
            st.out[0] = item[n:]
        st.out_n -= n
        st.conn.noprogress.earn(NOPROGRESS_PER_DATA)  # the client's WINDOW_UPDATEs for it are progress
        st.progress = now
        budget -= n
        if budget <= 0:
            break
    return budget
