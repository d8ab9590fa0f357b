"""Per-connection allowances for the frames an HTTP/2 peer can send without asking the edge for work.

Each is a token bucket (a burst, then a steady rate): a client that cancels a stream now and then, or
pings to keep its connection warm, never notices it; one that sends RST_STREAM (rapid reset,
CVE-2023-44487), PING or SETTINGS in a loop empties it and gets GOAWAY ENHANCE_YOUR_CALM. Time is
passed in, so the arithmetic is tested without a clock.

Standalone PRIORITY and WINDOW_UPDATE frames have their own allowance, which progress refills as well as
time (as Envoy's per-stream and per-DATA-frame bounds, nginx's priority_limit): each request opened earns
a few, each DATA frame sent earns a few -- a browser's priority frames ride on its requests, a download's
window updates on the DATA it receives -- while a flood of them, which makes no progress, runs it dry.
"""

from __future__ import annotations

RESET_BURST, RESET_RATE = 200, 20.0  # RST_STREAM from the client, and streams it opened we refused
CONTROL_BURST, CONTROL_RATE = 200, 20.0  # PING, SETTINGS, unknown frames, empty DATA
NOPROGRESS_BURST, NOPROGRESS_RATE = 1000, 50.0  # standalone PRIORITY and WINDOW_UPDATE frames
NOPROGRESS_PER_REQUEST = 20  # earned per stream the client opens (its part of the PRIORITY tree)
NOPROGRESS_PER_DATA = 4  # earned per DATA frame sent (the stream's and the connection's updates)


class Allowance:
    __slots__ = ("burst", "rate", "tokens", "at")

    def __init__(self, burst: int, rate: float, now: float):
        self.burst, self.rate, self.tokens, self.at = burst, rate, float(burst), now

    def take(self, now: float, n: int = 1) -> bool:
        """Spend n; False once the peer has spent more than the burst plus what the rate gave back."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        return self.tokens >= 0

    def earn(self, n: int) -> None:
        """Progress the peer made gives back n, up to the burst."""
        self.tokens = min(self.burst, self.tokens + n)
