-- wrk2 script for the enforcement rows: one API key, responses counted by status.
--
--   WRK_API_KEY=k1 wrk -t2 -c20 -d60s -R200 --latency -s wrk/limit.lua http://127.0.0.1:8080/
--
-- After wrk2's own summary, done() prints the lines that `python -m wrk.loadgen` prints too, with the
-- same labels, so wrk/report.py reads either tool's output:
--
--   responses: 12000
--   status 200: 6012
--   status 429: 5988
--   admitted: 6012 requests, 100.19 req/s (non-429)
--
-- "admitted" is every response that is not a 429; the rate divides it by wrk's measured run time.
-- Each thread counts in its own Lua state (response() runs there); done() runs in the main state
-- and collects the threads' tables with thread:get(), which copies them across.

local key = os.getenv("WRK_API_KEY")
if key and key ~= "" then
  wrk.headers["X-Api-Key"] = key
end

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  counts = {}            -- a global of this thread's state, so that thread:get("counts") finds it
end

function response(status, headers, body)
  counts[status] = (counts[status] or 0) + 1
end

function done(summary, latency, requests)
  local total, by_status, codes = 0, {}, {}
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("counts") or {}) do
      status = tonumber(status)
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
