"""The retry budget (Envoy's): retries in flight at most `percent` of the requests in flight, but always
`minimum` of them, so a dead part of the pool never multiplies the load on the rest.

A request counts as active from its first try to its end; a retry holds a slot of the budget from the
moment it is granted until its request ends (the retried try is what loads the other backends), as
Envoy holds its retry resource until the retried attempt is over.

A retry away from a backend that is already out of rotation when its try fails (ejected, DOWN, drained)
asks nothing of the budget (lb/proxy/forward.py): it is a request that picked the backend just before it left,
re-picked as forward() re-picks one that left before its first try. Only the requests in flight to it
at that moment can take that path, once per departure, so it cannot grow into a storm; in a burst on a
busy machine they are many (20 of 90 seen in CI), far more than a steady-state floor.

The floor is 10 by default (Envoy's is 3; Linkerd's budget has a floor of 10 retries a second): a
burst of new connections reaches the forwarding stage a few at a time, and with a floor of 3 a dead
backend met by the first dozen requests of a burst cost clients 502s before passive health (5
consecutive failures) could eject it -- measured: 1-2 of 90 requests, 3 runs in 4. Past 50 requests in
flight the percentage governs.
"""

from __future__ import annotations

import threading
from functools import partial


class RetryBudget:
    def __init__(self, percent: float = 20.0, minimum: int = 10):
        self.percent = percent
        self.minimum = minimum
        # Requests being forwarded, one item each (active: its length). Every request adds one and takes
        # one away, so the count is kept without the lock: list.append and list.pop are each atomic under
        # the GIL (and per-object locked without it), where `active += 1` is a read, an add and a write
        # another thread can come between. The lock guards what is decided from the counts (try_retry).
        self._active: list = []
        # start() and end(False), the per-request calls, as the list's own methods: no Python frame each
        self.start = partial(self._active.append, None)  # a request is being forwarded
        self.ended = self._active.pop  # ... and is over, without a retry slot (end(False))
        self.retrying = 0  # of which: holding a retry slot
        self.peak = 0  # the most retries ever in flight at once
        self.granted = 0
        self.refused = 0  # budget exhausted: the request failed instead of retrying
        self._lock = threading.Lock()

    def configure(self, percent: float, minimum: int) -> None:
        self.percent, self.minimum = percent, minimum

    @property
    def active(self) -> int:
        """Requests being forwarded."""
        return len(self._active)

    def allowed(self) -> int:
        """Retries that may be in flight now."""
        return max(self.minimum, int(len(self._active) * self.percent / 100))

    def end(self, held: bool) -> None:
        """The request is over; `held`: it had been granted a retry."""
        self._active.pop()
        if held:
            with self._lock:
                self.retrying -= 1

    def give_back(self) -> None:
        """A slot granted by try_retry(False) is returned before its request ends: a hedge
        (lb/proxy/hedge.py) whose losing exchange is closed no longer loads the pool."""
        with self._lock:
            self.retrying -= 1

    def try_retry(self, held: bool) -> bool:
        """May this request retry? A request already holding a slot keeps it for its further tries."""
        with self._lock:
            if held:
                self.granted += 1
                return True
            if self.retrying < self.allowed():
                self.retrying += 1
                self.granted += 1
                if self.retrying > self.peak:
                    self.peak = self.retrying
                return True
            self.refused += 1
            return False
