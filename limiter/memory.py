"""The in-process store: per-key state for one algorithm, lock-striped, bounded by ONE global key cap.

Layout: one dict key -> state for the whole store; `stripes` (default 64) locks chosen by hash(key)
serialise the decisions for one key (keys in different stripes never wait for each other); one min-heap
of (expiry instant, key), touched only when a *new* key is inserted (the only moment memory grows), under
a growth lock -- the hot path for known keys does no bookkeeping at all.

The clock: allow(key) without `now` reads the store's clock (time.time unless injected) UNDER the
key's lock, so the decisions for one key are taken in the order of their instants.  (Read before the
lock, a later request could be decided first; sliding-log and fixed-window then admitted more than N
in a window: N=2, W=10 s, instants in the order 11, 7, 21, 7 admitted all four.)  allow(key, now) with
an explicit instant stays for injected-clock tests and for callers that know better.

What may be dropped: a state past algorithm.expires_at(state) behaves exactly like a fresh key (a full
bucket, empty windows), so dropping it changes no decision -- "reclaimable".  Every other state would
decide differently from a fresh key, and dropping it would hand that client part or all of its quota
back: such a state is never dropped.

The heap holds one entry per key with an instant <= the key's expiry (a key's expiry only ever grows:
each admission pushes it later, a denial leaves it), so its top is a lower bound of the soonest expiry
in the table; an entry found stale (the key was used since) is pushed back with the key's current
expiry.  Amortised O(log n), paid only on insertion:

* Idle sweep: each insertion drops up to SWEEP reclaimable keys from the top (memory shrinks as clients
  go quiet, without a cap).
* Global cap: at most max_keys keys.  An insertion at the cap drops the reclaimable key that expired
  first (for a key that went quiet, the least recently used); it never misses one: the heap's top is
  checked against the key's own state, so "no reclaimable key" is exact (before, 8 keys were looked at
  and a table with reclaimable keys elsewhere refused new clients).  When no key is reclaimable -- every
  state would still decide differently from a fresh one -- the NEW key is refused with a
  TableFullDecision (unavailable=True: the edge answers 503, as nginx's limit_req does when its zone
  cannot allocate; Retry-After: until the soonest expiry), counted in `.full`, and one log line says the
  table is full (then at most one a minute).  No live state is ever evicted, so a key-rotating flood can
  fill the table and be refused, but can never make the store forget a limited key.  Size max_keys
  for the clients you expect within one expiry horizon (a window; for the sliding counter two);
  ~90-140 bytes per key plus ~80 for its heap entry (docs/limiter.md).
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections.abc import Sequence
from time import monotonic
from time import time as _time

from limiter.algorithms import Decision

log = logging.getLogger("edge")

SWEEP = 2  # reclaimable keys dropped per insertion (below the cap too)
_new = tuple.__new__
_INF = float("inf")
_heappush, _heappop = heapq.heappush, heapq.heappop


class TableFullDecision(Decision):
    """Refused because the store's key table is full of live state (the edge answers 503)."""

    __slots__ = ()
    unavailable = True
    degraded = True


