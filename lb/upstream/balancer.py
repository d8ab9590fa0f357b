"""Choosing a backend among those in rotation: round robin, smooth weighted round robin, least-request.

Slow start lives inside the weights, the way nginx's `effective_weight` works: a backend that
(re)joined the rotation `age` seconds ago counts with weight * max(10%, age / slow_start) until the
ramp is over, in the smooth weighted round robin and in least-request alike. The clock is injected
(`clock`), so the ramp is tested without waiting for it.

One lock guards the cursor and the running weights, so concurrent picks never repeat or skip a turn.
`exclude` (the backends a request has already tried) are skipped without taking their turn.

A backend resting (rest(): its 503 said Retry-After) is skipped the same way until its time is up --
unless every backend in rotation is resting or excluded: then one of them still beats a 503 of ours.
"""

from __future__ import annotations

import random
import threading
from time import monotonic

from lb.upstream.backends import Backend

SLOW_START_MIN = 0.10  # a joining backend starts at this fraction of its weight (Envoy's min_weight_percent)
STRATEGIES = ("round-robin", "weighted", "least-request")


class Balancer:
    def __init__(
        self,
        backends: list[Backend],
        strategy: str = "weighted",
        slow_start: float = 0.0,
        clock=monotonic,
        rng: random.Random | None = None,
    ):
        self.backends = list(backends)
        self.slow_start = slow_start
        self.clock = clock
        self._rng = rng or random.Random()
        self._cursor = 0
        self._lock = threading.Lock()
        self.resting: dict[Backend, float] = {}  # backend -> clock() time it may be picked again
        self._set_strategy(strategy)

    def _set_strategy(self, strategy: str) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        self.strategy = strategy
        self._pick = {
            "round-robin": self._round_robin,
            "weighted": self._smooth_weighted,
            "least-request": self._least_request,
        }[strategy]

    def set_backends(
        self, backends: list[Backend], strategy: str | None = None, slow_start: float | None = None
    ) -> None:
        """Reload: the new list (and strategy, slow start) in one step under the lock."""
        with self._lock:
            self.backends = list(backends)
            self._cursor = 0
            if strategy:
                self._set_strategy(strategy)
            if slow_start is not None:
                self.slow_start = slow_start

    def pick(self, exclude=(), turn: bool = True) -> Backend | None:
        """The next backend in rotation, not one of `exclude`; None when there is none. turn=False: a
        second opinion beside the request's own try (a hedge) -- round robin's cursor stays where the
        try left it, or the backend after the hedged one would lose its turn to it, and a pool whose
        slow backend is hedged on every request would send that backend every first try."""
        if self.resting:  # empty but for a few seconds after a Retry-After: one truth test per pick
            now = self.clock()
            for b, until in list(self.resting.items()):
                if until <= now:
                    self.resting.pop(b, None)
            if self.resting:
                got = self._pick(tuple(exclude) + tuple(self.resting), turn)
                if got is not None:
                    return got
        return self._pick(exclude, turn)

    def rest(self, backend: Backend, seconds: float) -> None:
        """Leave `backend` out of the picks for `seconds` (a 503's Retry-After; this process only)."""
        self.resting[backend] = max(self.resting.get(backend, 0.0), self.clock() + seconds)

    def by_route(self, route: str | None) -> Backend | None:
        """The backend in rotation a sticky `route` cookie names; None (reassign, never an error) otherwise."""
        if route:
            for b in self.backends:
                if b.route == route and b.in_rotation:
                    return b
        return None

    def effective_weight(self, b: Backend, now: float) -> float:
        """The weight a backend counts with now: its configured weight, ramped during slow start."""
        if self.slow_start > 0 and b.joined_at is not None:
            age = now - b.joined_at
            if age < self.slow_start:
                return b.weight * max(SLOW_START_MIN, age / self.slow_start)
        return b.weight

    def _round_robin(self, exclude, turn: bool = True) -> Backend | None:
        """The next backend in configured order after the last one picked (weights ignored)."""
        if self.slow_start > 0:
            return self._smooth_weighted(exclude, unit=True)  # a ramp needs weights: all 1 here
        lock = self._lock
        lock.acquire()  # (as _smooth_weighted's)
        try:
            bs = self.backends
            n = len(bs)
            for step in range(n):
                b = bs[(self._cursor + step) % n]
                if b.in_rotation and b not in exclude:
                    if turn:
                        self._cursor = (self._cursor + step + 1) % n
                    return b
        finally:
            lock.release()
        return None

    def _smooth_weighted(self, exclude, turn: bool = True, unit: bool = False) -> Backend | None:
        """nginx's rule: every backend in rotation gains its (effective) weight, the largest wins and pays
        the total back. Weights 3,1,1 pick a,b,a,c,a: each backend gets its share of every window.
        """
        ramp = self.slow_start > 0
        now = self.clock() if ramp else 0.0
        lock = self._lock
        lock.acquire()  # (acquire/release, not `with`: once per request, and `with` costs twice as much)
        try:
            best = None
            total: float = 0
            for b in self.backends:
                if not b.in_rotation or b in exclude:
                    continue
                w: float = 1 if unit else b.weight
                if ramp and b.joined_at is not None and now - b.joined_at < self.slow_start:
                    w = w * max(SLOW_START_MIN, (now - b.joined_at) / self.slow_start)
                b.current += w
                total += w
                if best is None or b.current > best.current:
                    best = b
            if best is not None:
                best.current -= total
            return best
        finally:
            lock.release()

    def _least_request(self, exclude, turn: bool = True) -> Backend | None:
        """Envoy's least-request. Equal weights: power of two random choices -- draw two, send to the one
        with fewer requests in flight. Unequal (or ramping) weights: the smooth weighted round robin over
        weight / (in flight + 1), so the shares follow the weights when idle and shift away from a
        backend as its requests pile up."""
        now = self.clock() if self.slow_start > 0 else 0.0
        cands, weights = [], []
        for b in self.backends:
            if b.in_rotation and b not in exclude:
                cands.append(b)
                weights.append(self.effective_weight(b, now))
        n = len(cands)
        if n < 2:
            return cands[0] if cands else None
        if weights.count(weights[0]) == n:
            i, j = self._rng.sample(range(n), 2)
            a, c = cands[i], cands[j]
            return a if a.inflight <= c.inflight else c
        with self._lock:
            best = None
            total = 0.0
            for b, weight in zip(cands, weights):
                w = weight / (b.inflight + 1)
                b.current += w
                total += w
                if best is None or b.current > best.current:
                    best = b
            best.current -= total  # type: ignore[union-attr]  # (two or more candidates here)
            return best
