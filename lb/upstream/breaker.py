"""A pool's circuit breaker (Envoy's cluster circuit breakers): a cap on requests in flight to the pool
(`max_requests`) and on requests waiting for a pooled connection (`max_pending`). Past either a request
is answered 503 at once -- shed, never queued behind a backend that hangs. 0 is off (the default).

The edge has one pool today (every backend); a pool object of the routes-and-pools issue owns one
Breaker each. The retry budget (lb/upstream/retrybudget.py) is the third of Envoy's caps, on retries in flight.

One small lock per counter change: the cost of an admitted request is one increment and one decrement.
"""

from __future__ import annotations

import threading


class Breaker:
    def __init__(self, max_requests: int = 0, max_pending: int = 0):
        self.max_requests = max_requests
        self.max_pending = max_pending
        self.requests = 0  # in flight to the pool, admitted by enter()
        self.pending = 0  # waiting for a pooled connection (lb/upstream/backends.py LifoSlots)
        self.overflow = {"max_requests": 0, "max_pending": 0}  # shed requests, by the cap that shed them
        self._lock = threading.Lock()

    def configure(self, max_requests: int, max_pending: int) -> None:
        self.max_requests, self.max_pending = max_requests, max_pending

    def enter(self, count: bool = True) -> bool:
        """Admit a request to the pool (True) or shed it (False: counted, unless not `count`: a hedge
        not sent is no request shed). The caller gives an admitted one back with leave(), on every path."""
        with self._lock:
            if self.max_requests and self.requests >= self.max_requests:
                if count:
                    self.overflow["max_requests"] += 1
                return False
            self.requests += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.requests -= 1

    def wait(self) -> bool:
        """A request is about to wait for a pooled connection: may it (True, then unwait() after), or is
        the line full (False: counted, the caller answers 503 at once instead of waiting pool_timeout)?"""
        with self._lock:
            if self.max_pending and self.pending >= self.max_pending:
                self.overflow["max_pending"] += 1
                return False
            self.pending += 1
            return True

    def unwait(self) -> None:
        with self._lock:
            self.pending -= 1

    def status(self) -> dict:
        return {
            "max_requests": self.max_requests,
            "in_flight": self.requests,
            "max_pending": self.max_pending,
            "pending": self.pending,
            "overflow": dict(self.overflow),
        }
