-- ARGV: now, grace_ms, window, limit, cost, max_delay
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
