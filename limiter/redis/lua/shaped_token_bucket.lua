-- ARGV: now, grace_ms, capacity, per_token (T), rate, cost, max_delay
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
