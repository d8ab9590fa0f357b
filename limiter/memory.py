"""The in-process store: per-key state for one algorithm, lock-striped, bounded by ONE global key cap.

Layout: one dict key -> state for the whole store; `stripes` (default 64) locks chosen by hash(key)
serialise the decisions for one key (keys in different stripes never wait for each other); one queue
of keys in insertion order, rotated by the sweep, guarded by a growth lock taken only when a *new* key
is inserted (the only moment memory grows, so the hot path for known keys does no sweeping at all).

The clock: allow(key) without `now` reads the store's clock (time.time unless injected) UNDER the
key's lock, so the decisions for one key are taken in the order of their instants.  (Read before the
lock, a later request could be decided first; sliding-log and fixed-window then admitted more than N
in a window: N=2, W=10 s, instants in the order 11, 7, 21, 7 admitted all four.)  allow(key, now) with
an explicit instant stays for injected-clock tests and for callers that know better.

Bounded memory, amortised O(1), paid only on insertion:

* Idle sweep: each insertion examines up to SWEEP keys at the front of the queue; a key whose state
  has expired (algorithm.expires_at(state) <= now: from then on it behaves exactly like a fresh key,
  so dropping it changes no decision) is deleted, a live one is rotated to the back (CLOCK-style).
* Global cap: at most max_keys keys in the whole store.  An insertion at the cap first looks for an
  idle key to evict (up to SCAN more keys of the queue).  When every key it looks at is live, NO live
  state is evicted: the new key is refused with a TableFullDecision (unavailable=True: the edge answers
  503, as nginx's limit_req does when its zone cannot allocate), and counted in `.full`.  So a
  key-rotating flood can fill the table and be refused, but can never make the store forget a limited
  key's state and hand it a fresh quota.  Size max_keys for the clients you expect within one expiry
  horizon (a window; for the sliding counter two); ~100-150 bytes per key.
"""

from __future__ import annotations

import threading
from collections import deque
from time import time as _time

from .algorithms import Decision

SWEEP = 2  # keys examined per insertion
SCAN = 8  # more keys examined for an idle one when an insertion finds the table full
_new = tuple.__new__


class TableFullDecision(Decision):
    """Refused because the store's key table is full of live state (the edge answers 503)."""

    __slots__ = ()
    unavailable = True
    degraded = True


class MemoryStore:
    """allow(key, now=None) for one algorithm, with state held in this process."""

    __slots__ = ("algorithm", "limit", "max_keys", "full", "_locks", "_mask", "_states", "_queue", "_grow",
                 "_step", "_expires", "_clock")

    def __init__(self, algorithm, max_keys: int = 100_000, stripes: int = 64, clock=_time):
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys <= 0:
            raise ValueError(f"max_keys must be a positive integer, got {max_keys!r}")
        if stripes <= 0 or stripes & (stripes - 1):
            raise ValueError(f"stripes must be a power of two, got {stripes!r}")
        self.algorithm = algorithm
        self.limit = algorithm.limit
        self.max_keys = max_keys
        self.full = 0  # new keys refused because the table was full of live state
        self._mask = stripes - 1
        self._locks = tuple(threading.Lock() for _ in range(stripes))
        self._states = {}  # one dict: get/set are atomic; a key's entry changes only under its stripe lock
        self._queue = deque()  # every key in _states exactly once; guarded by _grow
        self._grow = threading.Lock()
        self._step = algorithm.step
        self._expires = algorithm.expires_at
        self._clock = clock

    def allow(self, key, now: float | None = None):
        lock = self._locks[hash(key) & self._mask]
        with lock:
            if now is None:
                now = self._clock()  # under the key's lock: decisions for a key in the order of their instants
            states = self._states
            state = states.get(key)
            if state is not None:
                new, decision = self._step(state, now)
                if new is not state:
                    states[key] = new
                return decision
            return self._insert(key, now, lock)

    def peek(self, key, now: float | None = None):
        """(held, Decision): what allow(key, now) would answer, without changing the key's state (the
        step is computed on a copy and not stored). held: the key has state here."""
        lock = self._locks[hash(key) & self._mask]
        with lock:
            if now is None:
                now = self._clock()
            state = self._states.get(key)
            if type(state) is list:
                state = state.copy()  # step() prunes a sliding log in place
            return state is not None, self._step(state, now)[1]

    def _insert(self, key, now, lock):
        """A new key (its stripe lock held): sweep, make room under the global cap, or refuse."""
        new, decision = self._step(None, now)
        with self._grow:
            full = self._room(now, lock)
            if full is not None:
                return full
            self._queue.append(key)
            self._states[key] = new
        return decision

    def _room(self, now, lock):
        """Under _grow (and a stripe lock, `lock`): sweep, then make room for one more key. None when
        there is room, else the TableFullDecision that refuses the new key (counted in .full)."""
        states, queue = self._states, self._queue
        for _ in range(SWEEP if len(queue) >= SWEEP else len(queue)):
            self._visit(now, lock)
        if len(states) >= self.max_keys:
            soonest = None
            for _ in range(SCAN if len(queue) >= SCAN else len(queue)):
                e = self._visit(now, lock)
                if e is None:
                    return None
                if soonest is None or e < soonest:
                    soonest = e
            self.full += 1
            wait = max(0.0, soonest - now) if soonest is not None else self.algorithm.window
            return _new(TableFullDecision, (False, self.limit, 0, wait, wait))
        return None

    def _visit(self, now, held):
        """Under _grow: the key at the front of the queue is deleted if idle (returns None), else rotated
        to the back (returns its expiry).  Another stripe's lock is only tried, never waited for (the
        inserting thread holds its own: waiting could deadlock); a busy key counts as live."""
        queue = self._queue
        k = queue.popleft()
        klock = self._locks[hash(k) & self._mask]
        if klock is held or klock.acquire(False):
            try:
                e = self._expires(self._states[k])
                if e <= now:
                    del self._states[k]
                    return None
            finally:
                if klock is not held:
                    klock.release()
        else:
            e = now + self.algorithm.window
        queue.append(k)
        return e

    def __len__(self):
        """Number of keys currently holding state (a snapshot)."""
        return len(self._states)

    def clear(self):
        for lock in self._locks:  # the stripe locks before _grow, the order allow() takes them in
            lock.acquire()
        try:
            with self._grow:
                self._states.clear()
                self._queue.clear()
        finally:
            for lock in self._locks:
                lock.release()

    def __repr__(self):
        return f"MemoryStore({self.algorithm!r}, max_keys={self.max_keys}, stripes={self._mask + 1})"
