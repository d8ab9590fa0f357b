-- ARGV: now, grace_ms, window, limit.  Returns "<admitted> <n>[ <first> <last>]" -- n: the entries the
-- request was judged against, first: the oldest of them, last: the newest expiry (the scores exactly as
-- Redis printed them): all SlidingLog.step needs.  As SlidingLog.step: judged at at = max(now, newest
-- expiry - W) (time never runs backwards for a key), entries > at counted, pruned only on admission.
local w = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local key = KEYS[1]
local at = now
local lastn = -math.huge
local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if newest[2] then
  lastn = tonumber(newest[2])
  local t = lastn - w
  if t > at then at = t end
end
local ats = string.format('%.17g', at)
local n = 0
if lastn > at then n = redis.call('ZCOUNT', key, '(' .. ats, '+inf') end
local pre = tostring(n)
if n > 0 then
  local first = redis.call('ZRANGEBYSCORE', key, '(' .. ats, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2]
  pre = pre .. ' ' .. first .. ' ' .. newest[2]
end
if n < limit then
  redis.call('ZREMRANGEBYSCORE', key, '-inf', ats)
  local e = at + w
  local es = string.format('%.17g', e)
  local i = 0
  if lastn >= e then i = redis.call('ZCOUNT', key, es, es) end  -- equal expiries need distinct members
  redis.call('ZADD', key, es, es .. '#' .. i)
  if lastn > e then e = lastn end
  redis.call('PEXPIRE', key, ttl_ms(e, now, grace))
  return reply('1', pre)
end
return reply('0', pre)
