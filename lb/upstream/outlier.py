"""Passive health (Envoy's outlier detection, nginx's max_fails): real requests judge a backend too.

`eject_after` consecutive failures -- a connect failure, a timeout, a reset or invalid response, or a
5xx status -- eject a backend for `eject_for` seconds times the number of times it has been ejected
(each ejection-free stretch of `eject_for` takes one off that multiplier again), capped at
MAX_EJECTION_TIME or `eject_for`, whichever is larger. Never more than `max_percent` of the pool is out
at once (rounded down: at 50%, a pool of one is never ejected, as nginx ignores max_fails for a lone
server).
When the time is up it returns with a clean slate -- or sooner, when the active health checks pass it
`rise` times in a row after its ejection (probe_passed: the evidence that brings a DOWN backend back ends
an ejection too, as Envoy's successful_active_health_check_uneject_host does; a backend killed under
traffic and restarted rejoins within rise x interval, the spec's milestone 3, not after the rest of a
30-300 s ejection). Passive ejection only takes out a backend the health checks still call UP: a DOWN
one is out already, and its failures neither count nor eject it.

A small state machine over the backends' fields with the clock passed in: observe() one result,
sweep() for returns. It logs nothing; the caller logs one line per ejection and return and counts them.
"""

from __future__ import annotations

import threading

MAX_EJECTION_TIME = 300.0  # Envoy's max_ejection_time default


class Ejector:
    def __init__(self, eject_after: int = 5, eject_for: float = 30.0, max_percent: float = 50.0):
        self.eject_after = eject_after
        self.eject_for = eject_for
        self.max_percent = max_percent
        self.ejected = 0  # how many are out now: sweep() does nothing while this is 0
        self._lock = threading.Lock()

    def configure(self, eject_after: int, eject_for: float, max_percent: float) -> None:
        self.eject_after, self.eject_for, self.max_percent = eject_after, eject_for, max_percent

    def observe(self, b, ok: bool, now: float, pool) -> float | None:
        """One request's outcome on backend b; the ejection's duration when this result ejected it."""
        if ok:
            if b.fail_run:  # the common case (a success after a success) takes no lock
                b.fail_run = 0
            return None
        if not self.eject_after:
            return None
        with self._lock:
            if not b.up:  # DOWN: the active checks have it out; UP again, it starts clean
                b.fail_run = 0
                return None
            b.fail_run += 1
            if b.ejected or b.fail_run < self.eject_after:
                return None
            out = sum(1 for x in pool if x.ejected)
            if out + 1 > len(pool) * self.max_percent / 100:
                return None  # the cap: keep failing over to it rather than empty the pool
            # the multiplier decays by one for each eject_for it stayed in since its last return
            if b.times_ejected and self.eject_for > 0:
                b.times_ejected = max(0, b.times_ejected - int((now - b.returned_at) // self.eject_for))
            b.times_ejected += 1
            duration = min(self.eject_for * b.times_ejected, max(MAX_EJECTION_TIME, self.eject_for))
            b.ejected = True
            b.ejected_until = now + duration
            b.fail_run = 0
            b.pass_streak = 0  # the probes that may end it early (probe_passed) count from here
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

    def probe_passed(self, b, rise: int, now: float) -> bool:
        """An active health check passed (lb/upstream/health.py record() has counted it in b.pass_streak): the
        `rise`-th pass in a row since its ejection returns an ejected backend at once. True if it did."""
        if not b.ejected or b.pass_streak < rise:
            return False
        with self._lock:
            if not b.ejected:  # the sweep returned it meanwhile
                return False
            b.ejected = False
            b.fail_run = 0
            b.returned_at = now  # its multiplier decays from here, as after a sweep
            self.ejected -= 1
        b.refresh(now)
        return True

    def forget(self, b) -> None:
        """A backend removed by reload while ejected: it no longer counts against the cap."""
        with self._lock:
            if b.ejected:
                b.ejected = False
                self.ejected -= 1
