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

from limiter.redis.store import _COMMON, _PEEKS, _SCRIPTS, _fw_state, _sc_state, _tb_state
from limiter.shaping import ShapedFixedWindow, ShapedSlidingCounter, ShapedSlidingLog, ShapedTokenBucket

# ARGV: now, grace_ms, capacity, per_token (T), rate, cost, max_delay
TOKEN_BUCKET = _COMMON + """
local cap = tonumber(ARGV[3])
local T = tonumber(ARGV[4])
local rate = tonumber(ARGV[5])
local c = tonumber(ARGV[6])
local D = tonumber(ARGV[7])
local raw = redis.call('GET', KEYS[1])
local tokens, stamp = cap, now
if raw then
  local sep = string.find(raw, ' ', 1, true)
  tokens = tonumber(string.sub(raw, 1, sep - 1))
  stamp = tonumber(string.sub(raw, sep + 1))
end
local due = stamp + (c - tokens) * T
if tokens >= c or now >= due then
  if now > stamp then
    if now >= stamp + (cap - tokens) * T then tokens = cap else tokens = tokens + (now - stamp) * rate end
    stamp = now
  end
  if tokens < c then tokens = c end
  tokens = tokens - c
elseif D > 0 and due - now <= D then  -- held: its tokens reserved now, the balance below zero
  if now > stamp then
    tokens = tokens + (now - stamp) * rate
    stamp = now
  end
  tokens = tokens - c
else
  return reply('0', raw)
end
redis.call('SET', KEYS[1], string.format('%.17g %.17g', tokens, stamp),
           'PX', ttl_ms(stamp + (cap - tokens) * T, now, grace))
return reply('1', raw)
"""

# ARGV: now, grace_ms, window, limit, cost, max_delay
FIXED_WINDOW = _COMMON + """
local w = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local c = tonumber(ARGV[5])
local D = tonumber(ARGV[6])
local k = window_index(now, w)
local raw = redis.call('GET', KEYS[1])
local sk, count = k, 0
if raw then
  local sep = string.find(raw, ' ', 1, true)
  local rk = tonumber(string.sub(raw, 1, sep - 1))
  if rk >= k then
    sk = rk
    count = tonumber(string.sub(raw, sep + 1))
  end
end
local ok = false
if sk > k and D == 0 then  -- a racing instant: counted in the newer window, as the base rule does
  ok = count + c <= limit
else
  if count + c > limit then
    sk = sk + 1
    count = 0
  end
  ok = sk == k or (D > 0 and sk * w - now <= D)
end
if not ok then return reply('0', raw) end
count = count + c
redis.call('SET', KEYS[1], string.format('%.17g %d', sk, count), 'PX', ttl_ms((sk + 1) * w, now, grace))
return reply('1', raw)
"""

# Python's math.nextafter and limiter.algorithms._delta / _first_true, for the doubles of an instant (>= 0)
_FLOATS = """
local TINY = 4.9406564584124654e-324
local function up(x)  -- the next double above x
  if x == 0 then return TINY end
  local _, e = math.frexp(x)  -- x = m * 2^e, 0.5 <= m < 1: its ulp is 2^(e - 53)
  return x + math.ldexp(1, e - 53)
end
local function down(x)  -- the next double below x >= 0
  if x == 0 then return -TINY end
  local m, e = math.frexp(x)
  if m == 0.5 then return x - math.ldexp(1, e - 54) end
  return x - math.ldexp(1, e - 53)
end
local function delta(x, t)  -- seconds from t until x, rounded so that t + result >= x
  local r = x - t
  if r <= 0 then return 0.0 end
  while t + r < x do r = up(r) end
  return r
end
"""

# SlidingCounter._earliest and _first_true: the same float expressions walking the same floats
_THRESHOLD = """
local function first_true(pred, lo, hi, guess)  -- the earliest float in [lo, hi] with pred, pred(hi) true
  local x = math.min(math.max(guess, lo), hi)
  local f, t
  if pred(x) then
    for _ = 1, 64 do
      if x <= lo then return lo end
      local y = down(x)
      if not pred(y) then return x end
      x = y
    end
    f, t = lo, x
    if pred(f) then return f end
  else
    for _ = 1, 64 do
      x = up(x)
      if x >= hi then return hi end
      if pred(x) then return x end
    end
    f, t = x, hi
  end
  while true do
    local m = f + (t - f) / 2.0
    if m <= f or m >= t then return t end
    if pred(m) then t = m else f = m end
  end
end
local function earliest(sk, prev, cur, extra, w, limit)  -- the first instant >= sk*W: extra + 1 in a row pass
  local start, stop = sk * w, (sk + 1) * w
  local cc = cur + extra
  if cc < limit then
    if prev == 0 then return start end
    local function pred(x) return prev * (1.0 - (x - start) / w) + cc < limit end
    if pred(start) then return start end
    return first_true(pred, start, stop, start + w * (1.0 - (limit - cc) / prev))
  end
  local function pred1(x) return cur * (1.0 - (x - stop) / w) + extra < limit end
  return first_true(pred1, stop, (sk + 2) * w, stop + w * (1.0 - (limit - extra) / cur))
end
"""

