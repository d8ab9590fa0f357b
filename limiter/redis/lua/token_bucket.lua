-- ARGV: now, grace_ms, capacity, per_token (T), rate. In every script: now, then the limiter's constants
-- (RedisStore bakes those into the script's head: one SHA per configuration)
local cap = tonumber(ARGV[3])
local T = tonumber(ARGV[4])
local rate = tonumber(ARGV[5])
local raw = redis.call('GET', KEYS[1])
local tokens, stamp
if not raw then
  tokens = cap - 1.0
  stamp = now
else
  local sep = string.find(raw, ' ', 1, true)
  tokens = tonumber(string.sub(raw, 1, sep - 1))
  stamp = tonumber(string.sub(raw, sep + 1))
  if not (tokens >= 1.0 or now >= stamp + (1.0 - tokens) * T) then
    return reply('0', raw)
  end
  if now > stamp then
    if now >= stamp + (cap - tokens) * T then tokens = cap else tokens = tokens + (now - stamp) * rate end
    stamp = now
  end
  if tokens < 1.0 then tokens = 1.0 end
  tokens = tokens - 1.0
end
redis.call('SET', KEYS[1], string.format('%.17g %.17g', tokens, stamp),
           'PX', ttl_ms(stamp + (cap - tokens) * T, now, grace))
return reply('1', raw)
