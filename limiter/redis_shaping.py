"""Cost and delay mode on Redis: the scripts for limiter.shaping's subclasses, registered with the store.

The same division of labour as limiter.redis_store: the script decides and writes atomically, returning
the state it read; the Decision (delay included) is the shaped step() on that state.  Each script is the
shaped step's arithmetic over the base algorithm's state shape (so the state parsers are the store's):

    token-bucket     cost and delay  (the balance may go negative: "%.17g" writes it as it is)
    fixed-window     cost and delay  (a reservation writes the window it will run in)
    sliding-counter  cost only       (delay needs the counter's exact threshold search: memory stores only)
    sliding-log      neither         (its reply carries the log's length and ends, not the entry a cost or
                                      a reservation needs)

REDIS_SUPPORT says which; limiter.build and the configuration refuse the rest with one line.  A held
request's wait is compared with max_delay in Lua as `due - now <= D` and in Python with the nudged
`_delta(due, now) <= D`: they can differ only when the wait is within an ulp of D.
"""

from __future__ import annotations

from .redis_store import _COMMON, _SCRIPTS, _fw_state, _sc_state, _tb_state
from .shaping import ShapedFixedWindow, ShapedSlidingCounter, ShapedTokenBucket

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

# ARGV: now, grace_ms, window, limit, cost   (no delay)
SLIDING_COUNTER = _COMMON + """
local w = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local c = tonumber(ARGV[5])
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
local at = now
if sk > k then at = sk * w end  -- a racing instant: judged at the state's window start
local ok
if prev ~= 0 then
  ok = prev * (1.0 - (at - sk * w) / w) + (cur + c - 1) < limit
else
  ok = cur + c - 1 < limit
end
if not ok then return reply('0', raw) end
cur = cur + c
redis.call('SET', KEYS[1], string.format('%.17g %d %d', sk, prev, cur), 'PX', ttl_ms((sk + 2) * w, now, grace))
return reply('1', raw)
"""

_SCRIPTS.update({
    ShapedTokenBucket: (TOKEN_BUCKET, _tb_state, lambda a: (a.capacity, a.per_token, a.rate, a.cost, a.max_delay)),
    ShapedFixedWindow: (FIXED_WINDOW, _fw_state, lambda a: (a.window, a.limit, a.cost, a.max_delay)),
    ShapedSlidingCounter: (SLIDING_COUNTER, _sc_state, lambda a: (a.window, a.limit, a.cost)),
})
