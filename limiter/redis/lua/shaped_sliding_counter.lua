-- ARGV: now, grace_ms, window, limit, cost, max_delay.  Without a delay the base rule at the request's
-- instant; with one, ShapedSlidingCounter's threshold search (SlidingCounter._earliest and _first_true,
-- the same float expressions walking the same floats) gives the run instant, which may roll the state
-- into the next window.
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