# ARGV: now, grace_ms, window, limit, cost, max_delay.  Without a delay the base rule at the request's
# instant; with one, ShapedSlidingCounter's threshold search (SlidingCounter._earliest and _first_true,
# the same float expressions walking the same floats) gives the run instant, which may roll the state
# into the next window.
SLIDING_COUNTER = _COMMON + _FLOATS + _THRESHOLD + """
local w = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local c = tonumber(ARGV[5])
local D = tonumber(ARGV[6])
local k = window_index(now, w)
local raw = redis.call('GET', KEYS[1])
local sk, prev, cur = k, 0, 0
if raw then
  local a, b, d = string.match(raw, '^(%S+) (%S+) (%S+)$')
  sk = tonumber(a)
  prev = tonumber(b)
  cur = tonumber(d)
  if k > sk then
    if k == sk + 1 then prev = cur else prev = 0 end
    cur = 0
    sk = k
  end
end
local ok
if D == 0 then
  local at = now
  if sk > k then at = sk * w end  -- a racing instant: judged at the state's window start
  if prev ~= 0 then
    ok = prev * (1.0 - (at - sk * w) / w) + (cur + c - 1) < limit
  else
    ok = cur + c - 1 < limit
  end
else
  local due = earliest(sk, prev, cur, c - 1, w, limit)
  ok = due <= now
  if not ok and delta(due, now) <= D then  -- held until due: charged to the window it runs in
    ok = true
    local kt = window_index(due, w)
    if kt > sk then
      if kt == sk + 1 then prev = cur else prev = 0 end
      cur = 0
      sk = kt
    end
  end
end
if not ok then return reply('0', raw) end
cur = cur + c
redis.call('SET', KEYS[1], string.format('%.17g %d %d', sk, prev, cur), 'PX', ttl_ms((sk + 2) * w, now, grace))
return reply('1', raw)
"""

# ARGV: now, grace_ms, window, limit, cost, max_delay.  Reply "<0|1>[ <L> <last>[ <m> <due>]]": L the entries
# still counting (> now), last the newest; when m = L - (N - c) > 0 entries must leave first, due is the
# m-th oldest of them (the run instant).  All ShapedSlidingLog.step reads (see _shaped_sl_state).
SLIDING_LOG = _COMMON + _FLOATS + """
local w = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local c = tonumber(ARGV[5])
local D = tonumber(ARGV[6])
local key = KEYS[1]
local nows = '(' .. string.format('%.17g', now)
local L = redis.call('ZCOUNT', key, nows, '+inf')
local pre = '0'
local last = nil
local e = now + w
if L > 0 then
  last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2]
  pre = L .. ' ' .. last
  local m = L - (limit - c)
  if m > 0 then
    local dues = redis.call('ZRANGEBYSCORE', key, nows, '+inf', 'WITHSCORES', 'LIMIT', m - 1, 1)[2]
    pre = pre .. ' ' .. m .. ' ' .. dues
    local due = tonumber(dues)
    if not (D > 0 and delta(due, now) <= D) then return reply('0', pre) end
    e = due + w  -- held: at due the m-th entry has left
  end
end
-- Pruned only once older than the grace: an instant that reaches the key late (read outside any lock, an
-- edge whose clock is behind) still sees every entry of its window.  Counting every entry > its own
-- instant then bounds every trailing window by N, by each request's own (or run) instant.
redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%.17g', now - grace / 1000))
local es = string.format('%.17g', e)
local i = redis.call('ZCOUNT', key, es, es)  -- equal expiries need distinct members
for j = 0, c - 1 do redis.call('ZADD', key, es, es .. '#' .. (i + j)) end
if last and tonumber(last) > e then e = tonumber(last) end
redis.call('PEXPIRE', key, ttl_ms(e, now, grace))
return reply('1', pre)
"""

# The same reply, nothing written (RedisStore.peek)
PEEK_SLIDING_LOG = """
local limit = tonumber(ARGV[4])
local c = tonumber(ARGV[5])
local key = KEYS[1]
local nows = '(' .. ARGV[1]
local L = redis.call('ZCOUNT', key, nows, '+inf')
if L == 0 then return '1 0' end
local pre = L .. ' ' .. redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2]
local m = L - (limit - c)
if m > 0 then
  pre = pre .. ' ' .. m .. ' ' .. redis.call('ZRANGEBYSCORE', key, nows, '+inf', 'WITHSCORES', 'LIMIT', m - 1, 1)[2]
end
return '1 ' .. pre
"""


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

_SCRIPTS.update({
    ShapedTokenBucket: (TOKEN_BUCKET, _tb_state, lambda a: (a.capacity, a.per_token, a.rate, a.cost, a.max_delay)),
    ShapedFixedWindow: (FIXED_WINDOW, _fw_state, lambda a: (a.window, a.limit, a.cost, a.max_delay)),
    ShapedSlidingCounter: (SLIDING_COUNTER, _sc_state, lambda a: (a.window, a.limit, a.cost, a.max_delay)),
    ShapedSlidingLog: (SLIDING_LOG, _shaped_sl_state, lambda a: (a.window, a.limit, a.cost, a.max_delay)),
})
