-- The same reply as shaped_sliding_log.lua, nothing written (RedisStore.peek).
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
