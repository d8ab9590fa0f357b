-- ARGV: now, grace_ms, window, limit
local w = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local k = window_index(now, w)
local at = now
local raw = redis.call('GET', KEYS[1])
local prev, cur = 0, 0
local changed = true
if raw then
  local a, b, c = string.match(raw, '^(%S+) (%S+) (%S+)$')
  local sk = tonumber(a)
  prev = tonumber(b)
  cur = tonumber(c)
  if k == sk then
    changed = false
  elseif k == sk + 1 then
    prev = cur
    cur = 0
  elseif k > sk then
    prev = 0
    cur = 0
  else  -- an instant older than the state's window: judged at that window's start
    k = sk
    at = sk * w
    changed = false
  end
end
local ok = false
if prev ~= 0 then
  local p = prev * (1.0 - (at - k * w) / w)
  if p + cur < limit then
    cur = cur + 1
    ok = true
  end
elseif cur < limit then
  cur = cur + 1
  ok = true
end
if ok or changed then
  local expires = (k + 1) * w
  if cur ~= 0 then expires = (k + 2) * w end
  redis.call('SET', KEYS[1], string.format('%.17g %d %d', k, prev, cur), 'PX', ttl_ms(expires, now, grace))
end
if ok then return reply('1', raw) end
return reply('0', raw)
