-- wrk2/wrk script for the enforcement rows: one API key, responses counted by status.
--
--   WRK_API_KEY=k1 wrk -t2 -c20 -d60s -R200 --latency -s wrk/limit.lua http://127.0.0.1:8080/
--
-- After the tool's own summary, done() prints the lines that `python -m wrk.loadgen` prints too, with
-- the same labels, so wrk/report.py reads either tool's output:
--
--   responses: 12000
--   status 200: 6012
--   status 429: 5988
--   admitted: 6012 requests, 100.19 req/s (non-429)
--
-- "admitted" is every response that is not a 429; the rate divides it by the measured run time.
--
-- Each thread counts in its own Lua state (response() runs there); done() runs in the main state and
-- reads the threads' counts with thread:get(). Only SCALARS cross that way: wrk2's thread:get() copies
-- a table with its keys and values swapped (its script_copy_value pushes the value before the key), so
-- a table of counts {[200] = 588} arrives as {[588] = 200}. Debian's wrk 4.1 copies tables correctly,
-- which is how the table version looked right there. So each thread keeps one number per status in a
-- global of its own ("status_200") and one string naming the statuses it saw ("200,429").

local key = os.getenv("WRK_API_KEY")
if key and key ~= "" then
  wrk.headers["X-Api-Key"] = key
end

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

local names = {}         -- status -> the name of its counter global, built once per status

function init(args)
  statuses = ""          -- this thread's "200,429": the statuses it has counters for
end

function response(status, headers, body)
  local name = names[status]
  if name == nil then
    name = "status_" .. status
    names[status] = name
    _G[name] = 0
    statuses = statuses == "" and tostring(status) or statuses .. "," .. status
  end
  _G[name] = _G[name] + 1
end

function done(summary, latency, requests)
  local total, by_status, codes = 0, {}, {}
  for _, thread in ipairs(threads) do
    for code in string.gmatch(thread:get("statuses") or "", "%d+") do
      local status, n = tonumber(code), thread:get("status_" .. code)
      if by_status[status] == nil then table.insert(codes, status) end
      by_status[status] = (by_status[status] or 0) + n
      total = total + n
    end
  end
  table.sort(codes)
  local seconds = summary.duration / 1e6
  local admitted = total - (by_status[429] or 0)
  io.write(string.format("responses: %d\n", total))
  for _, status in ipairs(codes) do
    io.write(string.format("status %d: %d\n", status, by_status[status]))
  end
  io.write(string.format("admitted: %d requests, %.2f req/s (non-429)\n", admitted, admitted / seconds))
  if not key or key == "" then
    io.write("note: WRK_API_KEY was not set, so no X-Api-Key was sent (the edge keys by client IP)\n")
  end
end