class MemoryStore:
    """allow(key, now=None) for one algorithm, with state held in this process."""

    __slots__ = (
        "algorithm",
        "limit",
        "max_keys",
        "full",
        "_locks",
        "_mask",
        "_states",
        "_heap",
        "_grow",
        "_step",
        "_expires",
        "_clock",
        "_said_full",
    )

    def __init__(self, algorithm, max_keys: int = 100_000, stripes: int = 64, clock=_time):
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys <= 0:
            raise ValueError(f"max_keys must be a positive integer, got {max_keys!r}")
        if stripes <= 0 or stripes & (stripes - 1):
            raise ValueError(f"stripes must be a power of two, got {stripes!r}")
        self.algorithm = algorithm
        self.limit = algorithm.limit
        self.max_keys = max_keys
        self.full = 0  # new keys refused because no state in the table was reclaimable
        self._mask = stripes - 1
        self._locks = tuple(threading.Lock() for _ in range(stripes))
        self._states: dict = {}  # one dict: get/set are atomic; a key's entry changes only under its stripe lock
        self._heap: list = []  # (instant <= the key's expiry, key): one entry per key in _states; guarded by _grow
        self._grow = threading.Lock()
        self._step = algorithm.step
        self._expires = algorithm.expires_at
        self._clock = clock
        self._said_full = -1e18  # monotonic instant of the last "table full" log line

    def allow(self, key, now: float | None = None):
        lock = self._locks[hash(key) & self._mask]
        lock.acquire()  # (acquire/release rather than `with`: half the cost, on every request)
        try:
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
        finally:
            lock.release()

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
            self._add(key, new)
        return decision

    def _room(self, now, lock):
        """Under _grow (and a stripe lock, `lock`): sweep, then make room for one more key.  None when
        there is room, else the TableFullDecision that refuses the new key (counted in .full)."""
        for _ in range(SWEEP):
            if self._drop_reclaimable(now, lock) is not None:
                break
        if len(self._states) >= self.max_keys:
            soonest = self._drop_reclaimable(now, lock)
            if soonest is not None:
                return self._refuse(now, soonest)
        return None

    def _add(self, key, state):
        """Under _grow and the key's stripe lock: a new key's first state."""
        _heappush(self._heap, (self._expires(state), key))
        self._states[key] = state

    def _drop_reclaimable(self, now, held):
        """Under _grow (and the stripe lock `held`): drop the reclaimable key that expired first and
        return None; or, when no key is reclaimable, return the soonest instant one may become so.

        A heap entry whose key was used since (its expiry grew) is pushed back with the current expiry.
        Another stripe's lock is only tried, never waited for (the inserting thread holds its own:
        waiting could deadlock); a key whose lock is busy is being decided right now, so it is not
        reclaimable now: it is set aside and put back unchanged (still a lower bound)."""
        heap, states = self._heap, self._states
        busy = []
        try:
            while heap:
                e, k = heap[0]
                if e > now:
                    return e  # a lower bound of every expiry in the table: nothing is reclaimable
                _heappop(heap)
                state = states.get(k)
                if state is None:
                    continue  # defensive: a key without state has no entry to keep
                klock = self._locks[hash(k) & self._mask]
                if klock is not held and not klock.acquire(False):
                    busy.append((e, k))
                    continue
                try:
                    actual = self._expires(states[k])
                    if actual <= now:
                        del states[k]
                        return None
                finally:
                    if klock is not held:
                        klock.release()
                _heappush(heap, (actual, k))  # used since: its entry moves to its current expiry
            return now + self.algorithm.window if busy else _INF
        finally:
            for entry in busy:
                _heappush(heap, entry)

    def _refuse(self, now, soonest):
        self.full += 1
        wait = max(0.0, soonest - now) if soonest != _INF else self.algorithm.window
        t = monotonic()
        if t - self._said_full >= 60.0:
            self._said_full = t
            a = self.algorithm
            log.warning(
                "limiter key table full: %s %d/%gs holds max_keys = %d states, none reclaimable (each "
                "would decide differently from a fresh key); new keys get 503 until one expires "
                "(the soonest in %.3gs); raise max_keys if these are real clients (%d refused so far)",
                a.name,
                a.limit,
                a.window,
                self.max_keys,
                wait,
                self.full,
            )
        return _new(TableFullDecision, (False, self.limit, 0, wait, wait))

    def __len__(self):
        """Number of keys currently holding state (a snapshot)."""
        return len(self._states)

    def clear(self):
        for lock in self._locks:  # the stripe locks before _grow, the order allow() takes them in
            lock.acquire()
        try:
            with self._grow:
                self._states.clear()
                self._heap.clear()
        finally:
            for lock in self._locks:
                lock.release()

    def __repr__(self):
        return f"MemoryStore({self.algorithm!r}, max_keys={self.max_keys}, stripes={self._mask + 1})"


def allow_all_memory(checks, now: float | None = None):
    """Every check's stripe lock, then (when a key is new) its store's growth lock, each set in one
    global order (id), held from the first look to the commit: no other decision interleaves, and no
    two requests deadlock (MemoryStore.allow takes a stripe lock, then its growth lock, and only ever
    tries other stripes' locks)."""
    locks = [lim._locks[hash(key) & lim._mask] for lim, key, _ in checks]
    held = sorted({id(lk): lk for lk in locks}.items())
    for _, lk in held:
        lk.acquire()
    grows: Sequence[tuple[int, threading.Lock]] = ()  # the growth locks held (by id), when a key is new
    try:
        if now is None:
            now = checks[0][0]._clock()  # under the locks, as MemoryStore.allow reads it
        states = [lim._states.get(key) for lim, key, _ in checks]
        if None in states:
            grows = sorted({id(lim._grow): lim._grow for (lim, _, _), st in zip(checks, states) if st is None}.items())
            for _, g in grows:
                g.acquire()
        admitted = True
        trials = []
        for (lim, _, enforce), lock, state in zip(checks, locks, states):
            if state is None:
                new, d = lim._step(None, now)
                if d[0]:
                    full = lim._room(now, lock)  # a new key needs room under the global cap
                    if full is not None:
                        new, d = None, full
            else:
                # The sliding log steps its list in place: decide on a copy until we know we commit.
                new, d = lim._step(state[:] if type(state) is list else state, now)
            trials.append((new, d))
            if enforce and not d[0]:
                admitted = False
        if admitted:
            for (lim, key, _), state, (new, d) in zip(checks, states, trials):
                if d[0]:  # (a dry-run check that would have rejected stays unchanged)
                    if state is None:
                        lim._add(key, new)
                    else:
                        lim._states[key] = new
        return admitted, [t[1] for t in trials]
    finally:
        for _, g in reversed(grows):
            g.release()
        for _, lk in reversed(held):
            lk.release()
