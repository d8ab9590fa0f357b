-- Read-only: the same state part the decision scripts reply with, nothing written (RedisStore.peek).
local raw = redis.call('GET', KEYS[1])
if raw then return '1 ' .. raw end
return '1'
