"""The four rate-limiting algorithms as pure arithmetic over (state, now).

Every algorithm object is immutable configuration (limit, window, ...) plus two functions:

    step(state, now)    -> (new_state, Decision)   # state None means "never seen / fully idle"
    expires_at(state)   -> float                   # from this instant on, state behaves exactly like None

No clock, no locks, no storage: a store (memory.py today, Redis later) fetches the state for a key,
calls step, and writes the new state back atomically.  The Redis store's Lua scripts mirror the same
arithmetic over the same state shapes (documented on each class and in docs/limiter.md).

Exactness.  Each rule is written as "allowed iff now >= threshold(state)" with the threshold computed
from the state alone, so `retry_after` (threshold - now, nudged up by an ulp where now + r would round
below the threshold) is exact at float granularity: asking at now + retry_after succeeds and asking at
the float just before it fails.  Window boundaries are the floats k * window (see _window_index).
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections import namedtuple

_nextafter = math.nextafter
_INF = math.inf


class Decision(namedtuple("Decision", "allowed limit remaining reset retry_after")):
    """The answer to one allow(): a tuple (allowed, limit, remaining, reset, retry_after).

    allowed      bool   whether this request is admitted (and counted)
    limit        int    the configured N
    remaining    int    requests still admitted right now, after this one (0 when rejected)
    reset        float  seconds until the full quota is available again
    retry_after  float  seconds until a request could next succeed (0.0 when allowed)
    """

    __slots__ = ()


_new = tuple.__new__  # Decision built without namedtuple's Python-level __new__ (measured: ~2x faster)


def _delta(x: float, now: float) -> float:
    """Seconds from now until instant x, rounded so that now + result >= x (never in the past)."""
    r = x - now
    if r <= 0.0:
        return 0.0
    while now + r < x:
        r = _nextafter(r, _INF)
    return r


def _first_true(pred, lo: float, hi: float, guess: float) -> float:
    """Earliest float x in [lo, hi] with pred(x) true, pred monotone (false...true) and pred(hi) true.

    Starts from an analytic guess and walks ulps; falls back to bisection on floats.
    """
    x = min(max(guess, lo), hi)
    if pred(x):
        for _ in range(64):
            if x <= lo:
                return lo
            y = _nextafter(x, -_INF)
            if not pred(y):
                return x
            x = y
        f, t = lo, x  # pred(lo) unknown
        if pred(f):
            return f
    else:
        for _ in range(64):
            x = _nextafter(x, _INF)
            if x >= hi:
                return hi
            if pred(x):
                return x
        f, t = x, hi
    while True:  # invariant: pred(f) false, pred(t) true
        m = f + (t - f) / 2.0
        if m <= f or m >= t:
            return t
        if pred(m):
            t = m
        else:
            f = m


# Counts are exact in a double (Lua's only number type, and the Redis scripts' arithmetic) below 2^53;
# at or above it Lua and Python round differently (a 10^18 token bucket never emptied).  Windows under a
# millisecond put the window index of an ordinary clock above 2^53 too (3 per 0.001 ms at now = 1e12:
# the Redis store admitted 20 of 20), and are below what a request's instant means anyway.
MAX_COUNT = 2**53 - 1
MIN_WINDOW = 0.001


def _check_limit(limit, what="limit"):
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"{what} must be a positive integer (requests per window), got {limit!r}")
    if limit > MAX_COUNT:
        raise ValueError(f"{what} must be at most 2^53 - 1 = {MAX_COUNT} (exact in a double), got {limit!r}")
    return limit


def _check_window(window):
    try:
        w = float(window)
    except (TypeError, ValueError):
        w = math.nan
    if isinstance(window, bool) or not (w > 0.0) or w == _INF:
        raise ValueError(f"window must be a positive finite number of seconds, got {window!r}")
    if w < MIN_WINDOW:
        raise ValueError(f"window must be at least 1 ms ({MIN_WINDOW} s), got {window!r}")
    return w


class _Algorithm:
    name = ""
    __slots__ = ("limit", "window")

    def __init__(self, limit: int, window: float):
        self.limit = _check_limit(limit)
        self.window = _check_window(window)

    def __repr__(self):
        return f"{type(self).__name__}(limit={self.limit}, window={self.window})"

    # Shared by the two windowed algorithms: window k is [k*W, (k+1)*W) with the products in floats.
    def _window_index(self, now: float) -> int:
        """Largest k with float(k * window) <= now, so boundaries are exactly the floats k * window."""
        w = self.window
        k = int(now // w)
        if (k + 1) * w <= now:
            k += 1
        elif k * w > now:
            k -= 1
        return k


class TokenBucket(_Algorithm):
    """Token bucket: capacity C (= burst, default N) refilled at N/window tokens per second.

    State: (tokens, stamp) -- float tokens in [0, C] as of instant stamp.  None = a full bucket.
    Refill is lazy: at now, tokens + (now - stamp) * rate, capped at C.
      allowed iff tokens >= 1 or now >= stamp + (1 - tokens) * T        (T = window / N, seconds per token)
      full at     stamp + (C - tokens) * T   (reset; also when the state may be dropped)
    A rejection does not change the state.
    """

    name = "token-bucket"
    __slots__ = ("capacity", "rate", "per_token", "_cap", "_brim", "_brimmed")

    def __init__(self, limit: int, window: float, burst=None):
        super().__init__(limit, window)
        if burst is None:
            burst = self.limit
        elif isinstance(burst, bool) or not isinstance(burst, int) or burst <= 0:
            raise ValueError(f"burst must be a positive integer (bucket capacity in requests), got {burst!r}")
        else:
            _check_limit(burst, "burst")
        self.capacity = burst
        self.rate = self.limit / self.window  # tokens per second
        self.per_token = self.window / self.limit  # seconds per token
        # step()'s: C as a float (exact below 2^53: the same arithmetic, at float speed) and the state
        # just after a full bucket admitted one, C - 1 tokens.
        self._cap = float(burst)
        self._brim = self._cap - 1.0
        # the last Decision of that case (immutable): the next one is most often the same, reset too
        self._brimmed = _new(Decision, (True, self.limit, burst - 1, -1.0, 0.0))

    def __repr__(self):
        return f"TokenBucket(limit={self.limit}, window={self.window}, burst={self.capacity})"

    def step(self, state, now):
        cap = self._cap
        if state is None:
            return (self._brim, now), _new(
                Decision, (True, self.limit, self.capacity - 1, _delta(now + self.per_token, now), 0.0)
            )
        tokens, stamp = state
        T = self.per_token
        if now > stamp and now >= stamp + (cap - tokens) * T:
            # Full again (a client under its limit, the common case): what the branch below computes, as
            # for a fresh key -- refilled to C, one spent, C - 1 left, full again one token from now.
            full = now + T
            r = full - now
            if now + r < full:  # rare: the subtraction rounded down (see _delta)
                r = _delta(full, now)
            d = self._brimmed
            if d[3] != r:
                self._brimmed = d = _new(Decision, (True, self.limit, self.capacity - 1, r, 0.0))
            return (self._brim, now), d
        if tokens >= 1.0 or now >= stamp + (1.0 - tokens) * T:
            if now > stamp:
                tokens = tokens + (now - stamp) * self.rate  # (not full: the branch above)
                stamp = now
            if tokens < 1.0:  # the threshold rule said yes; the refill product rounded just below 1
                tokens = 1.0
            tokens -= 1.0
            # remaining: further requests admitted at this same instant = whole tokens left
            full = stamp + (cap - tokens) * T
            r = full - now
            if now + r < full:  # rare: the subtraction rounded down (see _delta)
                r = _delta(full, now)
            return (tokens, stamp), _new(Decision, (True, self.limit, int(tokens), r, 0.0))
        return state, _new(
            Decision,
            (False, self.limit, 0, _delta(stamp + (cap - tokens) * T, now), _delta(stamp + (1.0 - tokens) * T, now)),
        )

    def expires_at(self, state):
        tokens, stamp = state
        return stamp + (self.capacity - tokens) * self.per_token


class FixedWindow(_Algorithm):
    """Fixed window: a counter per clock-aligned window [k*W, (k+1)*W).

    State: (k, count) -- the window index (int) and requests admitted in it.
      allowed iff (window index of now != k) or count < N
      retry_after / reset: (k+1)*W - now
    """

    name = "fixed-window"
    __slots__ = ()

    def step(self, state, now):
        w = self.window
        k = int(now // w)  # _window_index inlined: step() is the per-request hot path
        if (k + 1) * w <= now:
            k += 1
        elif k * w > now:
            k -= 1
        if state is None or state[0] != k:
            if state is not None and state[0] > k:  # an older instant than the state: count in the newer window
                k, count = state
            else:
                count = 0
        else:
            count = state[1]
        limit = self.limit
        end = (k + 1) * w
        if count < limit:
            count += 1
            r = end - now
            if now + r < end:  # rare: the subtraction rounded down (see _delta)
                r = _delta(end, now)
            return (k, count), _new(Decision, (True, limit, limit - count, r, 0.0))
        d = _delta(end, now)
        return (k, count), _new(Decision, (False, limit, 0, d, d))

    def expires_at(self, state):
        return (state[0] + 1) * self.window


class SlidingLog(_Algorithm):
    """Sliding window log: the exact reference.

    State: a sorted list of expiry instants e = t + W, one per admitted request t, at most N long.
    A request admitted at t counts at x iff x < t + W (i.e. t is in the trailing window (x-W, x]).
      Time never runs backwards for a key: a request is judged at at = max(now, log[-1] - W), the newest
      admitted instant (as the float the log holds), so an instant that reaches the key late -- read
      outside any lock, or from an edge whose clock is behind -- is judged as if it came just after it.
      allowed iff fewer than N entries are > at; on admit the entries <= at go and at + W is appended.
      A denial changes nothing: pruning then, at a later instant than a late request's, would have
      hidden from it entries still in its window (the Redis store admitted 112 of 100 that way).
      retry_after: the oldest entry still counted leaving; reset: log[-1] - now (the newest leaving)
    The list is updated in place and returned (the store owns it; step does no I/O).
    The Redis script (limiter/redis/lua/sliding_log.lua) evaluates the same expressions.
    """

    name = "sliding-log"
    __slots__ = ()

    def step(self, state, now):
        w = self.window
        if state is None:
            state = [now + w]
            return state, _new(Decision, (True, self.limit, self.limit - 1, _delta(state[0], now), 0.0))
        at = now
        if state:
            t = state[-1] - w
            if t > at:
                at = t
        i = bisect_right(state, at) if state and state[0] <= at else 0
        n = len(state) - i
        limit = self.limit
        if n < limit:
            if i:
                del state[:i]
            e = at + w
            if not state or e >= state[-1]:
                state.append(e)
            else:  # at + W rounded an ulp below the newest entry: keep the log sorted
                insort(state, e)
            last = state[-1]
            r = last - now
            if now + r < last:  # rare: the subtraction rounded down (see _delta)
                r = _delta(last, now)
            return state, _new(Decision, (True, limit, limit - n - 1, r, 0.0))
        return state, _new(Decision, (False, limit, 0, _delta(state[-1], now), _delta(state[i + n - limit], now)))

    def expires_at(self, state):
        return state[-1] if state else -_INF


class SlidingCounter(_Algorithm):
    """Sliding window counter: previous and current fixed-window counts, previous weighted by overlap.

    State: (k, prev, cur) -- current window index, admitted count in window k-1, admitted count in window k.
      estimate(now) = prev * (1 - (now - k*W) / W) + cur        (rolled forward to now's window first)
      allowed iff estimate < N
    retry_after and reset are solved exactly for this rule (the earliest float instant at which 1,
    resp. N, requests would be admitted), across the rollover into the next window if needed.
    """

    name = "sliding-counter"
    __slots__ = ("_memo",)

    def __init__(self, limit: int, window: float):
        super().__init__(limit, window)
        # Thresholds depend on the state alone (see _at), so they are memoised per (k, prev, cur, extra):
        # a hot key being rejected, or many keys in the same state, pay for the solver once.  Bounded;
        # dict get/set/clear are atomic under the GIL, and a lost race only recomputes.
        self._memo: dict = {}

    def _at(self, k, prev, cur, extra):
        """The earliest float instant in window k or later at which extra + 1 requests in a row would be
        admitted, given the state (k, prev, cur): a function of the state only."""
        key = (k, prev, cur, extra)
        x = self._memo.get(key)
        if x is None:
            x = self._earliest(k, prev, cur, k * self.window, extra)
            if len(self._memo) >= 4096:
                self._memo.clear()
            self._memo[key] = x
        return x

    def _earliest(self, k, prev, cur, now, extra):
        """Earliest float instant >= now at which extra + 1 requests in a row would be admitted.

        (k, prev, cur) is the state already rolled to now's window.  The predicates below are the exact
        float expressions step() evaluates in window k and in window k+1, so the answer is consistent
        with step() at float granularity.
        """
        w, n = self.window, self.limit
        start, end = k * w, (k + 1) * w
        c = cur + extra
        if c < n:
            if not prev:
                return now

            def pred(x):
                return prev * (1.0 - (x - start) / w) + c < n

            if pred(now):
                return now
            # In window k the estimate falls linearly towards c < N: it crosses N before the end (or, at
            # the latest, at the rollover, where the estimate is cur * 1 + extra = c < N).
            return _first_true(pred, now, end, start + w * (1.0 - (n - c) / prev))
        # Not before the rollover: in window k+1, prev' = cur and cur' = 0.

        def pred1(x):
            return cur * (1.0 - (x - end) / w) + extra < n

        return _first_true(pred1, end, (k + 2) * w, end + w * (1.0 - (n - extra) / cur))

    def step(self, state, now):
        w = self.window
        k = int(now // w)  # _window_index inlined: step() is the per-request hot path
        if (k + 1) * w <= now:
            k += 1
        elif k * w > now:
            k -= 1
        if state is None:
            prev = cur = 0
        else:
            sk, prev, cur = state
            if k != sk:
                if k == sk + 1:
                    prev, cur = cur, 0
                elif k > sk:
                    prev = cur = 0
                else:
                    return self._step_older(state, now)
        limit = self.limit
        if prev:
            p = prev * (1.0 - (now - k * w) / w)
            if p + cur < limit:
                cur += 1
                # remaining: how many more requests p + (cur + j) < N admits at this same instant
                r = math.ceil(limit - p - cur)
                if r < 0:
                    r = 0
                while r > 0 and not (p + (cur + r - 1) < limit):
                    r -= 1
                while p + (cur + r) < limit:
                    r += 1
                reset = _delta(self._at(k, 0, cur, limit - 1), now)  # with cur >= 1 it only depends on (k, cur)
                return (k, prev, cur), _new(Decision, (True, limit, r, reset, 0.0))
        elif cur < limit:
            cur += 1
            reset = _delta(self._at(k, 0, cur, limit - 1), now)
            return (k, 0, cur), _new(Decision, (True, limit, limit - cur, reset, 0.0))
        return (k, prev, cur), _new(
            Decision,
            (False, limit, 0, _delta(self._at(k, prev, cur, limit - 1), now), _delta(self._at(k, prev, cur, 0), now)),
        )

    def _step_older(self, state, now):
        """An instant older than the state's window (threads racing on one key): judge it at that
        window's start, report the durations from the caller's now."""
        at = state[0] * self.window
        new, d = self.step(state, at)
        retry = _delta(at + d.retry_after, now) if not d.allowed else 0.0
        return new, _new(Decision, (d.allowed, d.limit, d.remaining, _delta(at + d.reset, now), retry))

    def expires_at(self, state):
        k, prev, cur = state
        return (k + 2) * self.window if cur else (k + 1) * self.window


ALGORITHMS = {cls.name: cls for cls in (TokenBucket, FixedWindow, SlidingLog, SlidingCounter)}
