-- A request in flight joins the key's sorted set (score: when it stops counting) unless the set is full.
-- ARGV: now, member. The limit and the ttl are written in by RedisInFlight (one script per limit).
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= LIMIT then return 0 end
redis.call('ZADD', KEYS[1], now + TTL, ARGV[2])
redis.call('PEXPIRE', KEYS[1], math.ceil(TTL * 1000) + 1000)
return 1
