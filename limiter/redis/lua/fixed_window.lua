-- ARGV: now, grace_ms, window, limit
local w = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local k = window_index(now, w)
local raw = redis.call('GET', KEYS[1])
local count = 0
if raw then
  local sep = string.find(raw, ' ', 1, true)
  local sk = tonumber(string.sub(raw, 1, sep - 1))
  local sc = tonumber(string.sub(raw, sep + 1))
  if sk == k then
    count = sc
  elseif sk > k then  -- an older instant than the state: count in the newer window
    k = sk
    count = sc
  end
end
if count < limit then
  count = count + 1
  redis.call('SET', KEYS[1], string.format('%.17g %d', k, count), 'PX', ttl_ms((k + 1) * w, now, grace))
  return reply('1', raw)
end
return reply('0', raw)
