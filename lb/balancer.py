"""Choosing a backend: round robin and smooth weighted round robin, over UP backends only.

One lock guards the cursor and the running weights, so concurrent picks never repeat or skip a turn.
"""

from __future__ import annotations

import threading

from .backends import Backend


class Balancer:
    def __init__(self, backends: list[Backend], strategy: str = "weighted"):
        if strategy not in ("round-robin", "weighted"):
            raise ValueError(f"strategy must be round-robin or weighted, got {strategy!r}")
        self.backends = list(backends)
        self.strategy = strategy
        self._cursor = 0
        self._lock = threading.Lock()
        self.pick = self._round_robin if strategy == "round-robin" else self._smooth_weighted

    def set_backends(self, backends: list[Backend], strategy: str | None = None) -> None:
        """Reload: the new list (and strategy) in one step under the lock."""
        with self._lock:
            self.backends = list(backends)
            self._cursor = 0
            if strategy:
                self.strategy = strategy
                self.pick = self._round_robin if strategy == "round-robin" else self._smooth_weighted

    def by_route(self, route: str | None) -> Backend | None:
        """The UP backend a sticky `route` cookie names; None (reassign, never an error) otherwise."""
        if route:
            for b in self.backends:
                if b.route == route and b.up:
                    return b
        return None

    def _round_robin(self) -> Backend | None:
        """The next UP backend in configured order after the last one picked."""
        with self._lock:
            bs = self.backends
            n = len(bs)
            for step in range(n):
                b = bs[(self._cursor + step) % n]
                if b.up:
                    self._cursor = (self._cursor + step + 1) % n
                    return b
        return None

    def _smooth_weighted(self) -> Backend | None:
        """nginx's rule: every UP backend gains its weight, the largest wins and pays the total back.

        Weights 3,1,1 pick a,b,a,c,a: each backend gets its share of every window, interleaved.
        """
        with self._lock:
            best = None
            total = 0
            for b in self.backends:
                if not b.up:
                    continue
                b.current += b.weight
                total += b.weight
                if best is None or b.current > best.current:
                    best = b
            if best is not None:
                best.current -= total
            return best
