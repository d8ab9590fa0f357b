"""The in-process store: per-key state for one algorithm, lock-striped and bounded.

Layout: `stripes` (default 64) independent shards chosen by hash(key); each has its own lock, its own
dict key -> state, and its own queue of keys for sweeping.  Decisions for one key are serialised by its
stripe's lock; keys in different stripes never wait for each other.

Bounded memory, two mechanisms, both amortised O(1) and paid only when a *new* key is inserted (the
only moment memory grows, so the hot path for known keys does no sweeping at all):

* Idle sweep: each insertion examines up to SWEEP keys at the front of its stripe's queue; a key whose
  state has expired (algorithm.expires_at(state) <= now: from then on the state behaves exactly like a
  fresh key, so dropping it changes no decision) is deleted, a live one is rotated to the back (a
  CLOCK-style sweep).  The sweep visits keys twice as fast as they are inserted.
* Hard cap: a stripe holds at most max_keys // stripes keys; inserting past that evicts the key at the
  front of the queue (the longest since insertion or last sweep visit -- approximately the oldest).
  Unlike the idle sweep, this can forget live state (a client gets a fresh quota): it is the safety
  valve against a key-rotating flood, not the normal path.
"""

from __future__ import annotations

import threading
from collections import deque

SWEEP = 2  # keys examined per insertion


class MemoryStore:
    """allow(key, now) for one algorithm, with state held in this process."""

    __slots__ = ("algorithm", "limit", "max_keys", "_stripes", "_mask", "_step", "_per_stripe", "_expires")

    def __init__(self, algorithm, max_keys: int = 100_000, stripes: int = 64):
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys <= 0:
            raise ValueError(f"max_keys must be a positive integer, got {max_keys!r}")
        if stripes <= 0 or stripes & (stripes - 1):
            raise ValueError(f"stripes must be a power of two, got {stripes!r}")
        while stripes > 1 and stripes > max_keys:  # every stripe must be able to hold at least one key
            stripes //= 2
        self.algorithm = algorithm
        self.limit = algorithm.limit
        self.max_keys = max_keys
        self._mask = stripes - 1
        self._per_stripe = max_keys // stripes  # so the total never exceeds max_keys
        self._stripes = tuple((threading.Lock(), {}, deque()) for _ in range(stripes))
        self._step = algorithm.step
        self._expires = algorithm.expires_at

    def allow(self, key, now: float):
        lock, states, queue = self._stripes[hash(key) & self._mask]
        with lock:
            state = states.get(key)
            if state is not None:
                new, decision = self._step(state, now)
                if new is not state:
                    states[key] = new
                return decision
            # A new key: the only time memory grows, so the only time we sweep (inlined: hot for floods).
            new, decision = self._step(None, now)
            if queue:
                expires = self._expires
                for _ in range(SWEEP):
                    k = queue.popleft()
                    if expires(states[k]) <= now:
                        del states[k]
                        if not queue:
                            break
                    else:
                        queue.append(k)
                if len(states) >= self._per_stripe:  # the hard cap: evict the front (oldest) key
                    del states[queue.popleft()]
            queue.append(key)
            states[key] = new
            return decision

    def __len__(self):
        """Number of keys currently holding state (a snapshot; takes every stripe lock in turn)."""
        total = 0
        for lock, states, _ in self._stripes:
            with lock:
                total += len(states)
        return total

    def clear(self):
        for lock, states, queue in self._stripes:
            with lock:
                states.clear()
                queue.clear()

    def __repr__(self):
        return f"MemoryStore({self.algorithm!r}, max_keys={self.max_keys}, stripes={self._mask + 1})"
