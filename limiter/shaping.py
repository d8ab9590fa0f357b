"""A cost per request and delay mode: the four algorithms charging N units, and reserving a future slot.

    algo = shaped(TokenBucket(10, 1.0), cost=1, max_delay=1.0)
    new, d = algo.step(state, now)      # d.allowed; getattr(d, "delay", 0.0): hold the request that long

Kept apart from limiter.algorithms so the common case pays nothing: shaped() returns the algorithm
itself when cost == 1 and max_delay == 0, else an instance of a subclass (so a store's isinstance checks
and state shapes still hold) whose step() charges `cost` units and, with max_delay > 0, admits a request
at the earliest instant t <= now + max_delay at which it fits -- the slot at t is reserved NOW (written
into the state), so a queue of held requests is exact: each later one fits behind the earlier ones.

nginx's limit_req with burst= and delay= holds excess requests the same way (it lets the bucket's
excess grow and sleeps the request until its turn); this is simpler: one bound, the longest wait.

Per algorithm (W the window, N the limit, c the cost, D the longest delay):
  token-bucket     the balance may go below zero, down to what refills within D: a request is admitted
                   at due = stamp + (c - tokens) * T; held due - now when that is <= D. The state after a
                   held request is (tokens(now) - c, now): negative until its turn has come.
  fixed-window     the request is charged to the window it will run in: the state's window if it has room
                   for c more, else the next one; held until that window starts when <= D. A window ahead
                   of now (a reservation) takes every later request too (conservative: a request never
                   lands in a window before one already reserved).
  sliding-log      the run instant t is the earliest at which at most N - c logged requests are still in
                   the trailing window; c entries t + W are logged. The log then holds up to
                   N * (1 + ceil(D / W)) entries (max_entries: the shared-memory store's slot size).
  sliding-counter  the earliest instant at which estimate + c - 1 < N (the base rule, estimate < N, for
                   c = 1), solved by the base class's exact threshold search; c is added to the window
                   of that instant.
A rejected request changes nothing; its retry_after is the earliest instant from which a request is
accepted again (held, perhaps, up to D), and it is > 0.  With a cost, Limit/Remaining count units.
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from typing import Any

from limiter.algorithms import Decision, FixedWindow, SlidingCounter, SlidingLog, TokenBucket, _delta

_new = tuple.__new__
_nextafter = math.nextafter
_INF = math.inf


class Delayed(Decision):
    """Admitted, to be forwarded only after `delay` seconds (its slot is already reserved)."""

    # not __slots__ = (): an instance carries .delay (made only on the held path)
    delay: float


def _held(limit, reset, delay):
    d = _new(Delayed, (True, limit, 0, reset, 0.0))
    d.delay = delay
    return d


def _retry(due, max_delay, now):
    """Seconds until a request is accepted again: from due - max_delay on it is held <= max_delay (the
    steps' own test, _delta(due, t) <= max_delay, checked; growing steps past its rounding)."""
    r = _delta(due - max_delay, now)
    step = math.ulp(r) if r > 0.0 else 5e-324
    while r <= 0.0 or _delta(due, now + r) > max_delay:
        r += step
        step *= 2.0
    return r


def check_shaping(algorithm, cost, max_delay):
    if isinstance(cost, bool) or not isinstance(cost, int) or cost <= 0:
        raise ValueError(f"cost must be a positive integer (units per request), got {cost!r}")
    most = algorithm.capacity if isinstance(algorithm, TokenBucket) else algorithm.limit
    if cost > most:
        raise ValueError(f"cost {cost} is more than the limit's {most} units: such a request could never be admitted")
    d = float(max_delay) if isinstance(max_delay, (int, float)) else math.nan
    if isinstance(max_delay, bool) or not (0.0 <= d < _INF):
        raise ValueError(f"max_delay must be a finite number of seconds >= 0, got {max_delay!r}")
    return d


def shaped(algorithm, cost: int = 1, max_delay: float = 0.0):
    """The algorithm charging `cost` per request and holding requests up to max_delay seconds."""
    d = check_shaping(algorithm, cost, max_delay)
    if cost == 1 and d == 0.0:
        return algorithm
    cls = _SHAPED[type(algorithm)]
    out = cls.__new__(cls)
    for base in type(algorithm).__mro__:
        for name in getattr(base, "__slots__", ()):
            if hasattr(algorithm, name):
                setattr(out, name, getattr(algorithm, name))
    out.cost, out.max_delay = cost, d
    out._init_shaped()
    return out


class _Shaped:
    __slots__ = ()

    def _init_shaped(self):
        pass

    def __repr__(self):
        return f"{super().__repr__()[:-1]}, cost={self.cost}, max_delay={self.max_delay})"


class ShapedTokenBucket(_Shaped, TokenBucket):
    __slots__ = ("cost", "max_delay")

    def step(self, state, now):
        cap, c, T = self.capacity, self.cost, self.per_token
        tokens, stamp = (float(cap), now) if state is None else state
        due = stamp + (c - tokens) * T  # the instant c tokens are there
        if tokens >= c or now >= due:
            if now > stamp:
                tokens = cap if now >= stamp + (cap - tokens) * T else tokens + (now - stamp) * self.rate
                stamp = now
            if tokens < c:  # the threshold said yes; the refill product rounded just below c
                tokens = float(c)
            tokens -= c
            return (tokens, stamp), _new(
                Decision, (True, self.limit, max(0, int(tokens)), _delta(stamp + (cap - tokens) * T, now), 0.0)
            )
        wait = _delta(due, now)
        if wait <= self.max_delay:
            if now > stamp:  # below c <= cap, so no cap applies on the way
                tokens += (now - stamp) * self.rate
                stamp = now
            tokens -= c
            return (tokens, stamp), _held(self.limit, _delta(stamp + (cap - tokens) * T, now), wait)
        return state, _new(
            Decision, (False, self.limit, 0, _delta(stamp + (cap - tokens) * T, now), _retry(due, self.max_delay, now))
        )


class ShapedFixedWindow(_Shaped, FixedWindow):
    __slots__ = ("cost", "max_delay")

    def step(self, state, now):
        w, n, c, most = self.window, self.limit, self.cost, self.max_delay
        k = self._window_index(now)
        if state is None or state[0] < k:
            sk, count = k, 0
        else:
            sk, count = state  # sk > k: a reservation (or a racing thread's newer instant)
        if sk > k and most == 0.0:
            # Without delay mode a newer window is a racing thread's: counted there, as the base rule does.
            if count + c <= n:
                count += c
                return (sk, count), _new(Decision, (True, n, n - count, _delta((sk + 1) * w, now), 0.0))
            d = _delta((sk + 1) * w, now)
            return state, _new(Decision, (False, n, 0, d, d))
        if count + c > n:
            sk, count = sk + 1, 0  # the next window (c <= N: it has room)
        if sk == k:
            count += c
            return (sk, count), _new(Decision, (True, n, n - count, _delta((sk + 1) * w, now), 0.0))
        start = sk * w
        wait = _delta(start, now)
        if wait <= most:
            return (sk, count + c), _held(n, _delta((sk + 1) * w, now), wait)
        whole = (sk + 1) * w if count else start  # the quota is whole when the last counted window ends
        return state, _new(Decision, (False, n, 0, _delta(whole, now), _retry(start, most, now)))


class ShapedSlidingLog(_Shaped, SlidingLog):
    __slots__ = ("cost", "max_delay", "max_entries")

    def _init_shaped(self):
        self.max_entries = self.limit * (2 + math.ceil(self.max_delay / self.window))  # + a window of margin

    def step(self, state, now):
        w, n, c = self.window, self.limit, self.cost
        if state is None:
            state = []
        elif state and state[0] <= now:
            del state[: bisect_right(state, now)]
        m = len(state) - (n - c)  # entries that must have left before this request fits
        if m <= 0:
            e = now + w
            for _ in range(c):
                if not state or e >= state[-1]:
                    state.append(e)
                else:  # an out-of-order instant from another thread (or a reservation ahead)
                    insort(state, e)
            return state, _new(Decision, (True, n, max(0, n - len(state)), _delta(state[-1], now), 0.0))
        due = state[m - 1]  # > now: entries <= now were pruned
        wait = _delta(due, now)
        if wait <= self.max_delay:
            # due itself: the m-th entry counts while t < e, so at t = due it has left
            for _ in range(c):
                insort(state, due + w)
            return state, _held(n, _delta(state[-1], now), wait)
        return state, _new(Decision, (False, n, 0, _delta(state[-1], now), _retry(due, self.max_delay, now)))


class ShapedSlidingCounter(_Shaped, SlidingCounter):
    __slots__ = ("cost", "max_delay")

    def step(self, state, now):
        w, n, c = self.window, self.limit, self.cost
        k = self._window_index(now)
        if state is None:
            sk, prev, cur = k, 0, 0
        else:
            sk, prev, cur = state
            if k > sk:
                prev, cur = (cur, 0) if k == sk + 1 else (0, 0)
                sk = k
        due = self._at(sk, prev, cur, c - 1)  # earliest instant (>= sk*W) with estimate + c - 1 < N
        # Without delay mode a state ahead of now is a racing thread's: judged at its window's start.
        if due <= (now if self.max_delay > 0.0 or sk == k else max(now, sk * w)):
            t, wait = now if sk == k else sk * w, 0.0
        else:
            wait = _delta(due, now)
            if wait > self.max_delay or self.max_delay == 0.0:
                return state, _new(
                    Decision,
                    (False, n, 0, _delta(self._at(sk, prev, cur, n - 1), now), _retry(due, self.max_delay, now)),
                )
            t = due
        kt = self._window_index(t)
        if kt > sk:  # the run instant is in a later window: roll forward
            prev, cur = (cur, 0) if kt == sk + 1 else (0, 0)
            sk = kt
        cur += c
        reset = _delta(self._at(sk, 0, cur, n - 1), now)
        if wait:
            return (sk, prev, cur), _held(n, reset, wait)
        p = (prev * (1.0 - (now - sk * w) / w) if sk == k else float(prev)) if prev else 0.0
        # remaining (units): as the base rule counts it
        r = max(0, math.ceil(n - p - cur))
        while r > 0 and not (p + (cur + r - 1) < n):
            r -= 1
        while p + (cur + r) < n:
            r += 1
        return (sk, prev, cur), _new(Decision, (True, n, r, reset, 0.0))


_SHAPED: dict[type, Any] = {
    TokenBucket: ShapedTokenBucket,
    FixedWindow: ShapedFixedWindow,
    SlidingLog: ShapedSlidingLog,
    SlidingCounter: ShapedSlidingCounter,
}
