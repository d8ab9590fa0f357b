-- Read-only, the sliding log's: the state part sliding_log.lua replies with, nothing written (RedisStore.peek).
local now = ARGV[1]
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES')
local n = #live / 2
if n == 0 then return '1 0' end
return '1 ' .. n .. ' ' .. live[2] .. ' ' .. live[#live]
