-- Shared by every script: the window index (FixedWindow/SlidingCounter._window_index) and the TTL.
local function window_index(now, w)
  local k = math.floor(now / w)
  if (k + 1) * w <= now then k = k + 1 elseif k * w > now then k = k - 1 end
  return k
end
local function reply(ok, raw)  -- one bulk string: cheaper for the client to parse than an array
  if raw then return ok .. ' ' .. raw end
  return ok
end
local function ttl_ms(expires_at, now, grace)
  local ms = math.ceil((expires_at - now) * 1000) + grace
  if ms < 1 then ms = 1 end
  return ms
end
local now = tonumber(ARGV[1])
local grace = tonumber(ARGV[2])
