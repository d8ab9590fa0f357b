"""Passive health (Envoy's outlier detection, nginx's max_fails): real requests judge a backend too.

`eject_after` consecutive failures -- a connect failure, a timeout, a reset or invalid response, or a
5xx status -- eject a backend for `eject_for` seconds times the number of times it has been ejected
(each ejection-free stretch of `eject_for` takes one off that multiplier again), capped at
MAX_EJECTION_TIME or `eject_for`, whichever is larger. Never more than `max_percent` of the pool is out
at once (rounded down: at 50%, a pool of one is never ejected, as nginx ignores max_fails for a lone
server).
When the time is up it returns with a clean slate. Active health checks are independent: an ejected
backend is still probed, and a DOWN one is still out whatever this says.

A small state machine over the backends' fields with the clock passed in: observe() one result,
sweep() for returns. It logs nothing; the caller logs one line per ejection and return and counts them.
"""

from __future__ import annotations

import threading

MAX_EJECTION_TIME = 300.0     # Envoy's max_ejection_time default


class Ejector:
    def __init__(self, eject_after: int = 5, eject_for: float = 30.0, max_percent: float = 50.0):
        self.eject_after = eject_after
        self.eject_for = eject_for
        self.max_percent = max_percent
        self.ejected = 0           # how many are out now: sweep() does nothing while this is 0
        self._lock = threading.Lock()

    def configure(self, eject_after: int, eject_for: float, max_percent: float) -> None:
        self.eject_after, self.eject_for, self.max_percent = eject_after, eject_for, max_percent

    def observe(self, b, ok: bool, now: float, pool) -> float | None:
        """One request's outcome on backend b; the ejection's duration when this result ejected it."""
        if ok:
            if b.fail_run:          # the common case (a success after a success) takes no lock
                b.fail_run = 0
            return None
        if not self.eject_after:
            return None
        with self._lock:
            b.fail_run += 1
            if b.ejected or b.fail_run < self.eject_after:
                return None
            out = sum(1 for x in pool if x.ejected)
            if out + 1 > len(pool) * self.max_percent / 100:
                return None         # the cap: keep failing over to it rather than empty the pool
            # the multiplier decays by one for each eject_for it stayed in since its last return
            if b.times_ejected and self.eject_for > 0:
                b.times_ejected = max(0, b.times_ejected - int((now - b.returned_at) // self.eject_for))
            b.times_ejected += 1
            duration = min(self.eject_for * b.times_ejected, max(MAX_EJECTION_TIME, self.eject_for))
            b.ejected = True
            b.ejected_until = now + duration
            b.fail_run = 0
            self.ejected += 1
        b.refresh(now)
        return duration

    def sweep(self, pool, now: float) -> list:
        """The ejected backends whose time is up, returned to the pool (with a clean failure count)."""
        if not self.ejected:
            return []
        back = []
        with self._lock:
            for b in pool:
                if b.ejected and now >= b.ejected_until:
                    b.ejected = False
                    b.fail_run = 0
                    b.returned_at = now
                    self.ejected -= 1
                    back.append(b)
        for b in back:
            b.refresh(now)
        return back

    def forget(self, b) -> None:
        """A backend removed by reload while ejected: it no longer counts against the cap."""
        with self._lock:
            if b.ejected:
                b.ejected = False
                self.ejected -= 1
