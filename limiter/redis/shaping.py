"""Cost and delay mode on Redis: the scripts for limiter.shaping's subclasses, registered with the store.

The same division of labour as limiter.redis.store: the script decides and writes atomically, returning
the state it read; the Decision (delay included) is the shaped step() on that state.  Each script is the
shaped step's arithmetic over the base algorithm's state shape, every algorithm with a cost and a delay:

    token-bucket     the balance may go negative: "%.17g" writes it as it is
    fixed-window     a reservation writes the window it will run in
    sliding-counter  the run instant is the memory store's exact threshold search, ported (_THRESHOLD over
                     _FLOATS: nextafter from frexp/ldexp; Lua numbers are doubles, as Python floats)
    sliding-log      c entries per request; the reply carries the log's length, newest entry and the m-th
                     oldest (the run instant): a stand-in log (_shaped_sl_state) exact for the decision

A held request's wait is _delta(due, now) <= max_delay in both languages (delta in _FLOATS) for the
counter and the log; token-bucket and fixed-window compare `due - now <= D` in Lua, which can differ
from Python's nudged _delta only when the wait is within an ulp of D.
"""

from __future__ import annotations

from limiter.redis.scripts import lua
from limiter.redis.store import _COMMON, _PEEKS, _SCRIPTS, _fw_state, _sc_state, _tb_state
from limiter.shaping import ShapedFixedWindow, ShapedSlidingCounter, ShapedSlidingLog, ShapedTokenBucket

# The scripts, in limiter/redis/lua/ (floats.lua: nextafter and _delta; threshold.lua: the counter's search)
TOKEN_BUCKET = _COMMON + lua("shaped_token_bucket.lua")
FIXED_WINDOW = _COMMON + lua("shaped_fixed_window.lua")
_FLOATS = lua("floats.lua")
_THRESHOLD = lua("threshold.lua")
SLIDING_COUNTER = _COMMON + _FLOATS + _THRESHOLD + lua("shaped_sliding_counter.lua")
SLIDING_LOG = _COMMON + _FLOATS + lua("shaped_sliding_log.lua")
PEEK_SLIDING_LOG = lua("peek_shaped_sliding_log.lua")


def _shaped_sl_state(raw):
    """A stand-in log with the real one's length, newest entry and m-th oldest (every entry > now): what
    ShapedSlidingLog.step reads, so it decides and reports on it exactly as on the real log.  After an
    admission its middle is not the real one's: the store keeps only denials (exact_after_admission)."""
    parts = raw.split()
    n = int(parts[0])
    if not n:
        return None
    last = float(parts[1])
    if len(parts) == 2:
        return [last] * n
    m = int(parts[2])
    return [float(parts[3])] * m + [last] * (n - m)


_shaped_sl_state.exact_after_admission = False  # type: ignore[attr-defined]

_PEEKS[ShapedSlidingLog] = PEEK_SLIDING_LOG

_SCRIPTS.update(
    {
        ShapedTokenBucket: (TOKEN_BUCKET, _tb_state, lambda a: (a.capacity, a.per_token, a.rate, a.cost, a.max_delay)),
        ShapedFixedWindow: (FIXED_WINDOW, _fw_state, lambda a: (a.window, a.limit, a.cost, a.max_delay)),
        ShapedSlidingCounter: (SLIDING_COUNTER, _sc_state, lambda a: (a.window, a.limit, a.cost, a.max_delay)),
        ShapedSlidingLog: (SLIDING_LOG, _shaped_sl_state, lambda a: (a.window, a.limit, a.cost, a.max_delay)),
    }
)
