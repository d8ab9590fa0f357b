local rcall = redis.call
local writes = {}
local WRITES = {SET = true, ZADD = true, PEXPIRE = true, ZREMRANGEBYSCORE = true}
local proxy = {call = function(cmd, ...)
  if WRITES[cmd] then
    writes[#writes + 1] = {cmd, ...}
    return false
  end
  return rcall(cmd, ...)
end}
local admitted = true
local out = {}
