-- ARGV: now, grace_ms, window, limit, cost, max_delay.  Reply "<0|1>[ <L> <last>[ <m> <due>]]": L the entries
-- still counting (> now), last the newest; when m = L - (N - c) > 0 entries must leave first, due is the
-- m-th oldest of them (the run instant).  All ShapedSlidingLog.step reads (see _shaped_sl_state).
local w = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local c = tonumber(ARGV[5])
local D = tonumber(ARGV[6])
local key = KEYS[1]
local nows = '(' .. string.format('%.17g', now)
local L = redis.call('ZCOUNT', key, nows, '+inf')
local pre = '0'
local last = nil
local e = now + w
if L > 0 then
  last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2]
  pre = L .. ' ' .. last
  local m = L - (limit - c)
  if m > 0 then
    local dues = redis.call('ZRANGEBYSCORE', key, nows, '+inf', 'WITHSCORES', 'LIMIT', m - 1, 1)[2]
    pre = pre .. ' ' .. m .. ' ' .. dues
    local due = tonumber(dues)
    if not (D > 0 and delta(due, now) <= D) then return reply('0', pre) end
    e = due + w  -- held: at due the m-th entry has left
  end
end
-- Pruned only once older than the grace: an instant that reaches the key late (read outside any lock, an
-- edge whose clock is behind) still sees every entry of its window.  Counting every entry > its own
-- instant then bounds every trailing window by N, by each request's own (or run) instant.
redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%.17g', now - grace / 1000))
local es = string.format('%.17g', e)
local i = redis.call('ZCOUNT', key, es, es)  -- equal expiries need distinct members
for j = 0, c - 1 do redis.call('ZADD', key, es, es .. '#' .. (i + j)) end
if last and tonumber(last) > e then e = tonumber(last) end
redis.call('PEXPIRE', key, ttl_ms(e, now, grace))
return reply('1', pre)
